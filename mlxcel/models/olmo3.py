"""OLMo 3 (olmo3): OLMo 2's block (norms after the sublayers, whole-width QK norm) with
sliding-window layers, three in four by default (`layer_types`, `sliding_window`: 4096 in the
released models), and RoPE per kind of layer: the full-attention layers' may be YaRN-scaled
(the 7B and 32B: factor 8 over 8192 positions), the sliding layers' never is.

Configs come two ways: transformers 5 writes `rope_parameters` per layer type; the released
config.json files (transformers 4.57) write `rope_theta` and a `rope_scaling` that only the
full-attention layers take (as transformers, mlx-lm and vLLM read it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx

from mlxcel.errors import MlxcelError
from mlxcel.models import llama, olmo2
from mlxcel.models.base import RoPE, read_rope_scaling, read_rope_theta
from mlxcel.models.rotating_cache import SlidingWindowLayers, read_layer_windows

REQUIRED_KEYS = llama.REQUIRED_KEYS
DEFAULT_THETA = 500_000.0  # transformers' Olmo3Config default
DEFAULT_WINDOW = 4096


def read_layer_type_ropes(config: dict) -> dict[str, dict]:
    """{"full_attention": params, "sliding_attention": params}, each with rope_theta and rope_type."""
    nested = config.get("rope_parameters") or {}
    theta = read_rope_theta(config, DEFAULT_THETA)
    if "full_attention" in nested or "sliding_attention" in nested:
        ropes = {kind: dict(nested.get(kind) or {}) for kind in ("full_attention", "sliding_attention")}
    else:  # one theta for both kinds; the scaling for full-attention layers only
        ropes = {"full_attention": dict(read_rope_scaling(config) or {}), "sliding_attention": {}}
    for params in ropes.values():
        params.setdefault("rope_theta", theta)
        params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return ropes


@dataclass
class ModelArgs(llama.ModelArgs):
    layer_types: list[str] = field(default_factory=list)
    layer_windows: list[int | None] = field(default_factory=list)
    layer_type_ropes: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: dict, **overrides) -> ModelArgs:
        n = config["num_hidden_layers"]
        default = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)]
        values = {
            "rope_scaling": None,  # per layer type: layer_type_ropes
            "layer_types": config.get("layer_types") or default,
            "layer_windows": read_layer_windows(config, config.get("sliding_window", DEFAULT_WINDOW), default),
            "layer_type_ropes": read_layer_type_ropes(config),
        }
        return super().from_config(config, **{**values, **overrides})


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def make_yarn_freqs(dims: int, scaling: dict, max_position_embeddings: int) -> tuple[mx.array, float]:
    """YaRN (transformers' `_compute_yarn_parameters`): per-pair wavelengths for
    `mx.fast.rope(freqs=...)`, interpolated by `factor` below the correction range, kept above
    it, ramped between; and the attention factor that scales cos and sin."""
    base = scaling["rope_theta"]
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # 1: the pair keeps its frequency; 0: divided by factor
    pos_freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return 1.0 / inv_freq, float(attention_factor)


class YarnRoPE(RoPE):
    """RoPE with YaRN's frequencies; queries and keys scaled by the attention factor (as
    transformers scales cos and sin: the rotation is linear, so before it is the same)."""

    def __init__(self, dims: int, scaling: dict, traditional: bool, max_position_embeddings: int):
        super().__init__(dims, scaling["rope_theta"], traditional)
        self._freqs, self.attention_factor = make_yarn_freqs(dims, scaling, max_position_embeddings)
        self.base = None

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if self.attention_factor != 1.0:
            x = x * mx.array(self.attention_factor, dtype=x.dtype)
        return super().__call__(x, offset)


def make_rope(dims: int, params: dict, traditional: bool, max_position_embeddings: int) -> RoPE:
    kind = params["rope_type"]
    if kind == "yarn":
        return YarnRoPE(dims, params, traditional, max_position_embeddings)
    if kind not in ("default", "linear", "llama3"):
        raise MlxcelError(f"config.json: OLMo 3 rope_type {kind!r} is not supported (supported: default, yarn, linear)")
    return RoPE(dims, params["rope_theta"], traditional, None if kind == "default" else params)


class Model(SlidingWindowLayers, olmo2.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layer_windows = args.layer_windows

    def make_attention(self, args: ModelArgs, layer: int) -> olmo2.Attention:
        attention = olmo2.Attention(args)
        kind = "sliding_attention" if args.layer_types[layer] == "sliding_attention" else "full_attention"
        params = args.layer_type_ropes[kind]
        attention.rope = make_rope(attention.head_dim, params, args.rope_traditional, args.max_position_embeddings)
        return attention
