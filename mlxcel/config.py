"""The run config: one pydantic sub-model per config group, `extra="forbid"` everywhere.

Hydra composes the YAML (conf/); `validate_config` turns the plain dict into a `RunConfig` or
raises one `ConfigError` listing every problem as `dotted.path: message (got VALUE)`. Nothing
here imports Hydra, so the runner and tests can build configs directly.

Adding a field: declare it on its group model (ints/floats/bools are strict so `true` is not 1).
Adding a group: a model here, a `RunConfig` field, a `conf/<group>/` folder. Adding a sampler
stage: a model in `PROCESSORS` (mlxcel/sampling/config.py). Custom checks raise `reject(...)`, which keeps the path.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Strict,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from mlxcel.checkpoints.embedded import EMBEDDED_MODELS
from mlxcel.checkpoints.hub import is_repo_id
from mlxcel.errors import ConfigError, ConfigIssue
from mlxcel.prefill_plan import DEFAULT_CHUNK_SIZE, choose_tile_size

Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]
PositiveInt = Annotated[int, Strict(), Gt(0)]
NonNegativeInt = Annotated[int, Strict(), Ge(0)]

ENV_HINT = "fix: unset the environment variable or give it a valid value"
NO_VALUE = object()  # reject(value=NO_VALUE): print no "(got ...)"
_INPUT = object()  # reject's default: the value the validator was given

# Ceilings on sizes a config or request sets: past them a value is a typo or an attack, and it
# would become an allocation (a KV pool, a row table) or an overflow (inf * 1e9 as bytes).
MAX_CONTEXT = 2**24  # tokens (16,777,216): past the longest context windows published (10M)
MAX_ROWS = 4096  # rows decoding at once: past any batch that fits a device's KV cache
MAX_MEMORY_GB = 4096.0  # a cache budget: 4 TB, past the memory of any machine MLX runs on
MAX_BODY_MB = 1024.0  # a request body, images included (base64)


ADAPTER_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}"  # model.adapters' names (requests say base:name)

# Keys that moved: naming the old one is an error that names the new one.
RENAMED_KEYS = {"runner.batch_size": ("runner.max_rows", "rows decoding at once")}


def describe_renamed(key: str) -> str:
    new, meaning = RENAMED_KEYS[key]
    return f"renamed to {new} ({meaning}); fix: {new}=N"


def reject(message: str, field: str | None = None, value: Any = _INPUT) -> PydanticCustomError:
    """An error for a validator to raise; `field` names the key when a model-level check raises it."""
    return PydanticCustomError("mlxcel", message, {"mlxcel": (field, message, value)})


def check_count_or_auto(value: Any, high: int) -> int | str:
    """A field that takes a whole number in [1, high] (not a bool) or 'auto'."""
    if value == "auto" or (type(value) is int and 0 < value <= high):
        return value
    raise reject(f"must be an integer in [1, {high}] or 'auto'")


def at_most(high: float, message: str) -> AfterValidator:
    """An upper bound that says the legal range in its message (`message`); inf and nan fail it."""

    def check(value: Any) -> Any:
        if not value <= high:
            raise reject(message)
        return value

    return AfterValidator(check)


def memory_gb(default: str) -> Any:
    """A memory budget in GB: (0, MAX_MEMORY_GB], or null for `default`."""
    message = f"must be a number of GB in (0, {MAX_MEMORY_GB:g}] (null: {default})"
    return Annotated[float, Field(gt=0), at_most(MAX_MEMORY_GB, message)] | None


class Group(BaseModel):
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True)


class QuantizeConfig(Group):
    """MLX affine quantization of the dense layers at load (`model.quantize={bits:4,group_size:64}`)."""

    bits: Literal[2, 3, 4, 5, 6, 8] = 4
    group_size: Literal[32, 64, 128] = 64


class ModelConfig(Group):
    path: str | None = None
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    gguf_weights: Literal["auto", "quantized", "dequantize"] = "auto"
    max_context: (
        Annotated[
            PositiveInt,
            at_most(MAX_CONTEXT, f"must be an integer in [1, {MAX_CONTEXT}] tokens (null: the model's own)"),
        ]
        | None
    ) = None
    quantize: QuantizeConfig | None = None
    # a family preset's model_types: the checkpoint must be one (checked from its header)
    families: list[str] | None = None
    hub_ids: list[str] | None = None  # a family preset's usual Hub repos, named when model.path is missing
    fuse: Bool = True  # QKV and gate/up as single matmuls at load; $MLXCEL_FUSE overrides (to measure or debug)
    # LoRA adapters (docs/adapters.md): one folder merged at load, or several {name: folder} kept unmerged
    adapter: str | None = None
    adapters: dict[str, str] | None = None
    merge_adapter: Bool = True  # model.adapter into dense weights at load (false: kept beside them)

    @field_validator("adapters")
    @classmethod
    def _check_adapter_names(cls, adapters: dict[str, str] | None) -> dict[str, str] | None:
        if adapters is not None and not adapters:
            raise reject("must name at least one adapter ({name: folder, ...}), or be null")
        for name in adapters or {}:
            if not re.fullmatch(ADAPTER_NAME, name):
                raise reject(
                    f"adapter name {name!r} must be 1-64 letters, digits, '_', '.' or '-' (not starting with "
                    "'.' or '-'; no ':' or '/': requests name an adapter as base:name)"
                )
        return adapters

    @field_validator("path")
    @classmethod
    def _check_path(cls, path: str | None) -> str | None:
        if path is not None and path.startswith("embedded:") and path.removeprefix("embedded:") not in EMBEDDED_MODELS:
            raise reject("unknown embedded model; known: " + ", ".join(f"embedded:{n}" for n in EMBEDDED_MODELS))
        return path

    def resolved_fuse(self) -> bool:
        """$MLXCEL_FUSE when set, else model.fuse."""
        raw = os.environ.get("MLXCEL_FUSE", "").strip()
        return self.fuse if not raw else read_env_flag("MLXCEL_FUSE")

    @model_validator(mode="after")
    def _require_path(self) -> ModelConfig:
        if self.path is None or not self.path.strip():
            if self.hub_ids:  # a family preset: its own repos are the likely answer
                hint = f"a model folder, a .gguf file or a Hub repo id, e.g. model.path={self.hub_ids[0]}"
                if len(self.hub_ids) > 1:
                    hint += f" (this family's usual repos: {', '.join(self.hub_ids)})"
            else:
                hint = (
                    "a model folder, a .gguf file, a Hub repo id (org/name) or embedded:smollm2 (e.g. model=hf "
                    "model.path=/path/to/model)"
                )
            raise reject(f"required: {hint}", "path", NO_VALUE if self.path is None else self.path)
        if self.adapter is not None and self.adapters is not None:
            raise reject(
                "set model.adapter (one adapter, merged) or model.adapters (several, unmerged), not both",
                "adapters",
                NO_VALUE,
            )
        return self


class TokenizerConfig(Group):
    kind: Literal["auto", "hf", "sentencepiece", "tiktoken", "gguf"] = "auto"
    path: str | None = None


class TemplateConfig(Group):
    kind: Literal["auto", "none", "chatml", "llama3", "gemma", "mistral"] = "auto"
    name: str | None = None  # one of the model's named templates (e.g. tool_use); null: "default"
    text: str | None = None
    file: str | None = None
    kwargs: dict[str, Any] = Field(default_factory=dict)  # extra template variables: enable_thinking, tools, documents
    # A special token's text in the messages (<|im_end|> typed by a user): text, tokenized as its
    # characters (the template's own markup keeps its special tokens), or special (the old way:
    # the rendered prompt is tokenized whole, so a user can write control tokens)
    special_tokens_in_content: Literal["text", "special"] = "text"
    # how tool calls in answers are read (mlxcel/tools/parsers.py): auto (from the chat template),
    # hermes (<tool_call> JSON), mistral ([TOOL_CALLS]), llama3_json, none
    tool_parser: Literal["auto", "hermes", "mistral", "llama3_json", "harmony", "none"] = "auto"
    # the thinking switch of templates that take one (Qwen 3, SmolLM3): passed as enable_thinking; null: theirs
    enable_thinking: Bool | None = None

    @model_validator(mode="after")
    def _check_override(self) -> TemplateConfig:
        if self.text is not None and self.file is not None:
            raise reject("set template.text or template.file, not both", "file", self.file)
        if self.kind != "auto":
            what = "no template" if self.kind == "none" else "a built-in template"
            for name in ("text", "file", "name"):
                if getattr(self, name) is not None:
                    raise reject(f"must be null with template.kind={self.kind} ({what})", name, getattr(self, name))
        return self


# ---- sampler (docs/sampling.md): its schema lives with the sampler chain ----
from mlxcel.sampling.config import SamplerConfig  # noqa: E402 (the schema's sampler half lives with the chain)


# ---- the other stages ----
def read_env_int(name: str, default: int) -> int:
    """A positive integer from the environment (unset or empty: default)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not re.fullmatch(r"[0-9]+", raw) or int(raw) <= 0:
        raise ConfigError(ConfigIssue(name, "environment variable: must be a positive integer", raw))
    return int(raw)


