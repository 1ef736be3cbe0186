"""mlxcel-serve's errors come as errors (issue 39, items 2 and 3): a streamed request the engine
refuses (a prompt over the context, bad token ids, max_tokens past the context) is a 400 before
its status line, not a 200 with an error event and no [DONE]; a message's content must be text or
parts (`123` is a 400); a body sent as anything but JSON is a 415; max_tokens past the context is
a 400 as OpenAI answers; seeds are 64-bit. A client that goes away is one line in the log, not an
ASGI traceback; stats.json is rewritten every 5 s while a request runs; GET /v1/models/{id}
answers. A tiny random Llama in this process (context 512); loopback only."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import threading
import time

import pytest

from mlxcel.openai_messages import convert_messages
from mlxcel.openai_protocol import ApiError, CompletionRequest, parse_request
from mlxcel.serve.engine import ServeEngine
from tests.serve_fixtures import running_server, wait_for_idle

CONTEXT = 512  # the tiny Llama's max_position_embeddings
MODEL = ("model=hf", "serve.model_name=m", "runner.prompt_cache=false", "runner.max_rows=4", "decode.max_tokens=3")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama):
    with running_server(tmp_path_factory.mktemp("serve") / "run", *MODEL, f"model.path={tiny_llama}") as server:
        yield server


def port_of(server) -> int:
    return int(server.url.split(":")[-1].split("/")[0])


def send(server, path: str, body=None, content_type: str | None = "application/json", method: str | None = None):
    """(status, content type, body text) of one request, sent as given."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    connection = http.client.HTTPConnection("127.0.0.1", port_of(server), timeout=120)
    try:
        connection.putrequest(method or ("POST" if data is not None else "GET"), path)
        if content_type is not None:
            connection.putheader("Content-Type", content_type)
        connection.putheader("Content-Length", str(len(data or b"")))
        connection.endheaders(data)
        reply = connection.getresponse()
        return reply.status, reply.getheader("content-type", ""), reply.read().decode()
    finally:
        connection.close()


