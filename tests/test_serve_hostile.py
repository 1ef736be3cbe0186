"""mlxcel-serve against hostile or broken requests (issue 38, items 9 and 10): one request is one
request. Whatever goes wrong while one request's state is built (a lone UTF-16 surrogate in its
text, a sampler that cannot be built, an exception of ours) answers that request with an error and
the engine serves on; an API keys file without a key is a config error at start; a stop (SIGTERM)
ends the requests in flight with a finish reason and a row each, without a traceback. A tiny random
Llama in this process (the requests, not the model, are under test); loopback only."""

from __future__ import annotations

import json
import sys
import threading
import urllib.request

import pytest

from mlxcel.errors import ConfigError, ConfigIssue
from mlxcel.openai_protocol import ApiError, ChatRequest, CompletionRequest, make_sampler_config, parse_request
from mlxcel.serve import cli as serve_cli
from mlxcel.serve.engine import ServeEngine
from tests.serve_fixtures import request_json, running_server

MODEL = ("model=hf", "serve.model_name=m", "runner.prompt_cache=false", "runner.max_rows=4")


def completion(prompt="hello", **extra) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": 3, **extra}


def raw_chat(content_json: str, **extra) -> bytes:
    """A chat body with `content_json` written as is (JSON's \\ud800 escapes survive)."""
    fields = "".join(f", {json.dumps(k)}: {json.dumps(v)}" for k, v in extra.items())
    return f'{{"model": "m", "messages": [{{"role": "user", "content": {content_json}}}]{fields}}}'.encode()


def health(server) -> dict:
    return request_json(server.url.removesuffix("/v1") + "/health")[1]


