"""An mlxcel-serve in this process (the embedded SmolLM2 on the CPU), for the server's tests: the
same Server the command runs, its uvicorn in a thread."""

from __future__ import annotations

import io
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
