"""The LanguageModel protocol every family implements, and pieces families share."""

from __future__ import annotations

import math
import platform
import sys
from functools import partial
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import mlx.nn as nn

from mlxcel.models.adapters import fuse_adapters, unadapted_type
from mlxcel.models.cache import KVCache


@runtime_checkable
class LanguageModel(Protocol):
    model_type: str
    supports_multi_piece_prefill: bool  # prompt may be prefilled in several pieces
    supports_padded_prefill: bool  # a piece may be right-padded and the padding trimmed from the cache

    # logits_at: compute the vocabulary head at that position only (prefill needs one row)
    def __call__(
        self, input_ids: mx.array, cache: list[KVCache], mask: Any = None, logits_at: int | None = None
    ) -> mx.array: ...
    def embed_tokens(self, input_ids: mx.array) -> mx.array: ...
    def forward_with_embeddings(
        self, embeddings: mx.array, cache: list[KVCache], mask: Any = None, logits_at: int | None = None
    ) -> mx.array: ...
    def eos_token_ids(self) -> list[int]: ...
    def after_prefill(self) -> None: ...
    def make_cache(self, batch_size: int = 1, left_pad: list[int] | None = None) -> list[KVCache]: ...


def read_rope_theta(config: dict, default: float = 10000.0) -> float:
    """transformers < 5 writes `rope_theta`; transformers 5 writes only `rope_parameters`."""
    if "rope_theta" in config:
        return float(config["rope_theta"])
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", default))


def read_rope_scaling(config: dict) -> dict | None:
    scaling = config.get("rope_scaling") or config.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return None if kind == "default" else dict(scaling, rope_type=kind)


def make_llama3_rope_freqs(dims: int, base: float, scaling: dict) -> mx.array:
    """Llama 3.x frequency rescaling (transformers' `_compute_llama3_parameters`), as
    wavelengths for `mx.fast.rope(freqs=...)`."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)  # wavelengths / 2pi
    wavelens = 2 * math.pi * freqs
    freqs = mx.where(wavelens > low_freq_wavelen, freqs * factor, freqs)
    is_medium = (wavelens > high_freq_wavelen) & (wavelens < low_freq_wavelen)
    smooth = (old_context / wavelens - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = freqs / ((1 - smooth) / factor + smooth)
    return mx.where(is_medium, smoothed, freqs)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def make_yarn_rope_freqs(
    dims: int, base: float, scaling: dict, max_position_embeddings: int | None = None
) -> tuple[mx.array, float]:
    """YaRN (transformers' `_compute_yarn_parameters`): (wavelengths for `mx.fast.rope(freqs=...)`,
    the attention factor the rotated dimensions are scaled by). Dimensions that turn fast keep
    their frequency, slow ones are interpolated by `factor`, with a linear ramp between."""
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    factor = scaling.get("factor") or (max_position_embeddings / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention = yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # (as transformers: no singular ramp)
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    wavelengths = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)  # 1 / inverse frequency
    extrapolated = 1 - ramp  # share of each dimension's own frequency
    inverse = (1 / (factor * wavelengths)) * (1 - extrapolated) + (1 / wavelengths) * extrapolated
    return 1 / inverse, float(attention)


class RoPE(nn.Module):
    """Rotary embedding that accepts per-row offsets (left-padded batches). `scaling`: the config's
    rope scaling (read_rope_scaling): linear, llama3 or yarn; yarn needs the config's
    max_position_embeddings where the scaling lacks original_max_position_embeddings."""

    def __init__(
        self,
        dims: int,
        base: float,
        traditional: bool = False,
        scaling: dict | None = None,
        max_position_embeddings: int | None = None,
    ):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self.base: float | None = base
        self.scale = 1.0  # positions are multiplied by it (linear scaling: 1 / factor)
        self.attention_factor = 1.0  # the rotated dimensions are multiplied by it (yarn)
        self._freqs = None
        if scaling is not None:
            kind = scaling["rope_type"]
            if kind == "llama3":
                self._freqs = make_llama3_rope_freqs(dims, base, scaling)
                self.base = None
            elif kind == "linear":
                self.scale = 1.0 / scaling["factor"]
            elif kind == "yarn":
                self._freqs, self.attention_factor = make_yarn_rope_freqs(dims, base, scaling, max_position_embeddings)
                self.base = None
            else:
                from mlxcel.errors import MlxcelError

                raise MlxcelError(
                    f"rope scaling type {kind!r} is not supported yet (supported: default, linear, llama3, yarn)"
                )

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if self.attention_factor != 1.0:  # (transformers scales cos and sin: the rotated part only)
            factor = mx.array(self.attention_factor, dtype=x.dtype)
            if self.dims == x.shape[-1]:
                x = x * factor
            else:
                x = mx.concatenate([x[..., : self.dims] * factor, x[..., self.dims :]], axis=-1)
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=offset,
            freqs=self._freqs,
        )


class NoRoPE(nn.Module):
    """A NoPE layer's queries and keys go into attention (and the cache) unrotated (SmolLM3, Llama 4)."""

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return x


