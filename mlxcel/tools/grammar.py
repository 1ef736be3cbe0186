"""tool_choice "required" or a named function: the answer constrained (structured output) to a call
in the model's syntax whose arguments match the tool's JSON schema, so they always parse and
validate (docs/tools.md)."""

from __future__ import annotations

import json

from mlxcel.openai_protocol import ApiError

CONSTRAINED_SYNTAXES = ("hermes", "llama3_json")


def call_schema(tool: dict, arguments_key: str) -> dict:
    function = tool["function"]
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments_key: function.get("parameters") or {}},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def make_call_grammar(syntax: str | None, tools: list[dict], choice, parallel: bool) -> dict:
    """The structured-output spec ({"grammar": Lark}) for a forced call: the named function's (one
    call), or one of `tools`, several in a row where parallel calls are allowed (hermes)."""
    if syntax not in CONSTRAINED_SYNTAXES:
        raise ApiError(
            400,
            f"tool_choice {json.dumps(choice if isinstance(choice, str) else {'function': choice})} needs a "
            f"constrained call, which this model's tool syntax ({syntax or 'none found in its template'}) does not "
            f"have yet (constrained: {', '.join(CONSTRAINED_SYNTAXES)}; template.tool_parser names the syntax)",
            "tool_choice",
        )
    chosen = [t for t in tools if not isinstance(choice, dict) or t["function"]["name"] == choice["name"]]
    key = "arguments" if syntax == "hermes" else "parameters"
    schemas = [call_schema(t, key) for t in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    # compact JSON as the families write their calls (free whitespace lets a model pad forever)
    schema = {**schema, "x-guidance": {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}}
    lines = [f"call: %json {json.dumps(schema)}"]
    if syntax == "hermes":
        block = '"<tool_call>\\n" call "\\n</tool_call>"'
        several = parallel and not isinstance(choice, dict)
        start = f'start: {block} ("\\n" {block})*' if several else f"start: {block}"
    else:
        start = "start: call"
    return {"grammar": "\n".join([start, *lines])}
