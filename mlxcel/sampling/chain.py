"""The sampler chain: docs/sampling.md's stages in their fixed order, then the draw.

`make_sampler_chain(config, vocab_size)` builds a `SamplerChain` once per job; `chain.start(rows,
histories)` gives a batch its `BatchSampler`, whose `sample(logits)` draws one token per row.

One path for every chain: the whole step (stages, draw, state update) is one lazy device graph
over the batch, compiled with `mx.compile` while its shapes stay fixed, where that pays: on a GPU,
and on the CPU for large batches (there each new shape costs seconds of kernel compilation, and a
compiled step only wins once batch x vocabulary reaches millions of entries). Stateless chains carry only
the rows' keys; stateful ones carry [B, ...] state arrays (history for penalties/DRY, mirostat's
mu, adaptive-p's W and T) that the step updates on the device. Nothing is read back to the host,
so the engine keeps the forward pass a step ahead with every sampler.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from mlxcel.errors import ConfigError, ConfigIssue, MlxcelError
from mlxcel.sampling import history as hist
from mlxcel.sampling import processors as proc
from mlxcel.sampling import selectors as sel
from mlxcel.sampling.config import SamplerConfig
from mlxcel.sampling.rng import (
    KEY_WORDS,
    XTC_STREAM,
    derive_row_seed,
    make_base_keys,
    make_key_table,
    make_step_key_words,
    uniform_from_step_keys,
)

STATEFUL_DRAWS = ("mirostat_v1", "mirostat_v2", "adaptive_p")
KEY_TABLE_STEPS = 64  # steps whose keys a batch derives at once (see rng.make_key_table)


@dataclass(frozen=True)
class RowKey:
    """Identifies a row's random stream; the position is added per step."""

    row_id: object
    sample_index: int = 0
    seed: int | None = None  # a per-row seed (JSONL `seed`) replaces the sampler's


@dataclass
class Draw:
    """One step's tokens [B] (lazy), with their logprobs and the top-N alternatives when asked."""

    tokens: mx.array
    logprobs: mx.array | None = None  # [B]
    top_ids: mx.array | None = None  # [B, N]
    top_logprobs: mx.array | None = None  # [B, N]

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.tokens, self.logprobs, self.top_ids, self.top_logprobs) if a is not None]

    def to_host(self) -> tuple[list[int], list[dict] | None]:
        """(token ids, per row {logprob, top: [[id, logprob], ...]} or None): the sync point."""
        tokens = self.tokens.tolist()
        if self.logprobs is None:
            return tokens, None
        chosen, ids, values = self.logprobs.tolist(), self.top_ids.tolist(), self.top_logprobs.tolist()
        rows = []
        for lp, row_ids, row_values in zip(chosen, ids, values):
            top = sorted(zip(row_ids, row_values), key=lambda item: (-item[1], item[0]))
            rows.append({"logprob": lp, "top": [[int(i), v] for i, v in top]})
        return tokens, rows


