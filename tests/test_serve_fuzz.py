"""mlxcel-serve under a seeded fuzz (issue 39, item 1): odd strings, ids and types in every field of
every endpoint (nulls, huge ints, floats for ints, nested lists, empty objects, unknown roles, bad
image URLs, NaN as a string and as a JSON literal, very long strings within serve.max_body_mb, bodies
that are not JSON or not application/json). Every answer is OpenAI's JSON error object with a 4xx,
or a 200 where the request is valid (a stream then ends with [DONE]); never a 5xx. Afterwards a
normal request answers 200, /health says ok and no row is held. A tiny random Llama in this
process, loopback only; the requests are random but seeded (the failing case is printed whole)."""

from __future__ import annotations

import http.client
import json
import random
import urllib.parse

import pytest

from tests.serve_fixtures import running_server, wait_for_idle

SEED = 39
REQUESTS = 200
MAX_BODY_MB = 1  # (the long strings stay within it; one body goes past it: 413)
MODEL = (
    "model=hf",
    "serve.model_name=m",
    "runner.prompt_cache=false",
    "runner.max_rows=4",
    "decode.max_tokens=3",
    f"serve.max_body_mb={MAX_BODY_MB}",
)
LONG = 300_000  # characters: a prompt far over the tiny model's context of 512, a body under 1 MB

ODD_STRINGS = [
    "",
    " ",
    "\x00",
    "\t\n",
    "NaN",
    "Infinity",
    "-1",
    "1e309",
    "null",
    "true",
    "<|im_end|>",
    "<|endoftext|>",
    "\u202e\u200b",
    "\U0001f4a5" * 40,
    "\ufffd",
    "²",
    "٣",
    "../../etc/passwd",
    "%00",
    "x" * 5000,
]
ODD_NUMBERS = [0, -1, 1, 2, 3.5, -0.0, 1e308, -1e308, 2**31, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30)]
ODD_SHAPES = [None, True, False, [], {}, [[]], [[[]]], [None], [1, [2, [3]]], {"": None}, {"a": {"b": {"c": []}}}]
ODD_VALUES = ODD_STRINGS + ODD_NUMBERS + ODD_SHAPES

CHAT_FIELDS = [
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "frequency_penalty",
    "presence_penalty",
    "response_format",
    "modalities",
    "mlxcel",
    "user",
    "metadata",
    "tools",
    "functions",
    "",
    "\u00e9",
]
COMPLETION_FIELDS = [
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "best_of",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "echo",
    "suffix",
    "logit_bias",
    "mlxcel",
]
ROLES = ["user", "system", "developer", "assistant", "tool", "function", "wizard", "", "USER", None, 1, ["user"]]
IMAGE_URLS = [
    "https://example.com/cat.png",
    "http://127.0.0.1:1/x.png",
    "ftp://x/y.png",
    "data:,",
    "data:image/png;base64,",
    "data:image/png;base64,!!!not base64!!!",
    "data:image/png;base64,aGVsbG8=",  # (valid base64, not an image; and this model reads no images)
    "data:text/html;base64,PGI+aGk8L2I+",
    "data:image/svg+xml;base64,PHN2Zy8+",
    "file:///etc/passwd",
    "/etc/passwd",
    "IMAGES/dot.png",
    "IMAGES/../../../../etc/passwd",
    "IMAGES/not-an-image.png",
    "",
    "x" * 5000,
]
ODD_MODEL_IDS = ["m", "x", "", "gpt-4o", "m/extra", "../m", "%00", "\u00e9", "a" * 3000, "org/model"]
# valid requests that take unusual paths through the engine (each is a 200)
VALID_CHAT = [
    {"stream": True, "stream_options": {"include_usage": True}},
    {"n": 3, "seed": 2**63 - 1, "temperature": 1.5},
    {"seed": -(2**63), "temperature": 0.5, "top_p": 0.01},
    {"logprobs": True, "top_logprobs": 20},
    {"logprobs": True, "top_logprobs": 5, "mlxcel": {"sampler": {"processors": {"top_k": {"k": 1}}}}},
    {"logit_bias": {"0": -100, "1": 100}, "frequency_penalty": -2, "presence_penalty": 2},
    {"stop": ["a", "b", "c", "d"], "stream": True},
    {"response_format": {"type": "json_object"}, "max_tokens": 4},
    {"response_format": {"type": "text"}},
    {"mlxcel": {"constraint": {"choice": ["yes", "no"]}}},
    {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "<|im_end|>"}]}
        ]
    },
    {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]},
]
VALID_COMPLETION = [
    {"prompt": [1, 2, 3]},
    {"prompt": [[1, 2], [3, 4]], "n": 2},
    {"prompt": ["a", "b"], "echo": True, "stream": True},
    {"prompt": "hello", "logprobs": 5},
    {"prompt": "hello", "best_of": 2, "n": 2, "seed": 0, "temperature": 2},
]


