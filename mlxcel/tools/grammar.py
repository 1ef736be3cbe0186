"""tool_choice "required" or a named function: the answer constrained (structured output) to a call
in the model's syntax whose arguments match the tool's JSON schema, so they always parse and
validate (docs/tools.md). Marks that are special tokens (harmony's, Mistral's [TOOL_CALLS]) are
matched as those tokens, `<[id]>` in llguidance's Lark, never as their text spelled in pieces."""

from __future__ import annotations

import json

from mlxcel.openai_protocol import ApiError

CONSTRAINED_SYNTAXES = ("hermes", "llama3_json", "mistral", "harmony")
# compact JSON as the families write their calls (free whitespace lets a model pad forever)
COMPACT_JSON = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def call_schema(tool: dict, arguments_key: str, extra: dict | None = None) -> dict:
    function = tool["function"]
    properties = {"name": {"const": function["name"]}, arguments_key: function.get("parameters") or {}}
    return {
        "type": "object",
        "properties": {**properties, **(extra or {})},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def make_call_grammar(
    syntax: str | None, tools: list[dict], choice, parallel: bool, special_tokens: dict[str, int] | None = None
) -> dict:
    """The structured-output spec ({"grammar": Lark}) for a forced call: the named function's (one
    call), or one of `tools`, several in a row where parallel calls are allowed (hermes, mistral).
    `special_tokens`: the tokenizer's (text -> id), for the marks that are tokens of their own."""
    if syntax not in CONSTRAINED_SYNTAXES:
        raise ApiError(
            400,
            f"tool_choice {json.dumps(choice if isinstance(choice, str) else {'function': choice})} needs a "
            f"constrained call, which this model's tool syntax ({syntax or 'none found in its template'}) does not "
            f"have yet (constrained: {', '.join(CONSTRAINED_SYNTAXES)}; template.tool_parser names the syntax)",
            "tool_choice",
        )
    chosen = [t for t in tools if not isinstance(choice, dict) or t["function"]["name"] == choice["name"]]
    several = parallel and not isinstance(choice, dict)
    marks = MarkSpeller(special_tokens or {})
    if syntax == "harmony":
        return make_harmony_grammar(chosen, marks)
    if syntax == "mistral":
        return make_mistral_grammar(chosen, several, marks)
    key = "arguments" if syntax == "hermes" else "parameters"
    lines = [f"call: %json {json_of([call_schema(t, key) for t in chosen])}"]
    if syntax == "hermes":
        block = '"<tool_call>\\n" call "\\n</tool_call>"'
        start = f'start: {block} ("\\n" {block})*' if several else f"start: {block}"
    else:
        start = "start: call"
    return {"grammar": "\n".join([start, *lines])}


def json_of(schemas: list[dict]) -> str:
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return json.dumps({**schema, "x-guidance": COMPACT_JSON})


class MarkSpeller:
    """A mark in Lark: the special token's `<[id]>` where the tokenizer has it as one, else its text."""

    def __init__(self, special_tokens: dict[str, int]):
        self.special_tokens = special_tokens

    def has(self, mark: str) -> bool:
        return mark in self.special_tokens

    def __call__(self, mark: str) -> str:
        token = self.special_tokens.get(mark)
        return f"<[{token}]>" if token is not None else json.dumps(mark)


def make_mistral_grammar(tools: list[dict], several: bool, mark: MarkSpeller) -> dict:
    """v3 tokenizers: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (an optional 9-character
    id, as its template writes earlier calls); v11 and later (an [ARGS] token): `[TOOL_CALLS]name[ARGS]{...}`
    a call."""
    if mark.has("[ARGS]"):
        lines = []
        for i, tool in enumerate(tools):
            function = tool["function"]
            lines.append(f"call{i}: {json.dumps(function['name'])} {mark('[ARGS]')} args{i}")
            lines.append(f"args{i}: %json {json_of([function.get('parameters') or {}])}")
        call = f"{mark('[TOOL_CALLS]')} ({' | '.join(f'call{i}' for i in range(len(tools)))})"
        return {"grammar": "\n".join([f"start: call{'+' if several else ''}", f"call: {call}", *lines])}
    call_id = {"id": {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}}
    lines = [f"call: %json {json_of([call_schema(t, 'arguments', call_id) for t in tools])}"]
    calls = 'call (", " call)*' if several else "call"
    return {"grammar": "\n".join([f'start: {mark("[TOOL_CALLS]")} " [" {calls} "]"', *lines])}


def make_harmony_grammar(tools: list[dict], mark: MarkSpeller) -> dict:
    """gpt-oss's call: a commentary message to `functions.NAME`, its body the arguments, then <|call|>
    (a stop token) ends the answer. One call an answer: a harmony call ends the turn, so parallel
    calls do not apply. The call comes at once, without an analysis message before it."""
    lines, names = [], []
    for i, tool in enumerate(tools):
        function = tool["function"]
        header = json.dumps(f"commentary to=functions.{function['name']} ")
        lines.append(f'call{i}: {header} {mark("<|constrain|>")} "json" {mark("<|message|>")} args{i}')
        lines.append(f"args{i}: %json {json_of([function.get('parameters') or {}])}")
        names.append(f"call{i}")
    return {"grammar": "\n".join([f"start: {mark('<|channel|>')} ({' | '.join(names)})", *lines])}