class SamplerChain:
    def __init__(
        self,
        config: SamplerConfig,
        vocab_size: int,
        encode: Callable[[str], list[int]] | None = None,
        eos_token_ids=(),
        compile: bool | None = None,
        max_context: int | None = None,
    ):
        self.config = config
        self.vocab_size = vocab_size
        self.chain = config.effective_chain()
        self.stages = self.chain[:-1]
        self.draw = self.chain[-1]
        self.seed = config.seed
        self.bias = make_bias_vector(config, vocab_size, eos_token_ids) if self.has("logit_bias") else None
        dry = self.get("dry")
        self.breakers = hist.make_breakers(dry["breakers"], encode) if dry else []
        self.exempt = hist.make_exempt_mask(self.breakers, vocab_size)
        windows = [self.get(name)["last_n"] for name in ("penalties", "dry") if self.has(name)]
        self.uses_history = bool(windows)
        self.history_width = None if not windows or min(windows) < 0 else max(windows)  # None: whole history
        if self.history_width is not None and max_context:
            # a history never holds more than the context: a wider window would only be padding
            self.history_width = min(self.history_width, max_context)
        self.uses_suffix = dry is not None
        self.compile = compile  # None: where it pays (see should_compile)
        self._compiled = mx.compile(self.run_step)
        self._compiled_draw = mx.compile(self.run_draw)

    def has(self, name: str) -> bool:
        return any(stage["stage"] == name for stage in self.stages)

    def get(self, name: str) -> dict | None:
        return next((stage for stage in self.stages if stage["stage"] == name), None)

    @property
    def is_stateful(self) -> bool:
        return self.uses_history or self.draw["kind"] in STATEFUL_DRAWS

    @property
    def is_greedy(self) -> bool:
        return self.draw["kind"] == "greedy"

    # ---- the step ----
    def apply_stages(self, x: mx.array, step_keys: mx.array, state: dict, with_xtc: bool = True) -> mx.array:
        """Every stage before the draw, in the chain's order."""
        for stage in self.stages:
            name = stage["stage"]
            if name not in proc.MASKING_STAGES:
                x = x.astype(mx.float32)  # arithmetic on the values: in float32 (a no-op once cast)
            if name == "logit_bias":
                x = proc.apply_logit_bias(x, self.bias)
            elif name == "penalties":
                x = hist.apply_penalties(
                    x, state["history"], stage["repeat"], stage["frequency"], stage["presence"], stage["last_n"]
                )
            elif name == "dry":
                x = hist.apply_dry(x, state["history"], state["suffix"], stage, self.breakers, self.exempt)
            elif name == "top_n_sigma":
                x = proc.apply_top_n_sigma(x, stage["n"])
            elif name == "top_k":
                x = proc.apply_top_k(x, stage["k"], stage["min_keep"])
            elif name == "typical_p":
                x = proc.apply_typical_p(x, stage["p"], stage["min_keep"])
            elif name == "top_p":
                x = proc.apply_top_p(x, stage["p"], stage["min_keep"])
            elif name == "min_p":
                x = proc.apply_min_p(x, stage["p"], stage["min_keep"])
            elif name == "xtc" and with_xtc:
                u = uniform_from_step_keys(step_keys, XTC_STREAM, 1)
                x = proc.apply_xtc(x, u, stage["probability"], stage["threshold"], stage["min_keep"])
            elif name == "temperature":
                if stage["dynatemp_range"] > 0:
                    x = proc.apply_dynamic_temperature(
                        x, stage["value"], stage["dynatemp_range"], stage["dynatemp_exponent"]
                    )
                else:
                    x = proc.apply_temperature(x, stage["value"])
        return x.astype(mx.float32)

    def run_step(self, logits: mx.array, step_keys: mx.array, state: dict):
        """(tokens [B], the logits drawn from, the next state): a pure function of arrays.
        step_keys: [B, KEY_WORDS] uint32, the rows' keys at this step (rng.make_step_key_words)."""
        x = self.apply_stages(logits, step_keys, state)
        kind, draw, state = self.draw["kind"], self.draw, dict(state)
        if kind == "greedy":
            tokens, z = sel.draw_greedy(x), x
        elif kind == "categorical":
            tokens, z = sel.draw_categorical(x, step_keys), x
        elif kind == "mirostat_v2":
            tokens, z, state["mu"] = sel.draw_mirostat_v2(x, step_keys, state["mu"], draw["tau"], draw["eta"])
        elif kind == "mirostat_v1":
            tokens, z, state["mu"] = sel.draw_mirostat_v1(x, step_keys, state["mu"], draw["tau"], draw["eta"])
        else:
            decay = sel.clamp_decay(draw["decay"])
            tokens, z, state["weight"], state["total"] = sel.draw_adaptive_p(
                x, step_keys, state["weight"], state["total"], draw["target"], decay
            )
        if self.uses_history:
            state["history"], state["suffix"] = hist.append_token(
                state["history"], state.get("suffix"), tokens, self.history_width is not None
            )
            if state["suffix"] is None:
                del state["suffix"]
        return tokens, z, state

    def run_draw(self, logits: mx.array, step_keys: mx.array, state: dict):
        """run_step without the logits drawn from: compiled, an unused output would still be
        written to memory ([B, V] float32 each step)."""
        tokens, _, state = self.run_step(logits, step_keys, state)
        return tokens, state

    # ---- batches ----
    def start(self, rows: list[RowKey], histories: list[list[int]] | None = None, logprobs: int = 0) -> BatchSampler:
        """A batch's sampler: its rows' keys and the initial state (history = prompt tokens)."""
        keys = make_base_keys(
            [derive_row_seed(self.seed if r.seed is None else r.seed, r.row_id, r.sample_index) for r in rows]
        )
        return BatchSampler(self, keys, self.make_state(len(rows), histories), logprobs)

    def make_state(self, batch: int, histories: list[list[int]] | None) -> dict:
        state = {}
        if self.uses_history:
            if histories is None or len(histories) != batch or not all(histories):
                raise MlxcelError("penalties and DRY need every row's history (at least one token)")
            array = hist.make_history(histories, self.history_width)
            state["history"] = mx.array(array)
            if self.uses_suffix:
                state["suffix"] = mx.array(hist.make_suffix_lengths(array))
        kind = self.draw["kind"]
        if kind.startswith("mirostat"):
            state["mu"] = mx.full((batch,), 2.0 * self.draw["tau"], mx.float32)
        elif kind == "adaptive_p":
            decay = sel.clamp_decay(self.draw["decay"])
            state["weight"] = mx.full((batch,), self.draw["target"] / (1 - decay), mx.float32)
            state["total"] = mx.full((batch,), 1 / (1 - decay), mx.float32)
        return state

    def logprobs(self, logits: mx.array, history: list[list[int]] | None = None) -> mx.array:
        """[B, V] log-probabilities of the distribution the draw samples from, -inf for removed
        tokens, over the deterministic stages (XTC's gate, mirostat and adaptive-p left out).
        Greedy: the distribution of the processed logits (the draw takes its argmax)."""
        batch = logits.shape[0]
        state = self.make_state(batch, history) if self.uses_history else {}
        keys = mx.zeros((batch, KEY_WORDS), mx.uint32)  # unused: no random stage runs
        x = self.apply_stages(logits, keys, state, with_xtc=False)
        return sel.log_softmax(x)

    def __call__(self, logits: mx.array, rows: list[RowKey], positions: list[int]) -> mx.array:
        """A stateless chain's tokens for rows at the given positions (no batch state)."""
        if self.is_stateful:
            raise MlxcelError(
                "this sampler chain keeps per-row state: draw through chain.start(rows, histories).sample(logits)"
            )
        keys = self.start(rows).keys
        step_keys = make_step_key_words(keys, mx.array(positions, dtype=mx.uint32)[:, None])[:, 0]
        return self.run_step(logits, step_keys, {})[0]


