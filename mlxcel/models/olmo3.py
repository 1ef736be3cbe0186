"""OLMo 3 (olmo3): OLMo 2's block (norms after the sublayers, whole-width QK norm) with
sliding-window layers, three in four by default (`layer_types`, `sliding_window`: 4096 in the
released models), and RoPE per kind of layer: the full-attention layers' may be YaRN-scaled
(the 7B and 32B: factor 8 over 8192 positions), the sliding layers' never is.

Configs come two ways: transformers 5 writes `rope_parameters` per layer type; the released
config.json files (transformers 4.57) write `rope_theta` and a `rope_scaling` that only the
full-attention layers take (as transformers, mlx-lm and vLLM read it). YaRN is base.RoPE's."""

from __future__ import annotations

from dataclasses import dataclass, field

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


def make_rope(dims: int, params: dict, traditional: bool, max_position_embeddings: int) -> RoPE:
    """One layer type's RoPE: its theta, and its scaling (YaRN on the released full-attention layers)."""
    scaling = None if params["rope_type"] == "default" else params
    return RoPE(dims, params["rope_theta"], traditional, scaling, max_position_embeddings)


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
