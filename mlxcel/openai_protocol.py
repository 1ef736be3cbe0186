"""OpenAI's request and response shapes for /v1/chat/completions and /v1/completions: the
mapping mlxcel-serve, batch files (mlxcel.batch_files) and JSONL rows share, so it belongs to
neither side.

Requests are checked here, before anything reaches the engine: a field we do not know or do not
support is a 400 that names it (never silently ignored); the fields that change nothing for a
local server are accepted (IGNORED_FIELDS, docs/serve.md). `make_sampler_config` maps the request's
sampling fields onto our sampler chain, over the server's configured chain.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from mlxcel.errors import MlxcelError
from mlxcel.sampling.config import SamplerConfig

MAX_CHOICES = 16  # n: rows of one request (each holds a KV reservation)
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API
MAX_COMPLETION_LOGPROBS = 5  # as OpenAI's completions API
MAX_STOP_STRINGS = 4  # as OpenAI
SEED_RANGE = (-(2**63), 2**63 - 1)  # a 64-bit signed integer, as OpenAI's and vLLM's
NO_LOGPROB = -9999.0  # a token the chain left no chance: OpenAI's figure (JSON has no -Infinity)
# Accepted and ignored: they change nothing a local server does (docs/serve.md lists them).
IGNORED_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
    }
)


class ApiError(Exception):
    """An OpenAI-style error answer: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        # (an exception's text can carry a lone surrogate from the request: the answer must encode)
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        message = message.replace("\r", "\\r").replace("\n", "\\n")  # (one line, whatever a key holds)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


Float = Annotated[float, Field(allow_inf_nan=False)]