def read_env_flag(name: str) -> bool:
    """A boolean from the environment: 1/true/yes/on or 0/false/no/off (unset or empty: false)."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(ConfigIssue(name, "environment variable: must be 1 or 0", os.environ[name]))


MAX_TILE_SIZE = 1024
MAX_LOGPROBS = 20  # alternatives per token: OpenAI's and vLLM's limit
MAX_SAMPLES = 128  # a row's n: OpenAI's limit


class PrefillConfig(Group):
    chunk_size: Annotated[PositiveInt, at_most(MAX_CONTEXT, f"must be an integer in [1, {MAX_CONTEXT}]")] | None = None
    tile_size: int | str | None = "auto"  # auto: 32 on GPUs with Neural Accelerators, else none

    @field_validator("tile_size", mode="before")
    @classmethod
    def _check_tile_size(cls, value: Any) -> int | str | None:
        # tiles are hardware's (32 on Apple's Neural Accelerators): past MAX_TILE_SIZE a tile only pads
        if (
            value is None
            or value == "auto"
            or (isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_TILE_SIZE)
        ):
            return value
        raise reject(f"must be an integer in [1, {MAX_TILE_SIZE}], 'auto' or null")

    def resolved_chunk_size(self) -> int:
        """chunk_size, else $MLXCEL_PREFILL_CHUNK, else 2048."""
        if self.chunk_size is not None:
            return self.chunk_size
        return read_env_int("MLXCEL_PREFILL_CHUNK", DEFAULT_CHUNK_SIZE)

    def resolved_tile_size(self) -> int | None:
        """tile_size; auto pads only where a chunk holds a whole tile (a chunk below an explicit
        tile_size is a config error: check_prefill)."""
        tile = choose_tile_size(self.tile_size)
        if self.tile_size == "auto" and tile is not None and tile > self.resolved_chunk_size():
            return None
        return tile


class ConstraintConfig(Group):
    """What every answer must match (structured output, docs/structured.md): exactly one of these."""

    # a schema (true: any JSON value), its JSON text, or a .json file
    json_schema: dict[str, Any] | Annotated[bool, Strict()] | Annotated[str, Strict()] | None = None
    regex: Annotated[str, Strict()] | None = None
    choice: list[Annotated[str, Strict()]] | None = None  # the answer is one of these strings
    grammar: Annotated[str, Strict()] | None = None  # Lark (llguidance's dialect) or GBNF text, or a .lark/.gbnf file

    @model_validator(mode="after")
    def _check_one(self) -> ConstraintConfig:
        from mlxcel.structured.spec import SPEC_KINDS, ConstraintError, check_spec

        given = [kind for kind in SPEC_KINDS if getattr(self, kind) is not None]
        if len(given) != 1:
            raise reject(f"needs exactly one of {', '.join(SPEC_KINDS)} (got {given or 'none'})", None, NO_VALUE)
        kind = given[0]
        value = getattr(self, kind)
        if isinstance(value, str) and is_constraint_file(kind, value):
            return self  # a file: read and checked when the run starts (to_spec)
        try:
            check_spec({kind: value})
        except ConstraintError as exc:
            raise reject(exc.reason, kind, value) from None
        return self

    def to_spec(self) -> dict:
        """The spec (structured.spec) this config asks for, files read."""
        from mlxcel.structured.spec import SPEC_KINDS, ConstraintError, check_spec

        kind = next(kind for kind in SPEC_KINDS if getattr(self, kind) is not None)
        value = getattr(self, kind)
        text = read_constraint_file(kind, value) if isinstance(value, str) and is_constraint_file(kind, value) else None
        try:
            return check_spec({kind: value if text is None else text})
        except ConstraintError as exc:
            raise ConfigError(ConfigIssue(f"decode.constraint.{kind}", exc.reason, value)) from None


CONSTRAINT_FILE_SUFFIXES = {"json_schema": (".json",), "grammar": (".lark", ".gbnf", ".ebnf")}


def is_constraint_file(kind: str, value: str) -> bool:
    """A constraint given as a file path: a one-line value with the kind's suffix."""
    suffixes = CONSTRAINT_FILE_SUFFIXES.get(kind)
    return bool(suffixes) and "\n" not in value and value.strip().lower().endswith(suffixes)


