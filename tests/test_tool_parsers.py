"""Tool-call and reasoning parsers (issue 46) on recorded outputs of each syntax: the whole text at
once and streamed in pieces split at every character give the same content, reasoning and calls;
a malformed call is text, never a broken tool_calls entry."""

from __future__ import annotations

import json

import pytest

from mlxcel.tools.parsers import choose_tool_parser, make_output_parser, parse_output, reasoning_format

WEATHER = {"location": "Paris", "unit": "celsius"}
CASES = [
    # (syntax, reasoning, in_reasoning, output, content, reasoning text, calls)
    (
        "hermes",
        False,
        False,
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}\n'
        "</tool_call>",
        "Let me check.\n",
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",
        True,
        False,
        "<think>\nThe user wants weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "\n",
        "\nThe user wants weather.\n",
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    ("hermes", True, True, "I should greet.</think>\n\nHello!", "Hello!", "I should greet.", []),
    (
        "hermes",
        False,
        False,
        "No tools needed: 2 < 3 and <tool is not a mark.",
        "No tools needed: 2 < 3 and <tool is not a mark.",
        None,
        [],
    ),
    (
        "mistral",
        False,
        False,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}]',
        "",
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "mistral",
        False,
        False,
        '[TOOL_CALLS]get_weather[ARGS]{"location": "Paris", "unit": "celsius"}[TOOL_CALLS]get_time[ARGS]{}',
        "",
        None,
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    (
        "llama3_json",
        False,
        False,
        '{"name": "get_weather", "parameters": {"location": "Paris", "unit": "celsius"}}',
        "",
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "llama3_json",
        False,
        False,
        '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Paris", "unit": "celsius"}}',
        "",
        None,
        [("get_weather", WEATHER)],
    ),
    ("llama3_json", False, False, "The weather in Paris is mild.", "The weather in Paris is mild.", None, []),
    (
        None,
        True,
        False,
        "<think>Short.</think>\nHello, <think> stays text.",
        "Hello, <think> stays text.",
        "Short.",
        [],
    ),
    (None, False, False, "<think>Not read.</think>", "<think>Not read.</think>", None, []),
    # gpt-oss's harmony messages (its prompt ends in `<|start|>assistant`; <|call|> and <|return|>
    # are stop tokens, so the text ends where they would be)
    (
        "harmony",
        "harmony",
        False,
        "<|channel|>analysis<|message|>The user wants the weather in Paris.<|end|><|start|>assistant"
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"Paris","unit":'
        '"celsius"}',
        "",
        "The user wants the weather in Paris.",
        [("get_weather", WEATHER)],
    ),
    (  # the recipient in the role part, as the chat template renders earlier calls
        "harmony",
        "harmony",
        False,
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Paris", "unit": "celsius"}'
        "<|call|>",
        "",
        None,
        [("get_weather", WEATHER)],
    ),
    (
        "harmony",
        "harmony",
        False,
        "<|channel|>analysis<|message|>Just greet.<|end|><|start|>assistant<|channel|>final<|message|>Hello! "
        "2 < 3 and <|end is text.",
        "Hello! 2 < 3 and <|end is text.",
        "Just greet.",
        [],
    ),
    (  # a preamble before the call (commentary without a recipient) is content
        "harmony",
        "harmony",
        False,
        "<|channel|>commentary<|message|>Checking the weather.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_time <|constrain|>json<|message|>{}<|call|>",
        "Checking the weather.",
        None,
        [("get_time", {})],
    ),
    (  # tool_choice none: harmony's channels still read, a call stays text
        None,
        "harmony",
        False,
        "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>commentary to=functions.f"
        '<|message|>{"a": 1}',
        '<|start|>assistant<|channel|>commentary to=functions.f<|message|>{"a": 1}',
        "Hmm.",
        [],
    ),
    ("harmony", "harmony", False, "Plain text, no channels.", "Plain text, no channels.", None, []),
]
MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"location": }\n</tool_call>'),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}'),  # cut off by max_tokens
    ("mistral", "[TOOL_CALLS]not json"),
    ("llama3_json", '{"name": "f", "parameters": [1, 2]}'),
]
HARMONY_MALFORMED = [  # (the answer, the content it leaves)
    (
        '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": ',
        '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": ',
    ),
    ("<|channel|>commentary to=browser.search<|message|>{}", "<|channel|>commentary to=browser.search<|message|>{}"),
    ("<|channel|>final<|message|>Cut here<|en", "Cut here<|en"),
]


def describe(parsed):
    calls = [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]
    return parsed.content, parsed.reasoning, calls


def stream(text, syntax, reasoning, in_reasoning, cuts):
    parser = make_output_parser(syntax, reasoning, in_reasoning)
    deltas, start = [], 0
    for cut in [*cuts, len(text)]:
        deltas += parser.feed(text[start:cut])
        start = cut
    deltas += parser.finish()
    return parser.result(), deltas


@pytest.mark.parametrize("syntax, reasoning, in_reasoning, text, content, thinking, calls", CASES)
def test_recorded_outputs_parse_whole_and_streamed_at_every_split(
    syntax, reasoning, in_reasoning, text, content, thinking, calls
):
    assert describe(parse_output(text, syntax, reasoning, in_reasoning)) == (content, thinking, calls)
    for cut in range(len(text) + 1):  # two pieces, split at every character
        parsed, deltas = stream(text, syntax, reasoning, in_reasoning, [cut])
        assert describe(parsed) == (content, thinking, calls), cut
        assert "".join(d.text for d in deltas if d.kind == "content") == content
        assert [d.call.name for d in deltas if d.kind == "tool_call"] == [name for name, _ in calls]
    parsed, _ = stream(text, syntax, reasoning, in_reasoning, list(range(1, len(text))))  # a character a piece
    assert describe(parsed) == (content, thinking, calls)


