"""mlxcel-serve driven by the official `openai` client (and raw HTTP where a client would not send
what we test): greedy answers equal mlxcel-run's, streaming as OpenAI's clients parse it, request
fields reach the sampler, errors are OpenAI error objects, and the run folder keeps no text unless
asked. The embedded SmolLM2 on the CPU."""

from __future__ import annotations

import base64
import json

import pytest

from tests.helpers import read_run, run_cli
from tests.serve_fixtures import request_json, running_server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow  # loads the real embedded model

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    images = folder / "images"
    images.mkdir()
    with running_server(folder / "run", "decode.max_tokens=24", f"serve.image_dirs=[{images}]") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def test_greedy_answers_equal_mlxcel_runs(server, client, tmp_path):
    """The same prompt and config through mlxcel-run (a subprocess) and the server, streamed and
    not: the same text."""
    result = run_cli(tmp_path, f"prompt.text={QUESTION}", "decode.max_tokens=24")
    assert result.returncode == 0, result.stderr
    _, rows, _ = read_run(tmp_path)
    expected = rows[0]["text"]
    messages = [{"role": "user", "content": QUESTION}]
    answer = client.chat.completions.create(model="smollm2", messages=messages)
    assert answer.choices[0].message.content == expected
    assert answer.choices[0].finish_reason == rows[0]["finish_reason"]
    assert answer.usage.prompt_tokens == rows[0]["prompt_tokens"]
    assert answer.usage.completion_tokens == rows[0]["generated_tokens"]
    stream = client.chat.completions.create(
        model="smollm2", messages=messages, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        rows[0]["finish_reason"]
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == rows[0]["generated_tokens"]
    # the second identical request adopted the first one's prompt from the cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_completions_raw_prompts_token_ids_and_echo(client):
    text = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=8)
    assert text.object == "text_completion" and text.choices[0].finish_reason == "length"
    assert text.usage.completion_tokens == 8
    tokenizer_ids = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=1, echo=True)
    assert tokenizer_ids.choices[0].text.startswith("Once upon a time")
    batch = client.completions.create(model="smollm2", prompt=["Once upon a time", "The sky is"], max_tokens=4)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == text.choices[0].text[: len(batch.choices[0].text)]
    streamed = client.completions.create(model="smollm2", prompt="Once upon a time", max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text


def test_seeded_sampling_repeats_and_n_gives_distinct_rows(client):
    messages = [{"role": "user", "content": "Write a word."}]
    kwargs = dict(model="smollm2", messages=messages, temperature=1.5, seed=7, max_tokens=12)
    first = client.chat.completions.create(n=3, **kwargs)
    again = client.chat.completions.create(n=3, **kwargs)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1  # each choice its own random stream
    other = client.chat.completions.create(n=3, **{**kwargs, "seed": 8})
    assert [c.message.content for c in other.choices] != texts


def test_logprobs_and_logit_bias_reach_the_sampler(client):
    messages = [{"role": "user", "content": QUESTION}]
    answer = client.chat.completions.create(model="smollm2", messages=messages, logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    assert "".join(c.token for c in content) == answer.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy takes the top token
    first = content[0].token
    # banning the greedy first token changes the answer's start
    from mlxcel.tokenizer import load_tokenizer
    from tests.helpers import find_smollm2_gguf

    banned = load_tokenizer(find_smollm2_gguf(), "auto").encode(first, add_special_tokens=False)[0]
    biased = client.chat.completions.create(model="smollm2", messages=messages, logit_bias={str(banned): -100})
    assert not biased.choices[0].message.content.startswith(first)
    # our own samplers under the `mlxcel` field: mirostat through the extra body
    mirostat = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        seed=1,
        extra_body={"mlxcel": {"sampler": {"selector": {"kind": "mirostat_v2", "tau": 3.0}}}},
    )
    assert mirostat.choices[0].message.content


def test_stop_strings_end_the_answer(client):
    messages = [{"role": "user", "content": QUESTION}]
    full = client.chat.completions.create(model="smollm2", messages=messages).choices[0].message.content
    word = full.split()[2]
    cut = client.chat.completions.create(model="smollm2", messages=messages, stop=[word])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[: full.index(word)]


def test_images_need_a_vision_model_and_are_never_fetched(server, client):
    """SmolLM2 is text-only: a data: URL image reaches the model check (400 naming it); an
    http(s) URL is refused before anything; a local path outside serve.image_dirs too."""
    from PIL import Image

    buffer = __import__("io").BytesIO()
    Image.new("RGB", (8, 8), "red").save(buffer, "PNG")
    data = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    for url, fragment in [
        (data, "text-only model"),
        ("https://example.com/cat.png", "not fetched"),
        ("/etc/passwd", "not a file under serve.image_dirs"),
    ]:
        content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": content}])
        assert fragment in err.value.body["message"], err.value.body


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        ({"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, "frobnicate", "unknown or unsupported"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature", "less than or equal"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs", "logprobs=true"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": []}, "tools", "at least one function"),
        (  # SmolLM2's template has no tools
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            "tools",
            "does not render tools",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
            "response_format.type",
            "json",
        ),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "messages[0]"),
        ({"messages": []}, "messages", "empty"),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"999999": 1}}, "logit_bias", "token ids"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "mlxcel": {"sampler": {"processors": {"top_q": {}}}}},
            "mlxcel.sampler",
            "top_q",
        ),
    ],
)
def test_bad_requests_are_400s_naming_the_field(server, body, param, fragment):
    status, reply, _ = request_json(f"{server.url}/chat/completions", {"model": "smollm2", **body})
    assert status == 400, reply
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and fragment in error["message"], error
    if param is not None:
        assert error["param"] == param