def read_constraint_file(kind: str, value: str) -> str:
    path = Path(value.strip()).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(
            ConfigIssue(f"decode.constraint.{kind}", f"cannot read the file: {exc.strerror or exc}", value)
        ) from None


MAX_DRAFT_TOKENS = 16
# decode.draft.tokens=auto by method (docs/speculative.md: replaying plain decoding on the extraction
# prompts, lookup at 4 / 8 / 16 drew 3.33 / 4.62 / 5.38 tokens a step; CPU bench, one prompt, 128
# tokens: 28.8 / 31.3 / 31.5 tok/s against 12.1 plain)
AUTO_DRAFT_TOKENS = {"ngram": 16, "model": 4}
MAX_NGRAM = 16


class DraftConfig(Group):
    """Speculative decoding (docs/speculative.md): a row drafts its next tokens, one forward call
    verifies them; the tokens are exactly those of plain decoding."""

    # ngram: prompt lookup (the row's own prompt and output); model: a smaller model of the same tokenizer
    method: Literal["none", "ngram", "model"] = "none"
    model_path: str | None = None  # method=model: the draft model (a folder, a .gguf, embedded:..., a Hub id)
    # the most drafted a step; auto: 16 for lookup (free to make; a verify call's extra positions
    # cost little next to its launches), 4 for a draft model (a forward step each)
    tokens: int | Literal["auto"] = "auto"
    adaptive: Bool = True  # fewer (then none, for a while) where drafts miss; up to `tokens` where they hit
    ngram_min: Annotated[int, Strict(), Field(ge=1, le=MAX_NGRAM)] = 2  # the shortest suffix looked up
    ngram_max: Annotated[int, Strict(), Field(ge=1, le=MAX_NGRAM)] = 4  # the longest, tried first

    @field_validator("tokens", mode="before")
    @classmethod
    def _check_tokens(cls, value: Any) -> int | str:
        return check_count_or_auto(value, MAX_DRAFT_TOKENS)

    @model_validator(mode="after")
    def _check_ngrams(self) -> DraftConfig:
        if self.tokens == "auto":
            self.tokens = AUTO_DRAFT_TOKENS["model" if self.method == "model" else "ngram"]
        if self.method == "model" and not self.model_path:
            raise reject("decode.draft.method=model needs the draft model: set decode.draft.model_path", "model_path")
        if self.model_path and self.method != "model":
            raise reject(
                f"is set but decode.draft.method is {self.method}: set decode.draft.method=model to use it",
                "model_path",
                self.model_path,
            )
        if self.ngram_min > self.ngram_max:
            raise reject(f"must be <= decode.draft.ngram_max ({self.ngram_max})", "ngram_min", self.ngram_min)
        return self