@pytest.mark.parametrize("syntax, text", MALFORMED)
def test_a_malformed_call_is_text(syntax, text):
    parsed = parse_output(text, syntax)
    assert parsed.tool_calls == [] and parsed.content == text
    for cut in range(len(text) + 1):
        assert stream(text, syntax, False, False, [cut])[0].content == text


@pytest.mark.parametrize("text, content", HARMONY_MALFORMED)
def test_a_harmony_call_that_cannot_be_read_is_text(text, content):
    for cut in range(len(text) + 1):
        parsed = stream(text, "harmony", "harmony", False, [cut])[0]
        assert parsed.tool_calls == [] and parsed.content == content, cut


def test_the_parser_follows_the_template():
    assert choose_tool_parser("auto", "{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert choose_tool_parser("auto", "[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert choose_tool_parser("auto", "<|start_header_id|>ipython<|end_header_id|>") == "llama3_json"
    assert choose_tool_parser("auto", "{{ messages }}") is None
    harmony = "<|start|>assistant to=functions.{{ name }}<|channel|>commentary json<|message|>"
    assert choose_tool_parser("auto", harmony) == "harmony" and reasoning_format(harmony) == "harmony"
    assert reasoning_format("<think>{{ x }}</think>") == "think" and reasoning_format("{{ x }}") is None
    assert (
        choose_tool_parser("mistral", "<tool_call>") == "mistral" and choose_tool_parser("none", "<tool_call>") is None
    )


def test_call_ids_are_unique_and_openai_shaped():
    parsed = parse_output(CASES[1][3], "hermes", True)
    first, second = (c.to_openai(i) for i, c in enumerate(parsed.tool_calls))
    assert first["id"] != second["id"] and first["id"].startswith("call_")
    assert first == {
        "index": 0,
        "id": first["id"],
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(WEATHER)},
    }


@pytest.mark.parametrize(
    "template, syntax, thinks",
    [
        ("qwen2.5.jinja", "hermes", None),
        ("smollm3.jinja", "hermes", "think"),
        ("mistral_v3.jinja", "mistral", None),
        ("llama3.2.jinja", "llama3_json", None),
        ("gemma2.jinja", None, None),
    ],
)
def test_the_published_templates_pick_their_families_syntax(template, syntax, thinks):
    from pathlib import Path

    source = (Path(__file__).resolve().parent / "data" / "templates" / template).read_text()
    assert choose_tool_parser("auto", source) == syntax and reasoning_format(source) == thinks


TRICKY = {"location": 'Pa}ris {"x"]', "unit": "celsius"}  # (brackets and quotes inside a string)
FORCED = [  # (syntax, reasoning, a forced answer, its calls)
    (
        "hermes",
        False,
        '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(TRICKY) + "}\n</tool_call>\n"
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        [("get_weather", TRICKY), ("get_time", {})],
    ),
    (
        "llama3_json",
        False,
        '{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}",
        [("get_weather", WEATHER)],
    ),
    (
        "mistral",
        False,
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + json.dumps(TRICKY) + ', "id": "abcdefghi"}, '
        '{"name": "get_time", "arguments": {}}]',
        [("get_weather", TRICKY), ("get_time", {})],
    ),
    (
        "mistral",
        False,
        "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(WEATHER) + "[TOOL_CALLS]get_time[ARGS]{}",
        [("get_weather", WEATHER), ("get_time", {})],
    ),
    (
        "harmony",
        "harmony",
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + json.dumps(TRICKY),
        [("get_weather", TRICKY)],
    ),
]


def read_forced(deltas):
    """The calls as an OpenAI client accumulates a stream: a start (name, id), argument pieces."""
    calls, ended = [], []
    for delta in deltas:
        assert delta.kind != "tool_call"  # (a forced call is never sent whole)
        if delta.kind == "call_start":
            calls.append([delta.call.id, delta.call.name, ""])
        elif delta.kind == "call_arguments":
            calls[-1][2] += delta.text
        elif delta.kind == "call_end":
            ended.append(delta.call)
    assert [c.id for c in ended] == [c[0] for c in calls]  # (the ids the client was given)
    return [(name, json.loads(arguments)) for _, name, arguments in calls]


@pytest.mark.parametrize("syntax, reasoning, text, calls", FORCED)
def test_a_forced_calls_arguments_stream_as_they_are_written(syntax, reasoning, text, calls):
    def run(cuts):
        parser = make_output_parser(syntax, reasoning, False, forced=True)
        deltas, start = [], 0
        for cut in [*cuts, len(text)]:
            deltas += parser.feed(text[start:cut])
            start = cut
        return parser, deltas + parser.finish()

    for cuts in [[cut] for cut in range(len(text) + 1)] + [list(range(1, len(text)))]:
        parser, deltas = run(cuts)
        assert read_forced(deltas) == calls, cuts
        assert describe(parser.result())[1:] == (None, calls)
    _, deltas = run(list(range(1, len(text))))  # a character a piece: the arguments arrive in pieces
    assert sum(d.kind == "call_arguments" for d in deltas) > len(calls)