def test_ignored_fields_are_accepted_and_unknown_models_are_404s(server, client):
    answer = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "hi"}], user="u1", metadata={"a": "b"}, store=False
    )
    assert answer.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert [m.id for m in client.models.list()] == ["smollm2"]
    assert request_json(f"{server.url.removesuffix('/v1')}/health")[1] == {"status": "ok"}


def test_a_client_that_hangs_up_frees_its_row_at_once(server):
    """2,000 tokens of SmolLM2 take minutes here; the row is cancelled once the client hangs up,
    long before its 2,000 tokens (counted in tokens, not seconds: a loaded machine is slow)."""
    import asyncio

    from tests.serve_fixtures import chat_body, raw_request, wait_for_idle

    port = int(server.url.split(":")[-1].split("/")[0])
    body = chat_body("Tell me a long story.", stream=True, max_tokens=2000)
    status, _ = asyncio.run(raw_request(port, body, key=None, hang_up_after=3))
    assert status == 200
    wait_for_idle(server.engine, 120)  # (a guard against a hang, not a figure)
    rows = [json.loads(line) for line in (server.run_dir / "generations.jsonl").read_text().splitlines()]
    assert rows[-1]["status"] == "disconnected" and rows[-1]["completion_tokens"] < 1000


def test_the_run_folder_keeps_figures_not_text(server, client):
    client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "A secret phrase"}])
    server.records.write_stats()
    folder = server.run_dir
    rows = [json.loads(line) for line in (folder / "generations.jsonl").read_text().splitlines()]
    assert rows and all("texts" not in r and "prompts" not in r for r in rows)
    assert "secret" not in (folder / "generations.jsonl").read_text()
    stats = json.loads((folder / "stats.json").read_text())
    assert stats["mode"] == "serve" and stats["requests"]["200"] >= 1 and stats["generated_tokens"] > 0
    config = json.loads((folder / "config.resolved.json").read_text())
    assert config["serve"]["port"] == 0


@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
def test_every_streamed_chunk_is_openais_shape(server, endpoint):
    """Raw SSE: every data line is JSON of the chunk shape (text chunks are written from a
    template: they must equal what the general path writes), then [DONE]."""
    import urllib.request

    body = {"model": "smollm2", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 8}
    body.update(
        {"messages": [{"role": "user", "content": QUESTION}]}
        if endpoint == "chat/completions"
        else {"prompt": "Once upon"}
    )
    request = urllib.request.Request(
        f"{server.url}/{endpoint}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        events = [e for e in reply.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    kind = "chat.completion.chunk" if endpoint == "chat/completions" else "text_completion"
    keys = (
        {"index", "delta", "logprobs", "finish_reason"}
        if kind.startswith("chat")
        else {"index", "text", "logprobs", "finish_reason"}
    )
    for chunk in chunks[:-1]:
        assert chunk["object"] == kind and set(chunk) == {
            "id",
            "object",
            "created",
            "model",
            "system_fingerprint",
            "choices",
            "usage",
        }
        assert chunk["usage"] is None and len(chunk["choices"]) == 1 and set(chunk["choices"][0]) == keys
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    assert len({c["id"] for c in chunks}) == 1


def test_sigterm_mid_stream_stops_the_server_cleanly(tmp_path):
    """The mlxcel-serve command (a subprocess, OpenBLAS re-exec and all) under SIGTERM while a
    stream runs: the stream ends, the process exits 0 within the grace period, and the run
    folder says it completed, stopped by SIGTERM, with the request's row."""
    import asyncio
    import os
    import re
    import signal
    import subprocess
    import sys

    from tests.helpers import REPO
    from tests.serve_fixtures import chat_body

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "mlxcel.serve.cli", "serve.port=0", f"hydra.run.dir={run_dir}"]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in process.stderr:
            found = re.search(r"at http://127\.0\.0\.1:(\d+)/v1", line)
            if found:
                port = int(found.group(1))
                break
        assert port is not None, "the server never said where it listens"

        async def stream_then_terminate():
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = chat_body("Tell me a very long story.", stream=True, max_tokens=2000)
            head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
            writer.write(head.encode() + body)
            await writer.drain()
            await reader.readuntil(b"data:")  # the answer has started
            process.send_signal(signal.SIGTERM)
            rest = await asyncio.wait_for(reader.read(), timeout=60)  # the server ends the stream
            writer.close()
            return rest

        asyncio.run(stream_then_terminate())
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    stats = json.loads((run_dir / "stats.json").read_text())
    assert stats["status"] == "completed" and stats["stopped_by"] == "SIGTERM"
    rows = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["stream"] is True and rows[0]["completion_tokens"] >= 0