class DecodeConfig(Group):
    max_tokens: PositiveInt = 256
    stop_token_ids: list[NonNegativeInt] = Field(default_factory=list)
    stop_strings: list[str] = Field(default_factory=list)  # text that ends a row, cut from its output
    ignore_eos: Bool = False
    pipeline: Bool = True
    # > 0: each generated token's logprob and the top-N alternatives in generations.jsonl
    logprobs: Annotated[int, Strict(), Field(ge=0, le=MAX_LOGPROBS)] = 0
    kv_bits: Literal[2, 3, 4, 5, 6, 8] | None = None  # store the KV cache quantized (full-attention layers)
    kv_group_size: Literal[32, 64, 128] = 64  # must divide the model's head_dim
    step: Literal["auto", "eager", "segmented", "compiled"] = "auto"  # how a decode step runs; env: MLXCEL_DECODE_STEP
    # structured output: what every answer must match (rows may set their own)
    constraint: ConstraintConfig | None = None
    draft: DraftConfig = Field(default_factory=DraftConfig)  # speculative decoding

    @field_validator("stop_strings")
    @classmethod
    def _check_stop_strings(cls, values: list[str]) -> list[str]:
        if any(v == "" for v in values):
            raise reject("stop strings must not be empty (an empty one would stop before the first token)")
        return values

    @field_validator("constraint", mode="before")
    @classmethod
    def _unset_constraint(cls, value: Any) -> Any:
        # conf/decode/default.yaml lists the four keys as null (so `decode.constraint.regex=...`
        # needs no `+`): none set is no constraint
        if isinstance(value, dict) and all(v is None for v in value.values()):
            return None
        return value

    @model_validator(mode="after")
    def _check_constraint_eos(self) -> DecodeConfig:
        if self.constraint is not None and self.ignore_eos:
            raise reject(
                "cannot be true with decode.constraint: a constrained answer ends with EOS once it is whole "
                "(fix: drop decode.ignore_eos)",
                "ignore_eos",
            )
        return self

    def use_pipeline(self) -> bool:
        """Pipelined decode unless decode.pipeline=false or MLXCEL_FORCE_SYNC=1."""
        return self.pipeline and not read_env_flag("MLXCEL_FORCE_SYNC")

    def resolved_step(self) -> str:
        return resolve_decode_step(self.step)


DECODE_STEPS = ("eager", "segmented", "compiled")


def resolve_decode_step(requested: str = "auto") -> str:
    """$MLXCEL_DECODE_STEP (or the older MLXCEL_COMPILE=1) when set, else `requested`; auto is
    segmented on a GPU (per-op host cost bounds decode there) and eager on the CPU (bound by the
    matmuls, and compiling there needs a system C++ compiler)."""
    step = os.environ.get("MLXCEL_DECODE_STEP", "").strip().lower()
    if step and step not in DECODE_STEPS:
        raise ConfigError(
            ConfigIssue(
                "MLXCEL_DECODE_STEP",
                f"environment variable: must be one of {', '.join(DECODE_STEPS)} (unset it for decode.step)",
                step,
            )
        )
    step = step or ("compiled" if read_env_flag("MLXCEL_COMPILE") else requested)
    if step == "auto":
        import mlx.core as mx

        step = "segmented" if mx.default_device() == mx.gpu else "eager"
    return step


def _check_not_blank(text: str | None) -> str | None:
    if text is not None and not text.strip():
        raise reject("must not be empty or only whitespace")
    return text


class ContentPart(Group):
    """One part of a message's content: `{"type": "text", "text": ...}` or
    `{"type": "image", "path": ...}` (vision-language models; the chat template places the
    model's image placeholder where the part stands)."""

    type: Literal["text", "image"]
    text: str | None = None
    path: str | None = None

    @model_validator(mode="after")
    def _check_fields(self) -> ContentPart:
        needed, other = ("text", "path") if self.type == "text" else ("path", "text")
        article = "an" if self.type == "image" else "a"
        if getattr(self, needed) is None:
            raise reject(f"{article} {self.type} part needs '{needed}'", needed, NO_VALUE)
        if getattr(self, other) is not None:
            raise reject(f"{article} {self.type} part takes '{needed}', not '{other}'", other, getattr(self, other))
        return self


def pick_content_kind(value: Any) -> str:
    return "parts" if isinstance(value, list) else "none" if value is None else "text"


