"""An mlxcel-serve in this process (the embedded SmolLM2 on the CPU), for the server's tests: the
same Server the command runs, its uvicorn in a thread."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from contextlib import contextmanager

from mlxcel.serve.cli import Server


@contextmanager
def running_server(run_dir, *overrides: str):
    log = io.StringIO()
    server = Server([f"hydra.run.dir={run_dir}", "serve.port=0", "runner.device=cpu", *overrides], log=log)
    server.open()
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (server.uvicorn is not None and server.uvicorn.started):
        assert time.monotonic() < deadline and thread.is_alive(), log.getvalue()
        time.sleep(0.05)
    try:
        yield server
    finally:
        server.stop()
        thread.join(30)
        server.close()


def request_json(url: str, body=None, headers: dict | None = None, method: str | None = None, raw: bytes | None = None):
    """(status, parsed JSON body, headers) of one HTTP request (the standard library's client:
    it sends what we tell it, malformed bodies included)."""
    import json
    import urllib.error
    import urllib.request

    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"))
    request.add_header("Content-Type", "application/json")
    for key, value in (headers or {}).items():
        request.add_header(key, value)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read()), dict(reply.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


async def raw_request(port: int, body: bytes, key: str | None = None, hang_up_after: int | None = None) -> tuple:
    """(status, the body as text) over a bare socket; `hang_up_after`: close once that many SSE
    events arrived (a client that goes away mid-answer)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n"
    if key is not None:
        head += f"Authorization: Bearer {key}\r\n"
    writer.write((head + "Connection: close\r\n\r\n").encode() + body)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    if hang_up_after is not None:
        events = 0
        while events < hang_up_after:
            line = await reader.readline()
            if not line:
                break
            events += line.startswith(b"data:")
        writer.close()
        return status, None
    text = (await reader.read()).decode()
    writer.close()
    return status, text


def chat_body(content: str, **extra) -> bytes:
    return json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": content}], **extra}).encode()


def wait_for_idle(engine, seconds: float) -> float:
    began = time.monotonic()
    while engine.accepted_rows or (engine.scheduler and engine.scheduler.live):
        assert time.monotonic() - began < seconds, f"rows still held: {engine.accepted_rows}"
        time.sleep(0.05)
    return time.monotonic() - began
