"""Phi-3 / Phi-3.5 / Phi-4 (model_type phi3): the Llama block with Q/K/V and gate/up already fused
in the checkpoint (qkv_proj, gate_up_proj: loaded as they are), partial rotary dims, long-context
"longrope" RoPE scaling, and an optional sliding window (Phi-3-mini-4k: 2047)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx import nn

from mlxcel.errors import MlxcelError
from mlxcel.models import llama
from mlxcel.models.base import RoPE, read_rope_scaling
from mlxcel.models.rotating_cache import SlidingWindowLayers

REQUIRED_KEYS = llama.REQUIRED_KEYS
LONGROPE_NAMES = ("longrope", "su", "yarn")  # transformers reads Phi-3's su and yarn as longrope


@dataclass
class ModelArgs(llama.ModelArgs):
    partial_rotary_factor: float = 1.0
    longrope: dict | None = None
    layer_windows: list[int | None] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict, **overrides) -> ModelArgs:
        scaling = read_rope_scaling(config)
        params = config.get("rope_parameters") or {}
        values = {
            "partial_rotary_factor": params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)),
            "layer_windows": [config.get("sliding_window")] * config["num_hidden_layers"],
        }
        if scaling is not None and scaling["rope_type"] in LONGROPE_NAMES:
            original = scaling.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
            if original is None or "short_factor" not in scaling or "long_factor" not in scaling:
                raise MlxcelError(
                    "config.json: longrope scaling needs short_factor, long_factor and original_max_position_embeddings"
                    f" (got rope scaling keys {sorted(scaling)})"
                )
            values.update(longrope={**scaling, "original_max_position_embeddings": original}, rope_scaling=None)
        return super().from_config(config, **{**values, **overrides})


class LongRoPE(nn.Module):
    """Phi-3 "longrope" (older name "su"): per-frequency rescale factors, the short set while a
    row's sequence fits in original_max_position_embeddings and the long set once it does not,
    with the rotated dims multiplied by an attention factor. Each row of a batch uses the set
    its own length picks; `prepare` decides per call, before the layer's rope calls."""

    def __init__(self, dims: int, base: float, scaling: dict, max_position_embeddings: int):
        super().__init__()
        self.dims = dims
        self.original_max = scaling["original_max_position_embeddings"]
        wavelengths = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        self._short = mx.array(scaling["short_factor"], dtype=mx.float32) * wavelengths
        self._long = mx.array(scaling["long_factor"], dtype=mx.float32) * wavelengths
        factor = scaling.get("factor") or max_position_embeddings / self.original_max
        default = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(self.original_max))
        self.attention_factor = scaling.get("attention_factor") or default
        self._long_rows: list[bool] | None = None

    def prepare(self, cache, length: int) -> None:
        if cache.offset is None:  # the compiled decode step: chosen on the device in __call__
            self._long_rows = None
        else:
            self._long_rows = [n + length > self.original_max for n in count_cached_tokens(cache)]

    def _rotate(self, x: mx.array, offset: int | mx.array, freqs: mx.array) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=freqs)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if self.attention_factor != 1.0:
            x = x.at[..., : self.dims].multiply(self.attention_factor)
        rows = self._long_rows
        if rows is not None and (all(rows) or not any(rows)):
            return self._rotate(x, offset, self._long if rows[0] else self._short)
        if rows is None:
            ends = mx.array(offset) + x.shape[2]
            pick = (ends > self.original_max).reshape(-1, 1, 1, 1)
        else:
            pick = mx.array(rows).reshape(-1, 1, 1, 1)
        return mx.where(pick, self._rotate(x, offset, self._long), self._rotate(x, offset, self._short))


def count_cached_tokens(cache) -> list[int]:
    """Real (non-padding) positions cached so far, per row; the left padding is read to the host
    once per cache (a tiny array, already evaluated)."""
    pads = getattr(cache, "host_left_pad", None)
    if pads is None:
        pads = [0] * cache.batch_size if cache.left_pad is None else cache.left_pad.tolist()
        cache.host_left_pad = pads
    return [cache.offset - pad for pad in pads]


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        del self.q_proj, self.k_proj, self.v_proj
        fused = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, fused, bias=False)
        dims = int(self.head_dim * args.partial_rotary_factor)
        if args.longrope is not None:
            self.rope = LongRoPE(dims, args.rope_theta, args.longrope, args.max_position_embeddings)
        else:
            self.rope = RoPE(dims, args.rope_theta, args.rope_traditional, args.rope_scaling)

    def fuse(self) -> None:
        pass  # fused in the checkpoint

    def __call__(self, x: mx.array, mask: Any, cache) -> mx.array:
        if isinstance(self.rope, LongRoPE):
            self.rope.prepare(cache, x.shape[1])
        return super().__call__(x, mask, cache)


class MLP(llama.MLP):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        del self.gate_proj, self.up_proj
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)

    def fuse(self) -> None:
        pass


class Model(SlidingWindowLayers, llama.Model):
    """With longrope, a row whose sequence grows past original_max_position_embeddings switches
    to the long factors for every position, as transformers does by dropping its cache and
    recomputing the sequence. The inputs are kept (on the first layer's cache) until every row
    has switched, and the batch is recomputed when a row crosses; rows that have not crossed
    recompute what they had."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        for layer in self.model.layers:
            layer.self_attn, layer.mlp = Attention(args), MLP(args)
        self.layer_windows = args.layer_windows
        self.longrope_limit = args.longrope["original_max_position_embeddings"] if args.longrope else None
        # a right-padded piece would count its padding toward the switch
        self.supports_padded_prefill = args.longrope is None

    @property
    def supports_compiled_decode(self) -> bool:
        # a compiled step is traced once, but longrope picks its factors on the host at every step
        return self.longrope_limit is None

    def forward_with_embeddings(
        self, embeddings: mx.array, cache: list, mask: Any = None, logits_at: int | None = None
    ) -> mx.array:
        first = cache[0]
        if self.longrope_limit is None or first.offset is None or mask is not None:
            return super().forward_with_embeddings(embeddings, cache, mask, logits_at)
        limit, length, offset = self.longrope_limit, embeddings.shape[1], first.offset
        seen = count_cached_tokens(first)
        pieces = getattr(first, "longrope_inputs", None)  # the inputs so far, while some row is short
        if pieces is not None and any(0 < n <= limit < n + length for n in seen):
            self.reset_caches(cache)
            at = None if logits_at is None else offset + logits_at
            logits = super().forward_with_embeddings(mx.concatenate([*pieces, embeddings], axis=1), cache, None, at)
            logits = logits if at is not None else logits[:, -length:]
        else:
            logits = super().forward_with_embeddings(embeddings, cache, None, logits_at)
        if all(n + length > limit for n in seen):
            first.longrope_inputs = None  # every row is past the switch: nothing left to recompute
        else:
            first.longrope_inputs = [*(pieces or []), embeddings]
        return logits

    def reset_caches(self, cache: list) -> None:
        """Empty each cache in place (the engine holds the list), keeping its padding."""
        fresh = self.make_cache(cache[0].batch_size, cache[0].host_left_pad)
        for old, new in zip(cache, fresh):
            old.__dict__.update(new.__dict__)