# Text or a list of parts, told apart by the value's type, so a bad part reports its own error
# only (a plain union would also report "must be a string" for every list).
CONTENT_TAGS = ("text", "parts", "none")
MessageContent = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[ContentPart], Tag("parts")] | Annotated[None, Tag("none")],
    Discriminator(pick_content_kind),
]


class Message(Group):
    """A chat message as transformers' templates take it: tool calls on an assistant message,
    and `tool_call_id` / `name` on a tool result. Content is text, or a list of text and image
    parts."""

    role: Literal["system", "user", "assistant", "tool"]
    content: MessageContent = None
    # assistant: [{"type": "function", "function": {"name", "arguments"}}]
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None  # tool: which call this answers
    name: str | None = None  # tool: the function's name

    @model_validator(mode="after")
    def _check_content(self) -> Message:
        if self.role == "assistant" and self.tool_calls:
            return self  # a message that only calls tools may have no text
        if self.content is None:
            raise reject("required (only an assistant message with tool_calls may omit it)", "content", NO_VALUE)
        if isinstance(self.content, list):
            if not self.content:
                raise reject("must not be an empty list of parts", "content", self.content)
            return self
        if not self.content.strip():
            raise reject("must not be empty or only whitespace", "content", self.content)
        return self

    def to_dict(self) -> dict[str, Any]:
        """Only the keys given: templates test `message.tool_calls is defined`."""
        return self.model_dump(exclude_none=True)


class PromptRow(Group):
    """One prompt of a batch job: a JSONL line of prompt.file, or an item of prompt.rows."""

    id: Any = None  # a string or an integer; default: the line (item) number, from 1
    prompt: Annotated[str, Strict()] | None = None  # one user message, templated
    images: list[str] | None = None  # image files for the user message of `prompt`, placed before its text
    messages: list[Message] | None = None  # a conversation
    max_tokens: PositiveInt | None = None  # default: decode.max_tokens
    seed: NonNegativeInt | None = None  # default: sampler.seed
    n: Annotated[int, Strict(), Field(ge=1, le=MAX_SAMPLES)] = 1  # samples of this prompt
    tools: list[dict[str, Any]] | None = None  # this row's tool definitions (default: template.kwargs.tools)
    # as OpenAI's chat API (docs/tools.md): none, auto (default with tools), required, or
    # {"type": "function", "function": {"name": ...}}; required and a named function constrain the answer
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool = True
    # structured output: what this row's answer must match (default: decode.constraint); as in the
    # config ({"json_schema": {...}}, regex, choice or grammar), or OpenAI's response_format. One
    # that cannot be read is the row's error, not the job's (jobs.read_row_constraint)
    constraint: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    adapter: str | None = None  # one of model.adapters' names (default: the base model)

    _check_prompt = field_validator("prompt")(_check_not_blank)

    def to_constraint(self) -> dict | None:
        """The row's own spec (structured.spec), from `constraint` or `response_format`;
        ConstraintError if it cannot be read."""
        from mlxcel.structured.spec import read_spec

        return read_spec(self.constraint, self.response_format)

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: Any) -> str | int | None:
        if value is None or (isinstance(value, (str, int)) and not isinstance(value, bool)):
            return value
        raise reject("must be a string or an integer")

    @model_validator(mode="after")
    def _check_one_source(self) -> PromptRow:
        if (self.prompt is None) == (not self.messages):
            raise reject(
                "each row needs exactly one of 'prompt' (text) or 'messages' (a conversation)", "prompt", NO_VALUE
            )
        if self.images and self.messages:
            raise reject(
                "'images' goes with 'prompt'; in 'messages' put image parts in the content", "images", self.images
            )
        return self

    def to_messages(self) -> list[dict]:
        return [m.to_dict() for m in self.messages] if self.messages else [make_user_message(self.prompt, self.images)]


def make_user_message(text: str, images: list[str] | None = None) -> dict:
    """A user turn; with images, a content list: the images first, then the text."""
    if not images:
        return {"role": "user", "content": text}
    return {
        "role": "user",
        "content": [*({"type": "image", "path": p} for p in images), {"type": "text", "text": text}],
    }


class PromptConfig(Group):
    text: str | None = None
    images: list[str] | None = None  # image files for the user message of `text` (VLMs), placed before it
    system: str | None = None  # "" is allowed: it stops a template from adding its default system prompt
    messages: list[Message] | None = None
    file: str | None = None  # a JSONL file of rows (see PromptRow): a batch job
    format: Literal["auto", "rows", "openai_batch"] = "auto"  # prompt.file's lines; auto: told from the first
    rows: list[PromptRow] | None = None  # the same rows inline in YAML

    _check_text = field_validator("text")(_check_not_blank)

    @model_validator(mode="after")
    def _check_one_source(self) -> PromptConfig:
        sources = [name for name in ("text", "messages", "file", "rows") if getattr(self, name) not in (None, [])]
        if not sources:
            raise reject(
                "required: set prompt.text, prompt.messages, prompt.file (JSONL) or prompt.rows", "text", NO_VALUE
            )
        if len(sources) > 1:
            hint = (
                "; give one (prompt.file alone runs a batch job: the default text steps aside)"
                if "text" in sources
                else ""
            )
            raise reject(
                "set only one of prompt.text, prompt.messages, prompt.file, prompt.rows (got "
                f"{', '.join(sources)}){hint}",
                sources[1],
                NO_VALUE,
            )
        if self.images and self.text is None:
            raise reject(
                "prompt.images go with prompt.text (in prompt.messages or a JSONL row, use image parts)",
                "images",
                self.images,
            )
        if self.system is not None and self.messages and any(m.role == "system" for m in self.messages):
            raise reject("prompt.messages already has a system message; set one or the other", "system", self.system)
        return self

    @property
    def is_batch(self) -> bool:
        return self.file is not None or self.rows is not None

    def to_messages(self) -> list[dict]:
        """The conversation as role/content dicts, the system message first when set."""
        return self.with_system(
            [m.to_dict() for m in self.messages] if self.messages else [make_user_message(self.text, self.images)]
        )

    def with_system(self, messages: list[dict]) -> list[dict]:
        """prompt.system goes first, unless the conversation brings its own system message."""
        if self.system is None or any(m["role"] == "system" for m in messages):
            return messages
        return [{"role": "system", "content": self.system}, *messages]