class BatchSampler:
    """One batch's sampler: the rows' keys, the step (position), and the chain's state."""

    def __init__(self, chain: SamplerChain, keys: mx.array, state: dict, logprobs: int = 0):
        self.chain = chain
        self.keys = keys  # [B, 2] base keys
        self.key_table: mx.array | None = None  # [KEY_TABLE_STEPS, B, KEY_WORDS] from the last multiple of it
        self.state = state
        self.top_n = logprobs
        self.step = 0
        fixed_shapes = chain.history_width is not None or not chain.uses_history
        self.compiled = fixed_shapes and should_compile(chain.compile, len(keys), chain.vocab_size)

    def step_keys(self) -> mx.array:
        """[B, KEY_WORDS]: the rows' keys at this step, a slice of the table (refilled every
        KEY_TABLE_STEPS steps)."""
        offset = self.step % KEY_TABLE_STEPS
        if offset == 0 or self.key_table is None:
            self.key_table = make_key_table(self.keys, self.step - offset, KEY_TABLE_STEPS)
        return self.key_table[offset]

    def sample(self, logits: mx.array) -> Draw:
        step_keys = self.step_keys()
        self.step += 1
        top_n = min(self.top_n, logits.shape[-1])
        if top_n <= 0:
            run = self.chain._compiled_draw if self.compiled else self.chain.run_draw
            tokens, self.state = run(logits, step_keys, self.state)
            return Draw(tokens)
        run = self.chain._compiled if self.compiled else self.chain.run_step
        tokens, z, self.state = run(logits, step_keys, self.state)
        lp = sel.log_softmax(z)
        top_ids = mx.argpartition(-lp, top_n - 1, axis=-1)[:, :top_n]
        return Draw(tokens, sel.take_token(lp, tokens), top_ids, mx.take_along_axis(lp, top_ids, axis=-1))

    def state_arrays(self) -> list[mx.array]:
        return list(self.state.values())