class SamplingFields(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    temperature: Annotated[Float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Float, Field(ge=0, le=1)] | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    stop: str | list[str] | None = None
    seed: Annotated[StrictInt, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] = 1
    frequency_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = None
    logit_bias: dict[str, Annotated[Float, Field(ge=-100, le=100)]] | None = None
    mlxcel: dict[str, Any] | None = None  # our own settings: {"sampler": {...}} (docs/serve.md)

    def stop_strings(self) -> list[str] | None:
        if self.stop is None:
            return None
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise ApiError(400, f"stop takes up to {MAX_STOP_STRINGS} non-empty strings", "stop")
        return stops

    def include_usage(self) -> bool:
        options = self.stream_options or {}
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options")
        unknown = sorted(set(options) - {"include_usage", "include_obfuscation"})
        if unknown:
            raise ApiError(400, f"unknown field stream_options.{unknown[0]}", f"stream_options.{unknown[0]}")
        return bool(options.get("include_usage", False))


class ChatRequest(SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[Literal["text"]] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True

    def tool_settings(self) -> tuple[list[dict] | None, str | dict]:
        return read_tool_settings(self.tools, self.tool_choice)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_wanted(self) -> int:
        """Alternatives the draw must keep (>= 1 whenever logprobs are asked for)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        return max(1, self.top_logprobs or 0) if self.logprobs else 0


def read_tool_settings(tools: Any, choice: Any) -> tuple[list[dict] | None, str | dict]:
    """(the tools, the choice: "none", "auto", "required" or {"name": the named function}), checked
    (a chat request's, a job row's); tools are rendered by the model's template, calls parsed from
    the answer (mlxcel/tools)."""
    if tools is None:
        if choice is not None and choice != "none":
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return None, "none"
    if not isinstance(tools, list) or not tools:
        raise ApiError(400, "tools must list at least one function (or be left out)", "tools")
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ApiError(400, f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', f"tools.{i}")
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise ApiError(400, f"tools[{i}].function.name must be a name of 1-64 characters", f"tools.{i}")
        if not isinstance(function.get("parameters", {}), dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object", f"tools.{i}")
        names.append(name)
    if len(set(names)) < len(names):
        raise ApiError(400, "tools: two functions share a name", "tools")
    if choice is None:
        return tools, "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ApiError(400, "tool_choice must be none, auto, required or a named function", "tool_choice")
        return tools, choice
    name = (
        (choice.get("function") or {}).get("name")
        if isinstance(choice, dict) and choice.get("type") == "function"
        else None
    )
    if name not in names:
        raise ApiError(400, f"tool_choice names no tool of this request ({', '.join(names)})", "tool_choice")
    return tools, {"name": name}


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: StrictBool = False
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] | None = None
    suffix: str | None = None

    def token_limit(self) -> int | None:
        return self.max_tokens

    def logprobs_wanted(self) -> int:
        return max(1, self.logprobs) if self.logprobs is not None else 0

    def prompts(self) -> list[str | list[int]]:
        """The prompts (a list of strings or of token-id lists is a batch: one choice set each)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ApiError(400, "prompt must not be empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)


def parse_request(kind: type[SamplingFields], data: Any) -> SamplingFields:
    """The request body checked: unknown or unsupported fields and bad values are 400s naming them."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_unicode(data)
    data = {key: value for key, value in data.items() if key not in IGNORED_FIELDS}
    known = set(kind.model_fields)
    for key in data:
        if key not in known:
            raise ApiError(400, f"unknown or unsupported field '{key}' (docs/serve.md lists the fields)", key)
    try:
        request = kind.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        value = first.get("input")
        shown = "" if isinstance(value, (dict, list)) else f" (got {value!r})"
        raise ApiError(400, f"{param}: {first['msg']}{shown}", param) from None
    check_unsupported(request)
    return request


def check_unicode(body: dict) -> None:
    """Every string (and key) of the body is text UTF-8 can hold: JSON's \\ud800 escape parses to
    a lone UTF-16 surrogate, which the tokenizer and every answer that quotes it cannot encode.
    Iterative: a body nested as deep as the JSON parser allows does not exhaust the stack."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, str):
            if not is_encodable(node):
                raise ApiError(400, f"{path}: not valid Unicode text ({describe_surrogate(node)})", path)
            continue
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(key, str) and not is_encodable(key):
                raise ApiError(400, f"{path or 'the body'}: a key is not valid Unicode ({describe_surrogate(key)})")
            if isinstance(value, (str, dict, list)):  # (a long list of token ids costs no paths)
                stack.append((f"{path}.{key}" if path else str(key), value))


def is_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def describe_surrogate(text: str) -> str:
    index = next(i for i, char in enumerate(text) if 0xD800 <= ord(char) <= 0xDFFF)
    return f"a lone UTF-16 surrogate \\u{ord(text[index]):04x} at character {index}"


def read_constraint(request: SamplingFields) -> dict | None:
    """The request's structured output spec (mlxcel.structured.spec): a chat's response_format, or
    `mlxcel.constraint` (either endpoint; the shape of decode.constraint). None: the server's."""
    from mlxcel.structured.spec import ConstraintError, read_spec

    own = (request.mlxcel or {}).get("constraint")
    try:
        return read_spec(own, getattr(request, "response_format", None), "mlxcel.constraint")
    except ConstraintError as exc:
        raise ApiError(400, str(exc), exc.key) from None


def check_unsupported(request: SamplingFields) -> None:
    if isinstance(request, CompletionRequest):
        if request.suffix:
            raise ApiError(400, "suffix (fill-in-the-middle) is not supported", "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise ApiError(400, "best_of must equal n: every sample is returned, none is ranked", "best_of")
        if request.echo and request.logprobs is not None:
            raise ApiError(400, "echo with logprobs is not supported (prompt tokens have no logprobs here)", "echo")
    mlxcel = request.mlxcel or {}
    unknown = sorted(set(mlxcel) - {"sampler", "constraint"})
    if unknown:
        raise ApiError(
            400, f"unknown field mlxcel.{unknown[0]} (known: mlxcel.sampler, mlxcel.constraint)", f"mlxcel.{unknown[0]}"
        )
    request.stop_strings()
    request.include_usage()
    request.logprobs_wanted()
    read_constraint(request)


def make_sampler_config(base: SamplerConfig, request: SamplingFields, vocab_size: int) -> SamplerConfig | None:
    """The request's sampler: the server's chain, then `mlxcel.sampler` merged over it, then the
    OpenAI fields (temperature > 0 makes a greedy chain a categorical draw). None: the server's
    own chain unchanged."""
    overrides = (request.mlxcel or {}).get("sampler")
    fields = (request.temperature, request.top_p, request.frequency_penalty, request.presence_penalty)
    if overrides is None and all(f is None for f in fields) and not request.logit_bias:
        return None
    data = base.model_dump()
    if overrides is not None:
        if not isinstance(overrides, dict):
            raise ApiError(400, "mlxcel.sampler must be an object (the sampler group's keys)", "mlxcel.sampler")
        data = merge_dicts(data, overrides)
    processors = data.setdefault("processors", {})
    if request.temperature is not None:
        processors["temperature"] = {**processors.get("temperature", {}), "value": request.temperature}
        if request.temperature > 0 and data.get("selector", {}).get("kind") == "greedy":
            data["selector"] = {"kind": "categorical"}
    if request.top_p is not None:
        processors["top_p"] = {**processors.get("top_p", {}), "p": request.top_p}
    if request.frequency_penalty is not None or request.presence_penalty is not None:
        penalties = processors.get("penalties", {})
        for name, value in (("frequency", request.frequency_penalty), ("presence", request.presence_penalty)):
            if value is not None:
                penalties[name] = value
        processors["penalties"] = penalties
    if request.logit_bias:
        bias = {}
        for key, value in request.logit_bias.items():
            # (ASCII digits only: "²".isdigit() and int() cannot read it; 5000 digits are past int()'s limit)
            if not (key.isascii() and key.isdigit() and len(key) <= 12) or int(key) >= vocab_size:
                raise ApiError(400, f"logit_bias keys are token ids in [0, {vocab_size}); got {key!r}", "logit_bias")
            bias[int(key)] = value
        processors["logit_bias"] = {**processors.get("logit_bias", {}), "bias": bias}
    try:
        return SamplerConfig.model_validate(data)
    except MlxcelError as err:  # (a check that raises ConfigError itself, not through pydantic)
        issues = getattr(err, "issues", None)
        detail = "; ".join(issue.format() for issue in issues) if issues else str(err)
        raise ApiError(400, f"the request's sampler settings: {detail}", "mlxcel.sampler") from None
    except ValidationError as err:
        first = err.errors()[0]
        detail = first.get("ctx", {}).get("mlxcel") or first.get("ctx", {}).get("nested") or first["msg"]
        where = ".".join(str(part) for part in first["loc"])  # (a top-level key's own error does not name it)
        raise ApiError(
            400, f"the request's sampler settings: {describe_validation(detail, where)}", "mlxcel.sampler"
        ) from None


def describe_validation(detail: Any, where: str = "") -> str:
    """One line out of the sampler schema's nested error shapes; `where`: the error's location."""
    if isinstance(detail, tuple) and len(detail) == 3 and isinstance(detail[1], str):
        field, message, value = detail
        field = field or where
        return f"{field + ': ' if field else ''}{message} (got {value!r})"
    if isinstance(detail, list) and detail:
        model, prefix, errors = detail[0]
        if errors:
            error = errors[0]
            where = ".".join(str(p) for p in (*prefix, *error["loc"]))
            inner = error.get("ctx", {}).get("mlxcel")
            message = inner[1] if inner else error["msg"]
            return f"{where}: {message} (got {error.get('input')!r})"
    return f"{where}: {detail}" if where and isinstance(detail, str) else str(detail)


def merge_dicts(base: dict, overrides: dict) -> dict:
    merged = dict(base)
    for key, value in overrides.items():
        merged[key] = (
            merge_dicts(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


# ---- responses ----
def describe_token(tokenizer, token: int) -> str:
    """A token as logprobs list it: its text, or where that is part of a character (the
    replacement character), the tokenizer's own piece (unique per id: the legacy completions
    format keys alternatives by text)."""
    text = tokenizer.decode([token])
    if "\ufffd" in text:
        return tokenizer.id_to_token(token) or f"<token {token}>"
    return text


def make_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def count_usage(done: dict[int, dict], n: int) -> dict:
    """A request's usage from its finished choices (index -> figures): a prompt counts once (its
    choices are n in a row), every choice's tokens count."""
    firsts = [d for i, d in done.items() if i % n == 0]
    return make_usage(
        sum(d["prompt_tokens"] for d in firsts),
        sum(d["completion_tokens"] for d in done.values()),
        sum(d["cached_tokens"] for d in firsts),
    )


def describe_logprobs(tokenizer, entry: dict, top: int) -> dict:
    """A token's logprob entry ({token, logprob, top: [[id, logprob], ...]}, as the engine gives
    it) with the tokens as text: what make_*_logprobs take."""
    return {
        "text": describe_token(tokenizer, entry["token"]),
        "logprob": finite_logprob(entry["logprob"]),
        "top": [(describe_token(tokenizer, t), finite_logprob(lp)) for t, lp in entry["top"][:top]],
    }


def finite_logprob(value: float) -> float:
    """A logprob JSON can carry: a token masked out (top_k, a grammar) has -inf, which a whole
    answer cannot encode at all and a stream would write as the invalid `-Infinity`."""
    return value if math.isfinite(value) else NO_LOGPROB


def make_choice(endpoint: str, index: int, text: str, finish_reason: str, entries: list[dict] | None, top: int) -> dict:
    """One choice of a whole (not streamed) answer; `entries`: describe_logprobs' (None: not asked)."""
    if endpoint == "chat":
        return {
            "index": index,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": make_chat_logprobs(entries, top) if entries is not None else None,
            "finish_reason": finish_reason,
        }
    return {
        "index": index,
        "text": text,
        "logprobs": make_completion_logprobs(entries, top, 0) if entries is not None else None,
        "finish_reason": finish_reason,
    }


def make_answer(
    endpoint: str, answer_id: str, model: str, choices: list[dict], usage: dict, fingerprint: str | None
) -> dict:
    """A whole answer's body: chat.completion or text_completion."""
    return {
        "id": answer_id,
        "object": "chat.completion" if endpoint == "chat" else "text_completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": fingerprint,
    }


def make_chat_logprobs(entries: list[dict], top: int) -> dict:
    """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    return {
        "content": [
            {
                "token": e["text"],
                "logprob": e["logprob"],
                "bytes": list(e["text"].encode("utf-8")),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in e["top"][:top]
                ],
            }
            for e in entries
        ]
    }


def make_completion_logprobs(entries: list[dict], top: int, offset: int) -> dict:
    """The completions API's logprobs: parallel lists, text_offset from `offset`."""
    offsets, position = [], offset
    for e in entries:
        offsets.append(position)
        position += len(e["text"])
    return {
        "tokens": [e["text"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [dict(e["top"][:top]) for e in entries],
        "text_offset": offsets,
    }