def strict_json(text: str):
    """JSON as a strict client parses it: -Infinity and NaN are not JSON."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def read_events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def read_rows(server) -> list[dict]:
    return [json.loads(line) for line in (server.run_dir / "generations.jsonl").read_text().splitlines()]


def count_tokens(server, text: str) -> int:
    return len(server.engine.tokenizer.encode(text))


# ---- item 2: a stream the engine refuses is a 400 before it starts ----
@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "hello " * 600}, None),  # over the context
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 600}]}, None),
        ("/v1/completions", {"prompt": [1, 2, 99999]}, "prompt"),  # a token id past the vocabulary
        ("/v1/completions", {"prompt": [[1, 2], [-1]]}, "prompt"),
        ("/v1/completions", {"prompt": "hello", "max_tokens": 10**6}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": CONTEXT},
            "max_tokens",
        ),
    ],
)
def test_a_stream_the_engine_refuses_is_a_400_before_it_starts(server, path, body, param):
    """Before: HTTP 200, then `data: {"error": ...}` and no [DONE] (docs/serve.md promised a 400)."""
    status, kind, text = send(server, path, {"model": "m", "stream": True, **body})
    assert status == 400 and kind.startswith("application/json"), (status, text[:300])
    error = strict_json(text)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert read_rows(server)[-1]["status"] == 400
    wait_for_idle(server.engine, 30)  # (the refused request holds no row)
    status, kind, text = send(server, "/v1/completions", {"model": "m", "prompt": "hello", "stream": True})
    assert status == 200 and kind.startswith("text/event-stream") and read_events(text)[-1] == "[DONE]", text


def test_a_stream_whose_row_the_scheduler_refuses_is_a_400(tmp_path, tiny_llama):
    """The scheduler's own refusal (a row whose KV reservation is past runner.kv_budget_gb) comes
    as a row that ended with finish_reason "error" before the engine says "started": a 400 too."""
    budget = ("runner.kv_budget_gb=0.0001",)  # (~190 tokens of the tiny Llama's KV: the warm-up fits)
    with running_server(tmp_path / "run", *MODEL, *budget, f"model.path={tiny_llama}") as server:
        body = {"model": "m", "prompt": "hello", "max_tokens": 400, "n": 2, "stream": True}
        status, _, text = send(server, "/v1/completions", body)
        assert status == 400 and "runner.kv_budget_gb" in strict_json(text)["error"]["message"], text
        wait_for_idle(server.engine, 30)
        status, _, text = send(server, "/v1/completions", {**body, "max_tokens": 4})
        assert status == 200 and read_events(text)[-1] == "[DONE]", text


def test_a_stream_that_starts_keeps_every_event(server):
    """The events that came with the engine's "started" (a 1-token answer can finish in the same
    iteration) reach the stream: text, finish reason, usage, [DONE]."""
    body = {"model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 1, "stream": True}
    status, _, text = send(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    events = read_events(text)
    assert status == 200 and events[-1] == "[DONE]", text
    chunks = [strict_json(e) for e in events[:-1]]
    finished = sorted(c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    assert finished == [0, 1, 2, 3] and chunks[-1]["usage"]["completion_tokens"] == 4, chunks


def test_max_tokens_past_the_context_is_a_400_not_a_silent_clamp(server):
    prompt = "hello there"
    room = CONTEXT - count_tokens(server, prompt)
    status, _, text = send(server, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": room + 1})
    error = strict_json(text)["error"]
    assert status == 400 and error["param"] == "max_tokens" and error["code"] == "context_length_exceeded", error
    assert f"ask for at most {room}" in error["message"] and str(CONTEXT) in error["message"]
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_completion_tokens": 10**9}
    status, _, text = send(server, "/v1/chat/completions", body)
    assert status == 400 and strict_json(text)["error"]["code"] == "context_length_exceeded", text
    # exactly the room left runs (to the context's end or an end token)
    status, _, text = send(server, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": room})
    assert status == 200 and strict_json(text)["usage"]["completion_tokens"] <= room, text


@pytest.mark.parametrize(
    "message, param",
    [
        ({"role": "user", "content": 123}, "messages.0.content"),
        ({"role": "user", "content": True}, "messages.0.content"),
        ({"role": "user", "content": {"text": "hi"}}, "messages.0.content"),
        ({"role": "user", "content": [{"type": "text", "text": 123}]}, "messages.0.content.0.text"),
        ({"role": 1, "content": "hi"}, "messages.0.role"),
        ({"role": "tool", "content": "4", "tool_call_id": 7}, "messages.0.tool_call_id"),
    ],
)
def test_content_that_is_not_text_is_a_400(message, param):
    """Our Message schema turns numbers into text (a config's `content: 123`); a request's JSON
    number is not text. Before: `"content": 123` was answered as if it were "123"."""
    with pytest.raises(ApiError) as err:
        convert_messages([message], None, [])
    assert err.value.status == 400 and err.value.param == param, err.value.message
    assert "expected a string" in err.value.message


def test_the_server_refuses_content_123(server):
    body = {"model": "m", "messages": [{"role": "user", "content": 123}]}
    status, _, text = send(server, "/v1/chat/completions", body)
    error = strict_json(text)["error"]
    assert status == 400 and error["param"] == "messages.0.content", error
    assert error["message"] == "messages[0].content: expected a string or an array of content parts, got an integer"


@pytest.mark.parametrize(
    "content_type, status",
    [
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),  # (curl -d without -H)
        ("multipart/form-data; boundary=x", 415),
        ("application/json", 200),
        ("application/json; charset=utf-8", 200),
        ("Application/JSON", 200),
        ("application/vnd.api+json", 200),
        (None, 200),  # (none said: taken as JSON, as FastAPI does)
    ],
)
def test_a_body_not_sent_as_json_is_a_415(server, content_type, status):
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 1}).encode()
    got, kind, text = send(server, "/v1/completions", body, content_type)
    assert got == status and kind.startswith("application/json"), text
    if status == 415:
        error = strict_json(text)["error"]
        assert "Content-Type: application/json" in error["message"] and error["code"] == "unsupported_media_type"


@pytest.mark.parametrize(
    "seed, ok", [(2**63 - 1, True), (-(2**63), True), (2**63, False), (-(2**63) - 1, False), (2**64, False)]
)
def test_seeds_outside_64_bits_are_400s(seed, ok):
    body = {"model": "m", "prompt": "x", "seed": seed}
    if ok:
        assert parse_request(CompletionRequest, body).seed == seed
        return
    with pytest.raises(ApiError) as err:
        parse_request(CompletionRequest, body)
    assert err.value.status == 400 and err.value.param == "seed", err.value.message


@pytest.mark.parametrize("key", ["1" * 5000, "\u00b2", "\u0663", "+1", "1_0"])
def test_logit_bias_keys_are_ascii_token_ids(key):
    """int() cannot read "²" (which isdigit() takes) nor 5000 digits: they were 500s; "٣" was read
    as token 3 (odd ids of the fuzz's kind)."""
    from mlxcel.openai_protocol import ChatRequest, make_sampler_config
    from mlxcel.sampling.config import SamplerConfig

    request = parse_request(ChatRequest, {"model": "m", "messages": [], "logit_bias": {key: 1}})
    with pytest.raises(ApiError) as err:
        make_sampler_config(SamplerConfig(), request, 100)
    assert err.value.status == 400 and err.value.param == "logit_bias", err.value.message


def test_an_integer_past_pythons_digit_limit_is_a_400(server):
    """json.loads raises a plain ValueError (not a JSONDecodeError) for 5000 digits: it was a 500."""
    body = b'{"model": "m", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"
    status, _, text = send(server, "/v1/completions", body)
    assert status == 400 and "not valid JSON" in strict_json(text)["error"]["message"], text


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_masked_alternatives_are_json(server, stream):
    """top_k=1 leaves the other alternatives -inf: a whole answer could not be encoded (500) and a
    stream wrote `-Infinity`, which no JSON parser takes. They are OpenAI's -9999.0."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 3,
        "stream": stream,
        "mlxcel": {"sampler": {"processors": {"top_k": {"k": 1}}}},
    }
    status, _, text = send(server, "/v1/chat/completions", body)
    assert status == 200, text
    if stream:
        chunks = [strict_json(e) for e in read_events(text)[:-1]]
        content = [c for chunk in chunks for c in ((chunk["choices"][0].get("logprobs") or {}).get("content") or [])]
    else:
        content = strict_json(text)["choices"][0]["logprobs"]["content"]
    assert content and all(entry["top_logprobs"][-1]["logprob"] == -9999.0 for entry in content), content


# ---- item 3: GET /v1/models/{id} ----
def test_a_model_by_its_id(server, tiny_llama):
    status, _, text = send(server, "/v1/models/m")
    model = strict_json(text)
    assert status == 200 and isinstance(model.pop("created"), int), text
    assert model == {"id": "m", "object": "model", "owned_by": "mlxcel"}
    assert send(server, "/v1/models")[2] == json.dumps(
        {"object": "list", "data": [strict_json(text)]}, separators=(",", ":")
    )
    status, _, text = send(server, f"/v1/models/{tiny_llama}")  # (model.path: an id with slashes)
    assert status == 200 and strict_json(text)["id"] == "m", text
    status, _, text = send(server, "/v1/models/gpt-4o")
    assert status == 404, text
    assert strict_json(text) == {
        "error": {
            "message": "model 'gpt-4o' is not served here; this server serves 'm'",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def test_a_model_by_its_id_asks_for_the_key(tmp_path, tiny_llama, monkeypatch):
    monkeypatch.setenv("MLXCEL_API_KEYS", "sk-a")
    with running_server(tmp_path / "run", *MODEL, f"model.path={tiny_llama}") as server:
        status, _, text = send(server, "/v1/models/m")
        assert status == 401 and strict_json(text)["error"]["type"] == "authentication_error"


# ---- item 3: a client that goes away is one line ----
class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage() + (" (traceback)" if record.exc_info else ""))


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_is_one_line_not_a_traceback(tmp_path, tiny_llama, monkeypatch, stream):
    """Our disconnect watcher sees the hang-up before Starlette's own listener does (made certain
    here: the listener waits forever). Before: ClientDisconnect left the stream and uvicorn printed
    "Exception in ASGI application" with a traceback."""
    import asyncio

    from starlette.responses import StreamingResponse

    from tests.serve_fixtures import chat_body

    async def never(self, receive):
        await asyncio.Event().wait()

    monkeypatch.setattr(StreamingResponse, "listen_for_disconnect", never)
    release, holding, original = threading.Event(), threading.Event(), ServeEngine.on_token

    def held_token(self, row, token):  # the answer is still running when the client goes
        going_on = original(self, row, token)
        if self.rows[row][0].id != "warm-up":
            holding.set()
            release.wait(30)
        return going_on

    monkeypatch.setattr(ServeEngine, "on_token", held_token)
    handler, stack = Records(), contextlib.ExitStack()
    logging.getLogger("uvicorn.error").addHandler(handler)
    logging.getLogger("asyncio").addHandler(handler)
    try:
        server = stack.enter_context(running_server(tmp_path / "run", *MODEL, f"model.path={tiny_llama}"))
        before = server.log.getvalue()
        body = chat_body("Tell me a long story.", model="m", stream=stream, max_tokens=400)
        with socket.create_connection(("127.0.0.1", port_of(server)), timeout=60) as client:
            head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
            client.sendall(head.encode() + body)
            assert holding.wait(30)
            if stream:  # the stream has started (its role chunk came)
                answer = b""
                while b"data:" not in answer:
                    answer += client.recv(4096)
                assert answer.startswith(b"HTTP/1.1 200"), answer
        wait_for_disconnect(server)
        release.set()
        wait_for_idle(server.engine, 30)
        rows = read_rows(server)
        assert rows[-1]["status"] == "disconnected" and rows[-1]["stream"] is stream, rows[-1]
        said = server.log.getvalue()[len(before) :].splitlines()
    finally:
        release.set()
        stack.close()
        logging.getLogger("uvicorn.error").removeHandler(handler)
        logging.getLogger("asyncio").removeHandler(handler)
    assert not handler.lines, handler.lines
    assert len(said) == 1 and "the client disconnected" in said[0] and rows[-1]["id"] in said[0], said


def wait_for_disconnect(server) -> None:
    """Until the engine was told to cancel the request (the app saw the hang-up)."""
    deadline = time.monotonic() + 30
    while not any(job.cancelled for job, _ in list(server.engine.rows.values())):
        assert time.monotonic() < deadline, "the hang-up was never seen"
        time.sleep(0.01)


def test_an_event_stream_whose_writes_fail_ends_quietly():
    """ASGI 2.4 servers raise OSError from send() once the client is gone; Starlette turns it into
    ClientDisconnect out of the response (a traceback). The stream ends quietly and its generator's
    `finally` runs at once."""
    import asyncio

    from mlxcel.serve.app import EventStream

    closed = []

    async def events():
        try:
            for i in range(100):
                yield f"data: {i}\n\n"
        finally:
            closed.append(True)

    sent = []

    async def send(message):
        sent.append(message)
        if len(sent) > 2:
            raise OSError("the client went away")

    async def receive():
        await asyncio.Event().wait()

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    asyncio.run(EventStream(events(), media_type="text/event-stream")(scope, receive, send))
    assert closed == [True] and len(sent) == 3


# ---- item 3: stats.json during a long request ----
def test_stats_json_is_rewritten_while_a_request_runs(tmp_path, tiny_llama, monkeypatch):
    """docs/serve.md: "stats.json, rewritten every 5 s". Before, it was rewritten only when a
    request ended: a request of minutes left it as it was at the start. The engine is held on the
    request's first token (it is in flight for certain) and the interval made short; the file must
    change under it and show the row in flight."""
    from mlxcel.serve import records as serve_records

    release, original = threading.Event(), ServeEngine.on_token
    holding = threading.Event()

    def held_token(self, row, token):
        if self.rows[row][0].id != "warm-up":
            holding.set()
            release.wait(60)
        return original(self, row, token)

    monkeypatch.setattr(ServeEngine, "on_token", held_token)
    monkeypatch.setattr(serve_records, "STATS_EVERY_SECONDS", 0.01)
    with running_server(tmp_path / "run", *MODEL, f"model.path={tiny_llama}") as server:
        stats_path = server.run_dir / "stats.json"
        answer: dict = {}
        body = {"model": "m", "prompt": "hello", "max_tokens": 5}
        asking = threading.Thread(target=lambda: answer.update(reply=send(server, "/v1/completions", body)))
        asking.start()
        try:
            assert holding.wait(60)
            first = json.loads(stats_path.read_text())
            deadline = time.monotonic() + 60
            while True:  # (the deadline only ends a failing wait: nothing here is timed)
                stats = json.loads(stats_path.read_text())
                if stats["uptime_s"] > first["uptime_s"] and stats["rows_in_flight"] == 1:
                    break
                assert time.monotonic() < deadline, (first, stats)
                time.sleep(0.01)
            assert "reply" not in answer and stats["status"] == "running" and stats["requests"] == first["requests"]
        finally:
            release.set()
            asking.join(60)
        assert answer["reply"][0] == 200, answer