CPU_COMPILE_MIN_ENTRIES = 1 << 20  # batch x vocabulary; measured on a 2-core VM at vocab 152k (docs/benchmarks.md)


def should_compile(requested: bool | None, batch: int, vocab_size: int) -> bool:
    if requested is not None:
        return requested
    if mx.default_device() == mx.gpu:
        return True
    return batch * vocab_size >= CPU_COMPILE_MIN_ENTRIES and has_cpu_jit_compiler()


@lru_cache(maxsize=1)
def has_cpu_jit_compiler() -> bool:
    """MLX compiles CPU kernels with the system's C++ compiler; a slim machine without one runs
    the same step eagerly instead of failing."""
    return any(shutil.which(name) for name in ("g++", "c++", "clang++"))


def make_bias_vector(config: SamplerConfig, vocab_size: int, eos_token_ids) -> mx.array:
    """[V] float32: the biases, -inf for suppressed ids and (ignore_eos) the EOS ids."""
    params = config.processors["logit_bias"]
    key = "sampler.processors.logit_bias"
    issues = [
        ConfigIssue(f"{key}.bias.{t}", f"token id must be in [0, {vocab_size}) for this model", t)
        for t in params["bias"]
        if t >= vocab_size
    ]
    issues += [
        ConfigIssue(f"{key}.suppress", f"token ids must be in [0, {vocab_size}) for this model", t)
        for t in params["suppress"]
        if t >= vocab_size
    ]
    if issues:
        raise ConfigError(issues, hint="fix: use token ids of this model's vocabulary")
    bias = np.zeros(vocab_size, dtype=np.float32)
    for token, value in params["bias"].items():
        bias[int(token)] += value
    bias[list(params["suppress"])] = -np.inf
    if params["ignore_eos"]:
        bias[[t for t in eos_token_ids if 0 <= t < vocab_size]] = -np.inf
    return mx.array(bias)


def make_sampler_chain(
    sampler_config: dict | SamplerConfig,
    vocab_size: int,
    encode: Callable[[str], list[int]] | None = None,
    eos_token_ids=(),
    compile: bool | None = None,
    max_context: int | None = None,
) -> SamplerChain:
    """The chain for a `sampler` group (a plain dict as in the YAML, or validated).

    encode: text -> token ids without special tokens, to pre-tokenize DRY's breakers;
    eos_token_ids: what logit_bias.ignore_eos bans; compile: mx.compile the step (default: where it pays);
    max_context: the model's context, the widest a penalty or DRY window needs to be."""
    if not isinstance(sampler_config, SamplerConfig):
        from pydantic import ValidationError

        from mlxcel.config import (
            format_errors,  # the run config's formatter (it imports this package)
        )

        try:
            sampler_config = SamplerConfig.model_validate(sampler_config)
        except ValidationError as err:
            raise ConfigError(format_errors(SamplerConfig, err.errors(), ("sampler",))) from None
    return SamplerChain(sampler_config, vocab_size, encode, eos_token_ids, compile, max_context)


class Sampler(SamplerChain):
    """A temperature + greedy/categorical chain by hand (scripts, tests): Sampler("greedy")."""

    def __init__(self, draw: str = "greedy", temperature: float = 1.0, seed: int = 0, vocab_size: int = 0):
        processors = {"temperature": {"value": float(temperature)}} if draw != "greedy" else {}
        config = SamplerConfig.model_validate({"seed": seed, "processors": processors, "selector": {"kind": draw}})
        super().__init__(config, vocab_size)
