"""The sampler group's schema (docs/sampling.md): `processors` keyed by stage name, one
`selector` chosen by `kind`. Every parameter left unset takes llama.cpp's default.

Imports nothing from mlxcel.config (which imports this), so errors are raised in the shape its
formatter reads: `PydanticCustomError("mlxcel", ..., {"mlxcel": (field, message, value)})`.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from annotated_types import Ge
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]
Int = Annotated[int, Strict()]

# the canonical order, fixed here and never taken from the YAML
CHAIN_ORDER = (
    "logit_bias",
    "penalties",
    "dry",
    "top_n_sigma",
    "top_k",
    "typical_p",
    "top_p",
    "min_p",
    "xtc",
    "temperature",
)
SELECTOR_KINDS = ("greedy", "categorical", "mirostat_v1", "mirostat_v2", "adaptive_p")
TRUNCATION_STAGES = ("top_n_sigma", "top_k", "typical_p", "top_p", "min_p", "xtc")  # replaced by mirostat
MIN_KEEP_STAGES = ("top_k", "typical_p", "top_p", "min_p", "xtc")
DRY_MAX_BREAKER_CHARS = 40
# Counts of tokens a stage keeps or looks back over (min_keep, top_k.k, the penalty and DRY
# windows, token ids): a history window is an array of that width per row, so 10**12 would ask
# for terabytes. No vocabulary and no context we load reaches 2**20 (1,048,576); the chain also
# narrows a window to the model's context (SamplerChain).
MAX_SAMPLER_TOKENS = 2**20
MAX_DRY_BREAKERS = 64  # each breaker is matched over the window at every step (llama.cpp ships 4)


def reject(message: str, field: str | None, value: Any) -> PydanticCustomError:
    return PydanticCustomError("mlxcel", message, {"mlxcel": (field, message, value)})


def check_range(value: float, low: float | None, high: float | None, note: str = "") -> float:
    """Raise with the legal range (and what the edge values mean) when value is outside it."""
    if (low is not None and value < low) or (high is not None and value > high) or math.isnan(value):
        legal = (
            f"in [{low}, {high}]"
            if low is not None and high is not None
            else (f">= {low}" if low is not None else f"<= {high}")
        )
        raise reject(f"must be {legal}" + (f"; {note}" if note else ""), None, value)
    return value


def check_tokens(value: int, low: int, note: str = "") -> int:
    """A count of tokens (or a token id): at most MAX_SAMPLER_TOKENS."""
    return check_range(value, low, MAX_SAMPLER_TOKENS, note)


def check_positive(value: float, note: str = "") -> float:
    if not value > 0:
        raise reject("must be > 0" + (f"; {note}" if note else ""), None, value)
    return value


class Stage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _check_finite(self):
        """nan compares false with every bound, and inf means nothing for these parameters: a
        sampler given either would return junk, so neither gets through."""
        for name, value in self:
            if isinstance(value, float) and not math.isfinite(value):
                raise reject("must be a finite number", name, value)
        return self


class LogitBiasConfig(Stage):
    bias: dict[Int | str, Float] = Field(default_factory=dict)  # token id -> added to its logit (-inf bans it)
    suppress: list[Annotated[int, Strict(), Ge(0)]] = Field(default_factory=list)  # token ids never sampled
    ignore_eos: Bool = False  # the model's EOS ids get a bias of -inf

    @field_validator("bias")
    @classmethod
    def _check_ids(cls, bias: dict) -> dict:
        checked = {}
        for key, value in bias.items():
            token = key if isinstance(key, int) else int(key) if str(key).isdigit() else None
            if token is None or not 0 <= token < MAX_SAMPLER_TOKENS:
                raise reject(f"keys must be token ids (integers in [0, {MAX_SAMPLER_TOKENS}))", None, key)
            if math.isnan(value) or value == math.inf:
                raise reject(f"token {token}: a bias is a finite number, or -inf to ban the token", None, value)
            checked[token] = value
        return checked

    @field_validator("suppress")
    @classmethod
    def _check_suppress(cls, suppress: list[int]) -> list[int]:
        for token in suppress:
            if token >= MAX_SAMPLER_TOKENS:
                raise reject(f"token ids must be in [0, {MAX_SAMPLER_TOKENS})", None, token)
        if len(suppress) > MAX_SAMPLER_TOKENS:
            raise reject(f"must be a list of at most {MAX_SAMPLER_TOKENS} token ids", None, len(suppress))
        return suppress


class PenaltiesConfig(Stage):
    repeat: Float = 1.0  # 1.0 = off
    frequency: Float = 0.0
    presence: Float = 0.0
    last_n: Int = 64  # -1: the whole history; 0: off

    _repeat = field_validator("repeat")(lambda v: check_positive(v, "1.0 turns it off"))
    _last_n = field_validator("last_n")(lambda v: check_tokens(v, -1, "-1 = the whole history, 0 = off"))


class DryConfig(Stage):
    multiplier: Float = 0.0  # 0 = off
    base: Float = 1.75  # < 1 = off
    allowed_length: Int = 2
    last_n: Int = 64  # -1: the whole history; 0: off
    breakers: list[Annotated[str, Strict()]] = Field(default_factory=lambda: ["\n", ":", '"', "*"])

    _multiplier = field_validator("multiplier")(lambda v: check_range(v, 0.0, None, "0 turns DRY off"))
    _base = field_validator("base")(lambda v: check_range(v, 0.0, None, "values below 1 turn DRY off"))
    _allowed = field_validator("allowed_length")(lambda v: check_tokens(v, 0))
    _last_n = field_validator("last_n")(lambda v: check_tokens(v, -1, "-1 = the whole history, 0 = off"))

    @field_validator("breakers")
    @classmethod
    def _check_breakers(cls, breakers: list[str]) -> list[str]:
        if len(breakers) > MAX_DRY_BREAKERS:
            raise reject(f"must be a list of at most {MAX_DRY_BREAKERS} strings", None, len(breakers))
        for text in breakers:
            if not text or len(text) > DRY_MAX_BREAKER_CHARS:
                raise reject(f"each breaker must be a string of 1 to {DRY_MAX_BREAKER_CHARS} characters", None, text)
        return breakers


class TopNSigmaConfig(Stage):
    n: Float = -1.0  # <= 0 = off


class TopKConfig(Stage):
    k: Int = 40  # <= 0 = off

    _k = field_validator("k")(lambda v: check_range(v, None, MAX_SAMPLER_TOKENS, "<= 0 turns top-k off"))


def _probability(note: str):
    return field_validator("p")(lambda v: check_range(v, 0.0, 1.0, note))


class TypicalPConfig(Stage):
    p: Float = 1.0
    _p = _probability("1.0 turns typical-p off")


class TopPConfig(Stage):
    p: Float = 0.95
    _p = _probability("1.0 turns top-p off")


class MinPConfig(Stage):
    p: Float = 0.05
    _p = _probability("0.0 turns min-p off")


class XtcConfig(Stage):
    probability: Float = 0.0
    threshold: Float = 0.1

    _probability = field_validator("probability")(lambda v: check_range(v, 0.0, 1.0, "0.0 turns XTC off"))
    _threshold = field_validator("threshold")(lambda v: check_range(v, 0.0, 1.0, "values above 0.5 turn XTC off"))


class TemperatureConfig(Stage):
    value: Float = 0.8  # <= 0: a greedy draw
    dynatemp_range: Float = 0.0  # 0 = off
    dynatemp_exponent: Float = 1.0

    _range = field_validator("dynatemp_range")(lambda v: check_range(v, 0.0, None, "0.0 turns dynamic temperature off"))
    _exponent = field_validator("dynatemp_exponent")(lambda v: check_range(v, 0.0, None))


PROCESSORS: dict[str, type[Stage]] = {
    "logit_bias": LogitBiasConfig,
    "penalties": PenaltiesConfig,
    "dry": DryConfig,
    "top_n_sigma": TopNSigmaConfig,
    "top_k": TopKConfig,
    "typical_p": TypicalPConfig,
    "top_p": TopPConfig,
    "min_p": MinPConfig,
    "xtc": XtcConfig,
    "temperature": TemperatureConfig,
}


class NoParams(Stage):
    kind: str


class MirostatParams(Stage):
    kind: str
    tau: Float = 5.0  # target surprise (bits)
    eta: Float = 0.1  # learning rate

    _tau = field_validator("tau")(lambda v: check_range(v, 0.0, None))
    _eta = field_validator("eta")(lambda v: check_range(v, 0.0, None))


class AdaptivePParams(Stage):
    kind: str
    target: Float = -1.0  # average selected probability aimed at; < 0 = off (a plain categorical draw)
    decay: Float = 0.9

    _target = field_validator("target")(
        lambda v: check_range(v, None, 1.0, "a probability; values below 0 turn adaptive-p off")
    )
    _decay = field_validator("decay")(lambda v: check_range(v, 0.0, 0.99))


SELECTORS: dict[str, type[Stage]] = {
    "greedy": NoParams,
    "categorical": NoParams,
    "mirostat_v1": MirostatParams,
    "mirostat_v2": MirostatParams,
    "adaptive_p": AdaptivePParams,
}


def nested_error(model, prefix: tuple, errors: list[dict]) -> PydanticCustomError:
    return PydanticCustomError("mlxcel_nested", "invalid sampler config", {"nested": [(model, prefix, errors)]})


def custom_error(loc: tuple, message: str, value: Any) -> dict:
    return {"type": "mlxcel", "loc": loc, "input": value, "ctx": {"mlxcel": (None, message, value)}}


class SelectorConfig(BaseModel):
    """`kind` plus that kind's parameters (every one filled), e.g. {kind: mirostat_v2, tau: 5.0, eta: 0.1}."""

    model_config = ConfigDict(extra="allow")
    kind: str = "categorical"

    @model_validator(mode="before")
    @classmethod
    def _check_params(cls, data: Any) -> Any:
        if data is None:
            return {}
        if not isinstance(data, dict):
            return data
        kind = data.get("kind", "categorical")
        if kind not in SELECTORS:
            raise nested_error(
                None, (), [custom_error(("kind",), "unknown selector; known: " + ", ".join(SELECTOR_KINDS), kind)]
            )
        try:
            return SELECTORS[kind].model_validate({**data, "kind": kind}).model_dump()
        except ValidationError as err:
            raise nested_error(SELECTORS[kind], (), err.errors()) from None

    def params(self) -> dict:
        return {k: v for k, v in self.model_dump().items() if k != "kind"}


class SamplerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: Annotated[int, Strict(), Ge(0)] = 0
    min_keep: Annotated[int, Strict(), Ge(0)] = 0

    _min_keep = field_validator("min_keep")(lambda v: check_tokens(v, 0))
    # stage name -> its parameters, every one filled (validated by the stage's model in PROCESSORS)
    processors: dict[str, dict] = Field(default_factory=dict)
    selector: SelectorConfig = Field(default_factory=SelectorConfig)

    @field_validator("processors", mode="before")
    @classmethod
    def _check_processors(cls, value: Any) -> Any:
        if value is None:
            return {}
        if not isinstance(value, dict):
            return value  # the dict type check reports it
        checked, nested = {}, []  # nested: (model, loc prefix, pydantic-style errors)
        for name, params in value.items():
            if name not in PROCESSORS:
                message = "unknown sampler stage; known: " + ", ".join(CHAIN_ORDER)
                nested.append((None, (), [custom_error((name,), message, params)]))
                continue
            try:  # null or {} turns the stage on with its defaults
                checked[name] = PROCESSORS[name].model_validate({} if params is None else params).model_dump()
            except ValidationError as err:
                nested.append((PROCESSORS[name], (name,), err.errors()))
        if nested:
            raise PydanticCustomError("mlxcel_nested", "invalid sampler stages", {"nested": nested})
        return checked

    @model_validator(mode="after")
    def _check_mirostat(self) -> SamplerConfig:
        kind = self.selector.kind
        if kind.startswith("mirostat"):
            clash = [name for name in TRUNCATION_STAGES if name in self.processors]
            if clash:
                errors = [
                    custom_error(
                        ("processors", name),
                        f"cannot be combined with sampler.selector.kind={kind} (mirostat does its own truncation); "
                        f"remove it with '~sampler.processors.{name}' or choose another selector",
                        self.processors[name],
                    )
                    for name in clash
                ]
                raise nested_error(None, (), errors)
        return self

    def effective_chain(self) -> list[dict]:
        """The chain that runs, in its real order, every parameter filled. Stages that are off
        by their own values (e.g. top_p.p=1.0) are left out; temperature <= 0 is a greedy draw."""
        draw = self.selector.kind
        params = self.selector.params()
        stages = [name for name in CHAIN_ORDER if name in self.processors]
        if draw.startswith("mirostat"):
            stages = [name for name in stages if name not in TRUNCATION_STAGES]
        chain = []
        for name in stages:
            stage = {"stage": name, **self.processors[name]}
            if name in MIN_KEEP_STAGES:
                stage["min_keep"] = self.min_keep
            if not is_stage_off(stage):
                chain.append(stage)
        temperature = self.processors.get("temperature")
        if temperature is not None and temperature["value"] <= 0:  # as llama.cpp: not an error
            chain = [stage for stage in chain if stage["stage"] != "temperature"]
            draw, params = "greedy", {}
        if draw == "adaptive_p" and params["target"] < 0:
            draw, params = "categorical", {}  # off: a plain softmax draw
        return chain + [{"stage": "draw", "kind": draw, **params}]


def is_stage_off(stage: dict) -> bool:
    """docs/sampling.md's "off when" column."""
    name = stage["stage"]
    if name == "logit_bias":
        return not stage["bias"] and not stage["suppress"] and not stage["ignore_eos"]
    if name == "penalties":
        return stage["last_n"] == 0 or (
            stage["repeat"] == 1.0 and stage["frequency"] == 0.0 and stage["presence"] == 0.0
        )
    if name == "dry":
        return stage["multiplier"] == 0.0 or stage["base"] < 1.0 or stage["last_n"] == 0
    if name == "top_n_sigma":
        return stage["n"] <= 0
    if name == "top_k":
        return stage["k"] <= 0
    if name in ("typical_p", "top_p"):
        return stage["p"] >= 1.0
    if name == "min_p":
        return stage["p"] <= 0.0
    if name == "xtc":
        return stage["probability"] <= 0.0 or stage["threshold"] > 0.5
    return False
