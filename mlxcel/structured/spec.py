"""What a row's answer must match, from wherever it is written, as one spec: {kind: value}.

Three places write a constraint: the config (`decode.constraint`, config.ConstraintConfig), a JSONL
row (`constraint` of the same shape, or `response_format` as OpenAI writes it) and a server
request (`response_format`). Each becomes a spec with exactly one of SPEC_KINDS, which
`compile_grammar` turns into llguidance's grammar text (tokenizer-independent; matcher.py binds it
to a tokenizer; `check_grammar` checks it without one). A JSON schema's answers are also checked
against the schema as jsonschema reads it (`is_valid_json_answer`): llguidance's matcher lets a
few invalid ones through. Nothing here reads files: a config's file paths are read by config.py.
"""

from __future__ import annotations

import json

from mlxcel.errors import MlxcelError, refuse_repeated_keys

SPEC_KINDS = ("json_schema", "regex", "choice", "grammar")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
JSON_OBJECT_SCHEMA = {"type": "object"}  # OpenAI's {"type": "json_object"}: any JSON object
# JSON answers laid out as json.dumps writes them: a bounded schema bounds the answer (with free
# whitespace a small model can pad with newlines until max_tokens). A schema's own "x-guidance"
# key overrides it (llguidance's JSON options).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(MlxcelError):
    """A constraint that cannot be enforced: it does not parse or compile (one line, the cause).
    `key` names where it was written, when known; `reason` is the message without it."""

    def __init__(self, reason: str, key: str | None = None):
        super().__init__(reason if key is None else f"{key}: {reason}")
        self.reason, self.key = reason, key


def read_response_format(value: object) -> dict | None:
    """OpenAI's `response_format` as a spec; None for {"type": "text"} (no constraint)."""
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMAT_TYPES:
        got = value.get("type") if isinstance(value, dict) else value
        legal = ", ".join(RESPONSE_FORMAT_TYPES)
        raise ConstraintError(f"must be one of {legal} (got {got!r})", "response_format.type")
    kind = value["type"]
    extra = sorted(set(value) - {"type", kind})
    if extra:
        raise ConstraintError(f"unknown keys {extra} for type {kind!r}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_schema": dict(JSON_OBJECT_SCHEMA)}
    body = value.get("json_schema")
    if not isinstance(body, dict) or not is_schema(body.get("schema", {})):
        raise ConstraintError('must be an object: {"name": ..., "schema": {...}}', "response_format.json_schema")
    # (name, description and strict are OpenAI's bookkeeping: the schema is always enforced here)
    return {"json_schema": body.get("schema", {})}


def read_spec(constraint: object = None, response_format: object = None, where: str = "constraint") -> dict | None:
    """A row's or a request's spec from either shape, never both: `constraint` as decode.constraint
    writes it (named `where`), or OpenAI's `response_format`. None: neither (the job's applies)."""
    if constraint is not None and response_format is not None:
        raise ConstraintError(f"give {where} or response_format, not both", where)
    if constraint is not None:
        return check_spec(constraint, where)
    return read_response_format(response_format) if response_format is not None else None


def check_spec(value: object, where: str = "constraint") -> dict:
    """A `constraint` object ({"json_schema": {...}} or regex, choice, grammar) as a spec."""
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in SPEC_KINDS:
        raise ConstraintError(f"must have exactly one of {', '.join(SPEC_KINDS)} (got {value!r:.80})", where)
    kind, body = next(iter(value.items()))
    key = f"{where}.{kind}"
    if kind == "json_schema" and isinstance(body, str):
        body = parse_schema_text(body, key)
    expected = {"json_schema": dict, "regex": str, "grammar": str, "choice": list}[kind]
    if not isinstance(body, expected) and not (kind == "json_schema" and is_schema(body)):
        raise ConstraintError(f"must be a {expected.__name__} (got {type(body).__name__})", key)
    if kind == "choice" and (not body or not all(isinstance(c, str) and c for c in body)):
        raise ConstraintError(f"must be a non-empty list of non-empty strings (got {body!r:.80})", key)
    if kind in ("regex", "grammar") and not body.strip():
        raise ConstraintError("must not be empty", key)
    return {kind: body}