class RayConfig(Group):
    """runner.backend=ray: where the job's workers run (docs/scaleout.md)."""

    address: str | None = None  # None: a local cluster for this job; "auto": the running one; "ray://HOST:10001"
    # actors, each loading the model once and running the scheduler
    workers: Annotated[PositiveInt, at_most(MAX_ROWS, f"must be an integer in [1, {MAX_ROWS}]")] = 1
    cpus_per_worker: Annotated[float, Field(gt=0), at_most(1024, "must be a number in (0, 1024]")] = 1.0
    gpus_per_worker: Annotated[float, Field(ge=0), at_most(1024, "must be a number in [0, 1024]")] = 0.0
    # workers not started by then: an error naming why
    start_timeout_s: Annotated[float, Field(gt=0), at_most(86400, "must be a number of seconds in (0, 86400]")] = 300.0


class RunnerConfig(Group):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]+$")] = "default"
    device: Literal["auto", "cpu", "gpu"] = "auto"
    # rows decoding at once; auto: 8 on the CPU, what the KV budget holds on a GPU (engine/auto_rows.py)
    max_rows: int | Literal["auto"] = "auto"
    kv_budget_gb: memory_gb("40% of device memory") = None  # KV cache cap (RAM on the CPU)
    # the prompt cache: rows that start with a cached prefix prefill only the rest (docs/jobs.md)
    prompt_cache: Bool = True
    prompt_cache_gb: memory_gb("10% of device memory") = None  # (RAM on the CPU)
    prompt_cache_dir: str | None = None  # save entries here and load them in later jobs (one folder per machine)
    resume: Bool = False  # continue the run folder hydra.run.dir: skip ids already written
    dry_run: Bool = False  # validate, render and tokenize every prompt; load no weights
    progress: Literal["auto", "bar", "log", "off"] = "auto"  # auto: a bar on a terminal, log lines otherwise
    backend: Literal["local", "ray"] = "local"  # ray: a JSONL job's rows across Ray workers (runner.ray)
    # each row's token ids equal the row run alone, whatever shares its batch, on every backend (docs/jobs.md)
    batch_invariant: Bool = False
    ray: RayConfig = Field(default_factory=RayConfig)

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if name in (".", ".."):
            raise reject("must name a folder: letters, digits, '.', '_', '-', not '.' or '..'")
        return name

    @field_validator("max_rows", mode="before")
    @classmethod
    def _check_max_rows(cls, value: Any) -> int | str:
        return check_count_or_auto(value, MAX_ROWS)


class ServeConfig(Group):
    """`mlxcel-serve`'s own settings (conf/serve/default.yaml; docs/serve.md). Rows at once come
    from runner.max_rows."""

    host: str = "127.0.0.1"
    port: Annotated[int, Strict(), Ge(0), Le(65535)] = 8000  # 0: any free port (printed at start)
    max_queue: NonNegativeInt = 256  # rows waiting beyond runner.max_rows; past it a request gets 429
    api_keys_file: str | None = None  # one key a line; or $MLXCEL_API_KEYS (comma-separated); none: no keys
    log_text: Bool = False  # prompts and answers in generations.jsonl (off: figures only)
    image_dirs: list[str] = Field(default_factory=list)  # local image paths allowed in image_url (default none)
    max_body_mb: Annotated[  # larger request bodies get 413
        float, Field(gt=0), at_most(MAX_BODY_MB, f"must be a number of MB in (0, {MAX_BODY_MB:g}]")
    ] = 32.0
    model_name: str | None = None  # the id /v1/models lists; default: model.path's last part

    @field_validator("api_keys_file")
    @classmethod
    def _check_keys_file(cls, path: str | None) -> str | None:
        if path is not None and not Path(path).expanduser().is_file():
            raise reject("must be a file of API keys, one a line", None, path)
        return path