def read_rows(server) -> list[dict]:
    return [json.loads(line) for line in (server.run_dir / "generations.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama):
    with running_server(tmp_path_factory.mktemp("serve") / "run", *MODEL, f"model.path={tiny_llama}") as server:
        yield server


# ---- item 9: a lone surrogate is a 400 naming the field ----
@pytest.mark.parametrize(
    "kind, body, param",
    [
        (ChatRequest, {"messages": [{"role": "user", "content": "\ud800 hi"}]}, "messages.0.content"),
        (
            ChatRequest,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "ok \udfff"}]}]},
            "messages.0.content.0.text",
        ),
        (ChatRequest, {"messages": [{"role": "user", "content": "hi"}], "stop": ["\ud83d"]}, "stop.0"),
        (CompletionRequest, {"prompt": "\ud800 hi"}, "prompt"),
        (CompletionRequest, {"prompt": ["fine", "not \ud800 fine"]}, "prompt.1"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(kind, body, param):
    with pytest.raises(ApiError) as err:
        parse_request(kind, {"model": "m", **body})
    assert err.value.status == 400 and err.value.param == param
    assert err.value.message.startswith(f"{param}: ") and "surrogate" in err.value.message
    err.value.message.encode("utf-8")  # (the answer that quotes it must encode)


def test_a_surrogate_in_a_key_is_a_400_and_the_answer_encodes():
    with pytest.raises(ApiError) as err:
        parse_request(ChatRequest, {"model": "m", "messages": [], "\ud800": 1})
    assert err.value.status == 400 and "surrogate" in err.value.message
    json.dumps(err.value.body(), ensure_ascii=False).encode("utf-8")


def test_the_server_answers_a_surrogate_with_400_and_serves_on(server):
    """Before: the tokenizer's TypeError escaped the engine, the request never answered and every
    later one got 503 (/health: failed)."""
    status, reply, _ = request_json(f"{server.url}/chat/completions", raw=raw_chat('"\\ud800 hi"', max_tokens=3))
    assert status == 400 and reply["error"]["param"] == "messages.0.content", reply
    status, reply, _ = request_json(f"{server.url}/completions", raw=b'{"model": "m", "prompt": "\\udc00"}')
    assert status == 400 and reply["error"]["param"] == "prompt", reply
    status, reply, _ = request_json(f"{server.url}/completions", completion())
    assert status == 200 and reply["choices"][0]["finish_reason"] == "length", reply
    assert health(server) == {"status": "ok"}


# ---- item 9: any failure building one request's state answers that request only ----
def test_an_unexpected_failure_building_a_request_answers_it_alone(server, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug of ours\nwith a second line")

    monkeypatch.setattr(server.engine.pipeline, "make_text_stream", broken)  # (inside start_job)
    status, reply, _ = request_json(f"{server.url}/completions", completion())
    assert status == 500, reply
    assert reply["error"]["type"] == "server_error"
    assert reply["error"]["message"] == "the request could not be prepared: RuntimeError: a bug of ours"
    # a stream is refused before its status line (issue 39, item 2): the same 500, not a 200 that
    # ends with an error event
    status, reply, _ = request_json(f"{server.url}/completions", completion(stream=True))
    assert status == 500 and reply["error"]["type"] == "server_error", reply
    monkeypatch.undo()
    assert server.engine.accepted_rows == 0  # (the failed requests' rows went back to the queue)
    status, reply, _ = request_json(f"{server.url}/completions", completion())
    assert status == 200, reply
    assert health(server) == {"status": "ok"}
    assert [row["status"] for row in read_rows(server)[-3:]] == [500, 500, 200]


@pytest.mark.parametrize("failure", [MemoryError, ValueError("a window of 10**12 tokens")])
def test_a_sampler_that_fails_to_build_is_a_400_for_that_request(server, monkeypatch, failure):
    """A request's chain built for its own settings (e.g. a huge allocation): the request's 400."""

    def broken(config=None):
        raise failure

    monkeypatch.setattr(server.engine.pipeline, "make_sampler", broken)
    body = completion(mlxcel={"sampler": {"processors": {"temperature": {"value": 0.123}}}})  # (a chain not cached)
    status, reply, _ = request_json(f"{server.url}/completions", body)
    assert status == 400 and reply["error"]["param"] == "mlxcel.sampler", reply
    assert reply["error"]["message"].startswith("the request's sampler settings: ")
    monkeypatch.undo()
    assert request_json(f"{server.url}/completions", completion())[0] == 200
    assert health(server) == {"status": "ok"}


@pytest.mark.parametrize(
    "sampler, field",
    [
        ({"min_keep": 10**12}, "min_keep"),
        ({"processors": {"penalties": {"repeat": 1.1, "last_n": 10**12}}}, "penalties.last_n"),
        ({"processors": {"dry": {"multiplier": 1.0, "last_n": 10**12}}}, "dry.last_n"),
    ],
)
def test_sampler_sizes_out_of_bounds_are_400s_naming_the_key(sampler, field):
    """The schema's bounds (a 3.64 TiB history allocation stopped the engine) reach a request as a
    400 that names the key, a top-level one included."""
    from mlxcel.sampling.config import SamplerConfig

    request = parse_request(ChatRequest, {"model": "m", "messages": [], "mlxcel": {"sampler": sampler}})
    with pytest.raises(ApiError) as err:
        make_sampler_config(SamplerConfig(), request, 100)
    assert err.value.status == 400 and err.value.param == "mlxcel.sampler"
    assert f"the request's sampler settings: {field}: must be in" in err.value.message


def test_a_config_error_from_the_sampler_schema_is_a_400(monkeypatch):
    """Whatever the sampler's schema raises for a request's mlxcel.sampler is a 400 naming it: a
    pydantic error (test_serve_protocol) or a ConfigError a check raises itself."""
    import mlxcel.openai_protocol as protocol
    from mlxcel.sampling.config import SamplerConfig

    base = SamplerConfig()

    class Refusing:
        @staticmethod
        def model_validate(data):
            raise ConfigError(ConfigIssue("sampler.processors.dry.last_n", "must be <= 512", 10**12))

    monkeypatch.setattr(protocol, "SamplerConfig", Refusing)
    request = parse_request(ChatRequest, {"model": "m", "messages": [], "mlxcel": {"sampler": {}}})
    with pytest.raises(ApiError) as err:
        make_sampler_config(base, request, 100)
    assert err.value.status == 400 and err.value.param == "mlxcel.sampler"
    assert "dry.last_n: must be <= 512 (got 1000000000000)" in err.value.message


# ---- item 10: an API keys file without a key ----
@pytest.mark.parametrize("text", ["", "# team keys\n\n   \n# sk-old\n"])
def test_an_api_keys_file_without_a_key_is_a_config_error(tmp_path, monkeypatch, text):
    keys = tmp_path / "keys"
    keys.write_text(text)
    monkeypatch.setenv("MLXCEL_API_KEYS", "sk-from-the-variable")  # (the file was meant to hold some)
    with pytest.raises(ConfigError) as err:
        serve_cli.load_api_keys(str(keys))
    assert err.value.issues[0].path == "serve.api_keys_file" and str(keys) in err.value.format()
    with pytest.raises(ConfigError, match="serve.api_keys_file: cannot read it"):
        serve_cli.load_api_keys(str(tmp_path / "missing"))


def test_mlxcel_serve_refuses_a_keys_file_without_a_key_with_exit_2(tmp_path, monkeypatch, capsys):
    from mlxcel.cli import run_command

    keys = tmp_path / "keys"
    keys.write_text("# nothing here yet\n")
    monkeypatch.setattr(sys, "argv", ["mlxcel-serve", f"serve.api_keys_file={keys}", f"hydra.run.dir={tmp_path}/run"])
    with pytest.raises(SystemExit) as exited:
        run_command(serve_cli.serve)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "mlxcel: config error: serve.api_keys_file: holds no API key" in error and str(keys) in error
    assert not (tmp_path / "run").exists()


# ---- item 10: a stop with requests in flight ----
def test_a_stop_ends_requests_in_flight_with_a_finish_reason_and_a_row(tmp_path, tiny_llama, monkeypatch):
    """server.stop() is what SIGTERM does (the subprocess test below sends the signal): the rows in
    flight end "cancelled" once the grace is over, and their answers complete and are recorded.
    Before: uvicorn cancelled the handlers (a whole answer: a plain-text 500 and no row; a stream cut
    without a finish reason)."""
    import time

    monkeypatch.setattr(serve_cli, "GRACEFUL_SHUTDOWN_SECONDS", 0)
    original = ServeEngine.on_token

    def slow_token(self, row, token):  # (400 tokens take seconds: they are in flight at the stop)
        time.sleep(0.01)
        return original(self, row, token)

    monkeypatch.setattr(ServeEngine, "on_token", slow_token)
    answers: dict[str, object] = {}
    with running_server(tmp_path / "run", *MODEL, f"model.path={tiny_llama}") as server:

        def ask(name: str, stream: bool) -> None:
            body = completion(max_tokens=400, stream=stream)
            request = urllib.request.Request(
                f"{server.url}/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
                method="POST",
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as answer:
                    answers[name] = (answer.status, answer.read().decode())
            except Exception as exc:  # (reported by the assertions below)
                answers[name] = exc

        threads = [threading.Thread(target=ask, args=(name, name == "stream")) for name in ("whole", "stream")]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while len(server.engine.rows) < 2:  # both requests decoding
            assert time.monotonic() < deadline and all(t.is_alive() for t in threads), answers
            time.sleep(0.01)
        server.stop()
        for thread in threads:
            thread.join(60)
    status, text = answers["whole"]
    assert status == 200 and json.loads(text)["choices"][0]["finish_reason"] == "cancelled", text
    status, text = answers["stream"]
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]", events[-3:]
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "cancelled"
    rows = [json.loads(line) for line in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()]
    assert sorted(row["stream"] for row in rows) == [False, True]
    assert all(row["status"] == 200 and row["finish_reasons"] == ["cancelled"] for row in rows), rows


@pytest.mark.slow
def test_sigterm_with_requests_in_flight_ends_them_without_a_traceback(tmp_path):
    """The mlxcel-serve command (the embedded SmolLM2, a subprocess) under SIGTERM with a whole and
    a streamed answer running (2000 tokens: seconds after the 1 s grace): both end with a finish
    reason and a row in generations.jsonl; stderr has no traceback (it had two CancelledErrors)."""
    import asyncio
    import os
    import re
    import signal
    import subprocess

    from tests.helpers import REPO
    from tests.serve_fixtures import chat_body

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run_dir = tmp_path / "run"
    code = "import mlxcel.serve.cli as c; c.GRACEFUL_SHUTDOWN_SECONDS = 1; c.main()"
    command = [sys.executable, "-c", code, "serve.port=0", "serve.host=127.0.0.1", f"hydra.run.dir={run_dir}"]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        port, lines = None, []
        for line in process.stderr:
            lines.append(line)
            found = re.search(r"at http://127\.0\.0\.1:(\d+)/v1", line)
            if found:
                port = int(found.group(1))
                break
        assert port is not None, "".join(lines)

        async def ask(stream: bool, started: asyncio.Event | None = None) -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = chat_body("Tell me a very long story.", stream=stream, max_tokens=2000)
            head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
            writer.write(head.encode() + body)
            await writer.drain()
            answer = b""
            if started is not None:
                answer = await asyncio.wait_for(reader.readuntil(b"data:"), timeout=120)
                started.set()
            answer += await asyncio.wait_for(reader.read(), timeout=120)
            writer.close()
            return answer

        async def ask_then_terminate():
            whole = asyncio.ensure_future(ask(False))
            await asyncio.sleep(0.2)  # (the whole answer's request goes in first)
            started = asyncio.Event()
            stream = asyncio.ensure_future(ask(True, started))
            await asyncio.wait_for(started.wait(), timeout=120)  # both are decoding
            process.send_signal(signal.SIGTERM)
            return await whole, await stream

        whole, stream = asyncio.run(ask_then_terminate())
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    errors = "".join(lines) + process.stderr.read()
    assert "Traceback" not in errors and "CancelledError" not in errors, errors
    assert whole.startswith(b"HTTP/1.1 200"), whole[:300]
    reason = json.loads(whole.split(b"\r\n\r\n", 1)[1])["choices"][0]["finish_reason"]
    assert reason in ("cancelled", "stop", "length")
    assert b'"finish_reason":"' in stream and b"data: [DONE]" in stream, stream[-500:]
    rows = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert sorted(row["stream"] for row in rows) == [False, True]
    assert all(row["status"] == 200 and row["finish_reasons"] for row in rows), rows
    stats = json.loads((run_dir / "stats.json").read_text())
    assert stats["status"] == "completed" and stats["stopped_by"] == "SIGTERM"