def base_chat() -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def base_completion() -> dict:
    return {"model": "m", "prompt": "hello", "max_tokens": 2}


def odd_message(rng: random.Random) -> dict:
    kind = rng.randrange(5)
    if kind == 0:
        return {"role": rng.choice(ROLES), "content": "hi"}
    if kind == 1:
        return {"role": "user", "content": rng.choice(ODD_VALUES)}
    if kind == 2:  # a part with a bad image URL, or an odd part
        part = rng.choice(
            [
                {"type": "image_url", "image_url": {"url": rng.choice(IMAGE_URLS)}},
                {"type": "image_url", "image_url": rng.choice(ODD_VALUES)},
                {"type": "text", "text": rng.choice(ODD_VALUES)},
                {"type": rng.choice(ODD_VALUES)},
                rng.choice(ODD_VALUES),
            ]
        )
        return {"role": "user", "content": [{"type": "text", "text": "look"}, part]}
    if kind == 3:
        return {
            "role": "user",
            "content": "hi",
            rng.choice(["name", "tool_calls", "tool_call_id", "x"]): rng.choice(ODD_VALUES),
        }
    return {"role": "user", "content": "word " * (LONG // 5)}  # a long prompt within max_body: over the context


STAGES = {  # the sampler chain's stages and their parameters (docs/sampling.md)
    "temperature": ["value", "dynatemp_range", "dynatemp_exponent"],
    "top_k": ["k"],
    "top_p": ["p"],
    "min_p": ["p"],
    "typical_p": ["p"],
    "top_n_sigma": ["n"],
    "xtc": ["probability", "threshold"],
    "penalties": ["repeat", "frequency", "presence", "last_n"],
    "dry": ["multiplier", "base", "allowed_length", "last_n", "breakers"],
    "logit_bias": ["bias", "suppress", "ignore_eos"],
}
SELECTORS = {"mirostat_v1": ["tau", "eta"], "mirostat_v2": ["tau", "eta"], "adaptive_p": ["target", "decay"]}


def odd_sampler(rng: random.Random):
    stage = rng.choice(sorted(STAGES))
    selector = rng.choice(sorted(SELECTORS))
    return rng.choice(
        [
            {"sampler": {"processors": {stage: {rng.choice(STAGES[stage]): rng.choice(ODD_VALUES)}}}},
            {"sampler": {"selector": {"kind": selector, rng.choice(SELECTORS[selector]): rng.choice(ODD_VALUES)}}},
            {"sampler": rng.choice(ODD_VALUES)},
            {
                "sampler": {
                    "processors": {rng.choice(["temperature", "top_k", "dry", "penalties"]): rng.choice(ODD_VALUES)}
                }
            },
            {"sampler": {"selector": {"kind": rng.choice(["greedy", "categorical", "mirostat_v2", "x", None])}}},
            {"sampler": {"min_keep": rng.choice(ODD_NUMBERS)}},
            {"constraint": rng.choice(ODD_VALUES)},
            {"constraint": {"regex": rng.choice(["[", "(a", "a{99999999}", "\\", ".*"])}},
            {"constraint": {"json_schema": rng.choice([True, False, {"type": "nope"}, {"$ref": "#/x"}, []])}},
            {rng.choice(ODD_STRINGS): 1},
        ]
    )


def mutate(rng: random.Random, body: dict, fields: list[str]) -> None:
    """One odd value in one field (the body's own fields or a new one)."""
    field = rng.choice(fields)
    roll = rng.random()
    if field == "messages" and roll < 0.7:
        body["messages"] = [odd_message(rng)] if roll < 0.5 else rng.choice(ODD_SHAPES + ODD_STRINGS[:3])
    elif field == "prompt" and roll < 0.7:
        body["prompt"] = rng.choice(
            [[rng.choice(ODD_NUMBERS)], [[1], rng.choice(ODD_VALUES)], ["a", rng.choice(ODD_VALUES)], "z" * LONG]
            + ODD_VALUES
        )
    elif field == "mlxcel" and roll < 0.7:
        body["mlxcel"] = odd_sampler(rng)
    elif field == "logit_bias" and roll < 0.7:
        body["logit_bias"] = {rng.choice(ODD_STRINGS + ["0", "-1", "9" * 40, "1" * 5000]): rng.choice(ODD_VALUES)}
    elif field in ("stop", "stream_options", "response_format") and roll < 0.7:
        inner = {
            "stop": [rng.choice(ODD_VALUES)] * rng.randint(1, 6),
            "stream_options": {rng.choice(["include_usage", "x"]): rng.choice(ODD_VALUES)},
            "response_format": {
                "type": rng.choice(["json_schema", "json_object", "text", "xml", None]),
                "json_schema": rng.choice(ODD_VALUES + [{"name": "x", "schema": {"type": "object"}}]),
            },
        }[field]
        body[field] = inner
        body["stream"] = field == "stream_options" or body.get("stream", False)
    else:
        body[field] = rng.choice(ODD_VALUES)


def make_cases(rng: random.Random) -> list[tuple]:
    """(method, path, body bytes or None, content type, the status it must get or None: any 4xx or
    200) for each request."""
    cases = []
    for _ in range(REQUESTS):
        roll = rng.random()
        if roll < 0.40:
            body = base_chat()
            for _ in range(rng.choice([1, 1, 2])):
                mutate(rng, body, CHAT_FIELDS)
            body.setdefault("stream", rng.random() < 0.3)  # (a stream is checked before its status line too)
            cases.append(("POST", "/v1/chat/completions", dump(body), "application/json", None))
        elif roll < 0.65:
            body = base_completion()
            for _ in range(rng.choice([1, 1, 2])):
                mutate(rng, body, COMPLETION_FIELDS)
            body.setdefault("stream", rng.random() < 0.3)
            cases.append(("POST", "/v1/completions", dump(body), "application/json", None))
        elif roll < 0.75:
            chat = rng.random() < 0.6
            body = {
                **(base_chat() if chat else base_completion()),
                **rng.choice(VALID_CHAT if chat else VALID_COMPLETION),
            }
            path = "/v1/chat/completions" if chat else "/v1/completions"
            cases.append(("POST", path, dump(body), "application/json", 200))  # (these must answer)
        elif roll < 0.85:
            path = rng.choice(["/v1/models", "/health", "/v1/models/", "/v1/", "/", "/v1/embeddings"])
            if rng.random() < 0.6:
                path = "/v1/models/" + urllib.parse.quote(rng.choice(ODD_MODEL_IDS), safe="/")
            cases.append((rng.choice(["GET", "GET", "POST", "DELETE", "PUT"]), path, None, None, None))
        else:
            cases.append(("POST", rng.choice(["/v1/chat/completions", "/v1/completions"]), *odd_body(rng), None))
    return cases


def odd_body(rng: random.Random) -> tuple[bytes, str | None]:
    """A body that is not a request: not JSON, not UTF-8, not an object, JSON's NaN literal, too deep,
    too long, not application/json."""
    good = dump(base_chat())
    return rng.choice(
        [
            (b"", "application/json"),
            (b"{", "application/json"),
            (b"\xff\xfe\x00", "application/json"),
            (b"[]", "application/json"),
            (b"null", "application/json"),
            (b'"text"', "application/json"),
            (b"1" * 5000, "application/json"),  # (past Python's int digit limit)
            (b'{"model": "m", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "application/json"),
            (b'{"model": "m", "prompt": "x", "temperature": NaN}', "application/json"),
            (b'{"model": "m", "prompt": "x", "top_p": Infinity}', "application/json"),
            (b'{"model": "m", "prompt": "x", "logit_bias": {"1": -Infinity}}', "application/json"),
            (
                b'{"model": "m", "prompt": "x", "mlxcel": {"sampler": {"processors": {"top_p": {"p": NaN}}}}}',
                "application/json",
            ),
            (b"[" * 100_000 + b"]" * 100_000, "application/json"),
            (b'{"model": "m", "prompt": "' + b"y" * (MAX_BODY_MB * 1024 * 1024) + b'"}', "application/json"),
            (good, "text/plain"),
            (good, "application/x-www-form-urlencoded"),
            (good, "multipart/form-data; boundary=x"),
            (good, "application/json; charset=utf-8"),
            (good, "Application/JSON"),
        ]
    )


def dump(body) -> bytes:
    return json.dumps(body).encode()


def send(port: int, method: str, path: str, body: bytes | None, content_type: str | None) -> tuple[int, dict, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.putrequest(method, path)
        if content_type is not None:
            connection.putheader("Content-Type", content_type)
        connection.putheader("Content-Length", str(len(body or b"")))
        connection.endheaders(body)
        reply = connection.getresponse()
        return reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read()
    finally:
        connection.close()


def check_answer(status: int, headers: dict, data: bytes, case: tuple) -> None:
    shown = f"{case[0]} {case[1]} ({case[3]}): {(case[2] or b'')[:300]!r} -> {status} {data[:400]!r}"
    assert status < 500, shown
    assert case[4] is None or status == case[4], shown
    if status == 200 and headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", shown
        assert not any('"error"' in event[:10] for event in events), shown
        return
    assert headers.get("content-type", "").startswith("application/json"), shown
    answer = json.loads(data)
    if status == 200:
        assert isinstance(answer, dict) and "error" not in answer, shown
        return
    assert 400 <= status < 500, shown
    error = answer["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), shown
    assert "\n" not in error["message"], shown  # (one line)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama):
    from PIL import Image

    folder = tmp_path_factory.mktemp("serve-fuzz")
    images = folder / "images"
    images.mkdir()
    Image.new("RGB", (4, 4), "red").save(images / "dot.png")
    (images / "not-an-image.png").write_bytes(b"plain text")
    overrides = (*MODEL, f"model.path={tiny_llama}", f"serve.image_dirs=[{images}]")
    with running_server(folder / "run", *overrides) as server:
        server.image_folder = images
        yield server


def test_a_seeded_fuzz_gets_4xx_or_200_and_never_5xx(server):
    port = int(server.url.split(":")[-1].split("/")[0])
    cases = make_cases(random.Random(SEED))
    statuses: dict[int, int] = {}
    failures: list[str] = []
    for case in cases:
        method, path, body, content_type, _ = case
        if body is not None:
            body = body.replace(b"IMAGES/", f"{server.image_folder}/".encode())
        status, headers, data = send(port, method, path, body, content_type)
        try:
            check_answer(status, headers, data, case)
        except (AssertionError, ValueError, KeyError, TypeError) as exc:  # (every failing case at once)
            failures.append(str(exc) or repr(exc))
        statuses[status] = statuses.get(status, 0) + 1
    assert not failures, f"{len(failures)} of {len(cases)} answers were wrong:\n" + "\n".join(failures[:30])
    assert statuses.get(200, 0) >= 20 and statuses.get(400, 0) >= 50, statuses  # (the fuzz reaches both sides)
    wait_for_idle(server.engine, 60)
    assert server.engine.accepted_rows == 0
    status, headers, data = send(port, "POST", "/v1/completions", dump(base_completion()), "application/json")
    assert status == 200 and json.loads(data)["choices"][0]["text"] is not None, data
    status, _, data = send(port, "GET", "/health", None, None)
    assert status == 200 and json.loads(data) == {"status": "ok"}
    rows = [json.loads(line) for line in (server.run_dir / "generations.jsonl").read_text().splitlines()]
    assert not [row for row in rows if isinstance(row["status"], int) and row["status"] >= 500], rows
    print(f"statuses: {dict(sorted(statuses.items()))}")