class RunConfig(Group):
    model: ModelConfig
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    template: TemplateConfig = Field(default_factory=TemplateConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    prefill: PrefillConfig = Field(default_factory=PrefillConfig)
    decode: DecodeConfig = Field(default_factory=DecodeConfig)
    prompt: PromptConfig = Field(default_factory=PromptConfig)
    runner: RunnerConfig = Field(default_factory=RunnerConfig)
    serve: ServeConfig | None = None  # mlxcel-serve only (it composes conf/serve/default.yaml in)

    @model_validator(mode="before")
    @classmethod
    def _fill_missing_groups(cls, data: Any) -> Any:
        # Validate a missing group as {} so its errors keep their paths (model.path: required),
        # instead of raising from a default factory.
        if isinstance(data, dict):
            return {**{name: {} for name in cls.model_fields if name != "serve"}, **data}
        return data

    def resolved_dict(self) -> dict:
        """JSON-ready config with the env-dependent values and the sampler chain resolved."""
        data = self.model_dump(mode="json")
        data["prefill"]["resolved_chunk_size"] = self.prefill.resolved_chunk_size()
        data["decode"]["use_pipeline"] = self.decode.use_pipeline()
        data["decode"]["resolved_step"] = self.decode.resolved_step()
        data["model"]["resolved_fuse"] = self.model.resolved_fuse()
        data["sampler"]["chain"] = self.sampler.effective_chain()
        if data["serve"] is None:
            del data["serve"]
        return data


# ---- validation entry point and error formatting ----
def validate_config(data: dict) -> RunConfig:
    """Validate a composed config; raise one ConfigError with every problem found."""
    issues: list[ConfigIssue] = []
    cfg = None
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        issues += format_errors(RunConfig, err.errors())
    env_checks = (
        lambda: read_env_flag("MLXCEL_FORCE_SYNC"),
        lambda: read_env_int("MLXCEL_PREFILL_CHUNK", 1),
        lambda: read_env_flag("MLXCEL_FUSE"),
        lambda: read_env_flag("MLXCEL_COMPILE"),
        resolve_decode_step,
    )
    for check in env_checks:
        try:
            check()
        except ConfigError as err:
            issues += err.issues
    if cfg is not None:
        issues += check_paths(cfg) + check_prefill(cfg)
    if issues:
        from_env = [issue.path.startswith("MLXCEL_") for issue in issues]
        first = next((issue for issue in issues if not issue.path.startswith("MLXCEL_")), None)
        hints = ([make_hint(first.path, first.message.startswith("unknown key"))] if first else []) + (
            [ENV_HINT] if any(from_env) else []
        )
        raise ConfigError(issues, hint="\n".join(hints))
    return cfg


def make_hint(key: str, unknown: bool = False) -> str:
    """Point at the first bad key: the fix is an override or an edit of its group's YAML (or, for
    a key that does not exist, its spelling)."""
    group = key.split(".")[0]
    if unknown:
        return "fix: spell the key as the valid keys above (mlxcel-run --cfg job shows every key), or drop it"
    return f"fix: override it on the command line (e.g. {key}=...) or edit conf/{group}/ (or your own config)"


def suggest_key(key: str, valid: list[str]) -> str:
    """' (did you mean prompt.text?)' for a misspelt dotted `key` among its parent's `valid` names."""
    import difflib

    parent, _, name = key.rpartition(".")
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    return f" (did you mean {parent + '.' if parent else ''}{close[0]}?)" if close else ""


def check_paths(cfg: RunConfig) -> list[ConfigIssue]:
    """Files named by the config must exist (relative paths: from the launch directory), and be
    regular files or folders: reading a FIFO waits forever, /dev/zero never ends."""
    paths = {
        "model.path": cfg.model.path,
        "tokenizer.path": cfg.tokenizer.path,
        "template.file": cfg.template.file,
        "prompt.file": cfg.prompt.file,
    }
    adapters = {"model.adapter": cfg.model.adapter} | {
        f"model.adapters.{name}": path for name, path in (cfg.model.adapters or {}).items()
    }
    issues = []
    for key, path in adapters.items():
        if path is not None and not Path(path).expanduser().is_dir():
            issues.append(ConfigIssue(key, "must be an adapter folder (adapter_config.json + *.safetensors)", path))
    for key, path in paths.items():
        if path is None or path.startswith("embedded:"):
            continue
        if not Path(path).expanduser().exists():
            if not (key == "model.path" and is_repo_id(path)):  # a Hub repo id: the loader resolves it
                issues.append(ConfigIssue(key, "no such file or directory", path))
            continue
        issue = check_regular_file(key, path, folder_ok=key in ("model.path", "tokenizer.path"))
        issues += [issue] if issue is not None else []
    return issues


def check_regular_file(key: str, path: str, folder_ok: bool = False) -> ConfigIssue | None:
    """A path the config reads must be a regular file (or, with folder_ok, a folder), links followed."""
    from mlxcel.checkpoints.fingerprint import describe_file_kind

    resolved = Path(path).expanduser()
    if resolved.is_file() or (folder_ok and resolved.is_dir()):
        return None
    wanted = "a regular file or a folder" if folder_ok else "a regular file"
    return ConfigIssue(key, f"must be {wanted}, not {describe_file_kind(resolved)}", path)


def check_prefill(cfg: RunConfig) -> list[ConfigIssue]:
    """Prefill pieces are whole tiles, so a chunk below one tile holds none: the scheduler would
    wait forever for a piece that fits. (tile_size=auto steps aside instead: resolved_tile_size.)"""
    tile = cfg.prefill.tile_size
    if not isinstance(tile, int):
        return []
    try:
        chunk = cfg.prefill.resolved_chunk_size()
    except ConfigError:
        return []  # a bad $MLXCEL_PREFILL_CHUNK is reported on its own
    if chunk >= tile:
        return []
    key = "prefill.chunk_size" if cfg.prefill.chunk_size is not None else "MLXCEL_PREFILL_CHUNK"
    return [
        ConfigIssue(
            key,
            f"must be >= prefill.tile_size ({tile}): prefill pieces are whole tiles, and a chunk below one "
            "tile holds none (raise it, or lower prefill.tile_size, or set prefill.tile_size=null)",
            chunk,
        )
    ]


def format_errors(root: type[BaseModel] | None, errors: list[dict], prefix: tuple = ()) -> list[ConfigIssue]:
    issues = []
    for err in errors:
        ctx = err.get("ctx") or {}
        if "nested" in ctx:  # a sampler stage validated by its own model
            for model, sub_prefix, sub_errors in ctx["nested"]:
                issues += format_errors(model, sub_errors, prefix + tuple(err["loc"]) + sub_prefix)
            continue
        issues.append(format_error(root, err, prefix))
    return issues


_TYPE_NAMES = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "list_type": "a list",
}
_BOUNDS = {Gt: ("gt", ">"), Ge: ("ge", ">="), Lt: ("lt", "<"), Le: ("le", "<=")}