# On CUDA a biased matmul goes to cuBLASLt, captured into a child graph (tens of microseconds of
# host time per call), while an unbiased one-row matmul gets MLX's own gemv kernel; for a
# batch-1 decode step, gemv + add is the cheaper pair. Metal and the CPU keep the fused op.
SPLIT_ONE_ROW_BIAS = hasattr(mx, "cuda") and mx.cuda.is_available()


def apply_linear(layer: nn.Module, x: mx.array) -> mx.array:
    if SPLIT_ONE_ROW_BIAS and type(layer) is nn.Linear and "bias" in layer and x.size == x.shape[-1]:
        return (x @ layer.weight.T) + layer.bias
    return layer(x)


@partial(mx.compile, shapeless=True)
def fused_swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up. On a GPU as one compiled kernel instead of three (per-op cost bounds a
    small model's decode there); on the CPU MLX would compile it with the system's C++ compiler,
    which a slim machine may lack. On an x86-64 Linux CPU, large float32 inputs (prefill) take
    rational_silu: MLX's CPU sigmoid is a scalar libm exp there (its SIMD paths are ARM's), ~16 ns
    an element, which made silu cost more than the gate/up matmul before it."""
    if mx.default_device() == mx.gpu:
        return fused_swiglu(gate, up)
    if SCALAR_CPU_EXP and gate.dtype == mx.float32 and gate.size >= RATIONAL_SILU_MIN:
        return rational_silu(gate) * up
    return nn.silu(gate) * up


# x86-64 Linux: MLX's CPU transcendentals run one libm call an element (2-core VM, SmolLM2's
# [136, 1536] gate: silu * up 3.3 ms, rational_silu * up 0.74 ms eagerly; the gate/up matmul 2.7 ms)
SCALAR_CPU_EXP = sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64")
# elements: below it its dozen ops cost more than the exps they save (same VM, silu / rational ms:
# 1,536 0.032 / 0.089, 8 decode rows' 12,288 0.159 / 0.219, 49,152 0.795 / 0.258)
RATIONAL_SILU_MIN = 1 << 15
# tanh(x) = x P(x^2) / Q(x^2) on [-9, 9] (Eigen's float tanh; |tanh| rounds to 1 past 9)
TANH_P = (4.89352455891786e-03, 6.37261928875436e-04, 1.48572235717979e-05, 5.12229709037114e-08,
          -8.60467152213735e-11, 2.00018790482477e-13, -2.76076847742355e-16)  # fmt: skip
TANH_Q = (4.89352518554385e-03, 2.26843463243900e-03, 1.18534705686654e-04, 1.19825839466702e-06)


def rational_silu(x: mx.array) -> mx.array:
    """x * sigmoid(x), with sigmoid(x) = (1 + tanh(x / 2)) / 2 and tanh a rational function:
    multiplies and adds that MLX's CPU kernels vectorize. Within 4e-6 of silu everywhere (float32:
    silu's own rounding is 1.4e-6); it loses relative precision only where silu is below ~1e-5."""
    half = mx.clip(0.5 * x, -9.0, 9.0)
    square = half * half
    p = square * TANH_P[6] + TANH_P[5]
    for c in TANH_P[4::-1]:
        p = p * square + c
    q = square * TANH_Q[3] + TANH_Q[2]
    for c in TANH_Q[1::-1]:
        q = q * square + c
    return x * (0.5 + 0.5 * (half * p / q))


def fuse_linears(layers: list[nn.Module]) -> nn.Module | None:
    """One layer computing several projections of the same input (QKV, gate/up): fewer, larger
    matmuls per token. Concatenates along the output dimension; None when the layers cannot be
    fused (mixed quantization, mixed bias). LoRA adapters kept beside the weights (models/adapters.py)
    follow into the fused layer."""
    first = layers[0]
    if any(unadapted_type(layer) is not unadapted_type(first) for layer in layers):
        return None
    has_bias = ["bias" in layer for layer in layers]
    if any(has_bias) and not all(has_bias):
        return None
    if isinstance(first, nn.QuantizedLinear):
        if any(
            (layer.bits, layer.group_size, getattr(layer, "mode", None))
            != (first.bits, first.group_size, getattr(first, "mode", None))
            for layer in layers
        ):
            return None
        fused = nn.QuantizedLinear.__new__(nn.QuantizedLinear)
        nn.Module.__init__(fused)
        fused.group_size, fused.bits = first.group_size, first.bits
        if hasattr(first, "mode"):
            fused.mode = first.mode
        for name in ("weight", "scales", "biases"):
            if name in first:
                setattr(fused, name, mx.concatenate([layer[name] for layer in layers], axis=0))
        fused.freeze()
    elif isinstance(first, nn.Linear):
        fused = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(fused)
        fused.weight = mx.concatenate([layer.weight for layer in layers], axis=0)
    else:
        return None
    if all(has_bias):
        fused.bias = mx.concatenate([layer.bias for layer in layers], axis=0)
    return fuse_adapters(fused, layers)
