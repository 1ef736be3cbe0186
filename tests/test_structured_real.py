"""Structured output on the embedded SmolLM2 (a real model and tokenizer): the shipped recipe's 50
extraction prompts give 50 answers that parse and validate against its nested schema (checked
with `jsonschema`), and the server enforces response_format."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.helpers import REPO, read_run, requires_smollm2, run_cli

pytestmark = [pytest.mark.slow, requires_smollm2]  # loads the real embedded model

SCHEMA = json.loads((REPO / "recipes" / "data" / "person.schema.json").read_text())


def test_the_extraction_recipe_validates_against_the_schema(tmp_path):
    """The structured_extraction recipe on its first 12 rows: all 50 take ~20 minutes on the
    reference BLAS a Linux machine without OpenBLAS runs (the test's time, not its point)."""
    rows_file = tmp_path / "people.jsonl"
    lines = (REPO / "recipes" / "data" / "people.jsonl").read_text().splitlines(keepends=True)
    rows_file.write_text("".join(lines[:12]))
    result = run_cli(tmp_path, "recipe=structured_extraction", f"prompt.file={rows_file}")
    assert result.returncode == 0, result.stderr
    stats, rows, config = read_run(tmp_path)
    assert len(rows) == 12 and config["decode"]["constraint"]["json_schema"].endswith("person.schema.json")
    for row in rows:
        assert row["finish_reason"] == "stop" and row["constraint_satisfied"] is True, row
        jsonschema.validate(json.loads(row["text"]), SCHEMA)
    assert stats["constraints"] == {
        "rows": 12,
        "satisfied": 12,
        "kinds": {"json_schema": 12},
        "mask_ms": stats["constraints"]["mask_ms"],
    }
    # the documents' facts come through (the model reads them; the mask only shapes the answer)
    ages = [json.loads(row["text"])["age"] for row in rows]
    assert len(set(ages)) > 6


CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "country": {"enum": ["France", "Italy", "Spain"]}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.serve_fixtures import running_server

    with running_server(tmp_path_factory.mktemp("serve") / "run", "decode.max_tokens=40") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)


def city_format(schema: dict = CITY) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}


def ask(client, content: str, **extra):
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": content}], **extra)


def test_the_server_enforces_response_format_streamed_or_not(client):
    answer = ask(client, "Where is the Eiffel Tower?", response_format=city_format())
    text = answer.choices[0].message.content
    jsonschema.validate(json.loads(text), CITY)
    assert answer.choices[0].finish_reason == "stop"
    stream = ask(client, "Where is the Eiffel Tower?", response_format=city_format(), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    obj = ask(client, "Describe a cat as JSON.", response_format={"type": "json_object"}, max_tokens=60)
    assert obj.choices[0].message.content.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    done = client.completions.create(
        model="smollm2",
        prompt="The year was",
        max_tokens=8,
        extra_body={"mlxcel": {"constraint": {"regex": r" \d{4}"}}},
    )
    assert done.choices[0].text[1:].isdigit() and len(done.choices[0].text) == 5


def test_constrained_and_free_requests_share_the_batch(client):
    from concurrent.futures import ThreadPoolExecutor

    questions = ["Name a fruit.", "Where is the Colosseum?", "Count to three.", "Where is the Prado?"]
    alone = [ask(client, q).choices[0].message.content for q in questions[::2]]
    with ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(ask, client, q, **({"response_format": city_format()} if i % 2 else {}))
            for i, q in enumerate(questions)
        ]
        answers = [f.result().choices[0].message.content for f in futures]
    assert answers[::2] == alone  # the free rows are untouched by their constrained neighbours
    for text in answers[1::2]:
        jsonschema.validate(json.loads(text), CITY)


def test_the_server_refuses_what_it_cannot_enforce(server, client):
    from tests.serve_fixtures import request_json

    messages = [{"role": "user", "content": "hi"}]
    bad = {"model": "smollm2", "messages": messages, "response_format": city_format({"type": "wat"})}
    status, reply, _ = request_json(f"{server.url}/chat/completions", bad)
    assert status == 400 and reply["error"]["param"] == "response_format", reply
    assert "Invalid type: wat" in reply["error"]["message"] and "\n" not in reply["error"]["message"]
    both = {**bad, "response_format": {"type": "json_object"}, "mlxcel": {"constraint": {"regex": "a"}}}
    assert request_json(f"{server.url}/chat/completions", both)[0] == 400
    short = ask(client, "Where is Rome?", response_format=city_format(), max_tokens=3)
    assert short.choices[0].finish_reason == "length"
    deep = '{"type": "object", "properties": {"a": ' * 3000 + "{}" + "}}" * 3000
    body = '{"model": "smollm2", "messages": [], "response_format": ' + deep + "}"
    status, reply, _ = request_json(f"{server.url}/chat/completions", raw=body.encode())
    assert status == 400 and "nested too deeply" in reply["error"]["message"]


def test_a_slow_compile_holds_up_no_answer_in_flight(server, client, monkeypatch):
    """A request's constraint compiles on a worker thread, not the engine's: while a compile is
    under way, a streaming answer's tokens keep coming. The compile waits until it has seen
    tokens arrive (an order, not a time: on the engine thread none could, and its wait would
    give up unseen)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    compiling, streamed = threading.Event(), threading.Event()

    def stream_beside_a_constrained_request(max_tokens: int) -> object:
        constrained, during = None, 0
        with ThreadPoolExecutor(1) as pool:
            for _ in ask(client, "Count from one to fifty in words.", max_tokens=max_tokens, stream=True):
                if constrained is None:  # (once the free answer streams)
                    constrained = pool.submit(ask, client, "Where is the Prado?", response_format=city_format())
                elif compiling.is_set():
                    during += 1
                    if during == 3:
                        streamed.set()
            return constrained.result()

    stream_beside_a_constrained_request(40)  # a first round: a cold server's first answer is slow
    constraints = server.engine.pipeline.constraints
    compile_spec, threads, saw_tokens = constraints.compile, [], []

    def slow_compile(spec):
        threads.append(threading.current_thread().name)
        compiling.set()
        saw_tokens.append(streamed.wait(timeout=120))
        return compile_spec(spec)

    monkeypatch.setattr(constraints, "compile", slow_compile)
    answer = stream_beside_a_constrained_request(200)
    jsonschema.validate(json.loads(answer.choices[0].message.content), CITY)
    assert threads and "mlxcel-engine" not in threads
    assert saw_tokens == [True]  # tokens streamed while the compile was under way