def drop_union_tags(loc: tuple) -> tuple:
    """A message's `content.parts.0.path` is `content.0.path` to the user (CONTENT_TAGS)."""
    return tuple(part for i, part in enumerate(loc) if not (i and loc[i - 1] == "content" and part in CONTENT_TAGS))


def format_error(root: type[BaseModel] | None, err: dict, prefix: tuple) -> ConfigIssue:
    loc, kind, value = drop_union_tags(tuple(err["loc"])), err["type"], err.get("input")
    ctx = err.get("ctx") or {}
    if kind == "mlxcel":
        field, message, given = ctx["mlxcel"]
        loc, value = (loc + (field,) if field else loc), (value if given is _INPUT else given)
        return make_issue(prefix + loc, message, value, has_value=value is not NO_VALUE)
    parent = find_model(root, loc[:-1])
    field = parent.model_fields.get(loc[-1]) if parent is not None and loc else None
    if kind == "missing":
        return make_issue(prefix + loc, "required", has_value=False)
    if kind == "extra_forbidden" and ".".join(map(str, prefix + loc)) in RENAMED_KEYS:
        return make_issue(prefix + loc, describe_renamed(".".join(map(str, prefix + loc))), value)
    if kind == "extra_forbidden":
        valid = list(parent.model_fields) if parent is not None else []
        return make_issue(
            prefix + loc,
            f"unknown key{suggest_key('.'.join(map(str, prefix + loc)), valid)}; valid keys: {', '.join(valid)}",
            value,
        )
    if kind == "literal_error":
        choices = ctx["expected"].replace("'", "").replace(" or ", ", ")
        return make_issue(prefix + loc, f"must be one of: {choices}", value)
    if kind in _TYPE_NAMES:
        rule = " ".join(filter(None, [_TYPE_NAMES[kind], describe_bounds(field)]))
        nullable = field is not None and type(None) in get_args(field.annotation)
        return make_issue(prefix + loc, f"must be {rule}" + (" or null" if nullable else ""), value)
    for attr, sign in _BOUNDS.values():
        if attr in ctx:
            return make_issue(prefix + loc, f"must be {sign} {ctx[attr]}", value)
    if kind == "string_pattern_mismatch":
        return make_issue(prefix + loc, f"must match {ctx['pattern'].strip('^$')}", value)
    message = err["msg"].removeprefix("Value error, ")
    return make_issue(prefix + loc, message[:1].lower() + message[1:], value)


def make_issue(loc: tuple, message: str, value: Any = None, has_value: bool = True) -> ConfigIssue:
    path = ".".join(str(part) for part in loc) or "config"
    return ConfigIssue(path, message, value, has_value)


def describe_bounds(field: Any) -> str:
    """'> 0' for a field declared with Gt(0): says the legal range next to a type error."""
    if field is None:
        return ""
    metadata = list(field.metadata)
    if get_origin(field.annotation) in (Union, UnionType):  # Optional[Annotated[...]] keeps its bounds inside
        for arg in get_args(field.annotation):
            metadata += list(getattr(arg, "__metadata__", ()))
    return " ".join(
        f"{sign} {getattr(m, attr)}" for m in metadata for cls, (attr, sign) in _BOUNDS.items() if isinstance(m, cls)
    )


def find_model(root: type[BaseModel] | None, loc: tuple) -> type[BaseModel] | None:
    """The model class that holds the key at `loc` (list indices skipped), or None."""
    model = root
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        model = find_submodel(field.annotation) if field is not None else None
    return model


def find_submodel(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = find_submodel(arg)
        if found is not None:
            return found
    return None