def parse_schema_text(text: str, key: str) -> dict:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConstraintError(f"is not valid JSON ({exc.msg} at column {exc.colno})", key) from None
    if not is_schema(schema):
        raise ConstraintError(f"must be a JSON object (got {type(schema).__name__})", key)
    return schema


def is_schema(value: object) -> bool:
    """A JSON schema: an object, or a boolean schema (true: any JSON value; false: none)."""
    return isinstance(value, (dict, bool))


def describe_spec(spec: dict) -> str:
    """A short label for logs and stats: "json_schema", "regex", ..."""
    return next(iter(spec))


def compile_grammar(spec: dict) -> str:
    """llguidance's grammar text for a spec. Errors in the grammar itself show when it is bound to
    a tokenizer (matcher.compile_constraint), where llguidance checks it."""
    from llguidance import LLMatcher, grammar_from

    kind, body = next(iter(spec.items()))
    try:
        if kind == "json_schema" and body is False:
            return LLMatcher.grammar_from_json_schema(False)  # (refused when checked: "schema is false")
        if kind == "json_schema":  # (the layout applies to an object: `true` is the same as {})
            return LLMatcher.grammar_from_json_schema(body if body is not True else {}, defaults=JSON_LAYOUT)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(body)
        if kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in body))
        return grammar_from("grammar", body)  # Lark (llguidance's dialect) or GBNF, converted
    except ValueError as exc:
        raise ConstraintError(first_line(str(exc)), kind) from None


def check_grammar(spec: dict) -> None:
    """ConstraintError (one line) if the spec does not compile, checked by llguidance without a
    tokenizer: cheap, before a model loads. (What only the tokenizer can tell, a grammar's special
    tokens, shows when the spec is bound to it: matcher.Constraints.compile.)"""
    from llguidance import LLMatcher

    try:
        failed, messages = LLMatcher.validate_grammar_with_warnings(compile_grammar(spec))
    except RecursionError:  # (a hostile schema hundreds of levels deep)
        raise ConstraintError("nested too deeply to compile", describe_spec(spec)) from None
    if failed:
        raise ConstraintError(first_line(messages[0]), describe_spec(spec))


def make_answer_check(schema: dict | bool):
    """`is_valid_json_answer`'s validator for a schema: jsonschema's, for the schema's draft
    (2020-12 where it names none), resolving only the JSON Schema specifications' own $refs
    (jsonschema's default would fetch remote ones)."""
    import warnings

    from jsonschema.validators import Draft202012Validator, validator_for
    from jsonschema_specifications import REGISTRY

    with warnings.catch_warnings():  # (an unknown $schema: the default draft, with a deprecation warning)
        warnings.simplefilter("ignore")
        return validator_for(schema, default=Draft202012Validator)(schema, registry=REGISTRY)


def is_valid_json_answer(validator, text: str) -> bool:
    """Whether `text` is one JSON value, with no object key given twice, that the schema's
    validator (make_answer_check) accepts (json.loads would keep a repeated key's last value:
    `{"a": 1, "\\u0061": "x"}` is not whole). A schema jsonschema cannot apply (a $ref it cannot
    resolve, a malformed keyword) accepts nothing: satisfied means checked."""
    try:
        answer = json.loads(text, object_pairs_hook=refuse_repeated_keys, parse_constant=refuse_constant)
    except (ValueError, RecursionError):  # (JSONDecodeError is a ValueError)
        return False
    try:
        return bool(validator.is_valid(answer))
    except Exception:  # noqa: BLE001 (jsonschema's errors about the schema itself: not checked, not valid)
        return False


def refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def first_line(message: str) -> str:
    """llguidance's errors run over several lines (the grammar quoted with a caret): the cause,
    and where it is when llguidance says."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return "invalid"
    head = lines[0]
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    return f"{head} ({detail})" if detail and detail not in head else head
