"""SmolLM3 (smollm3): the Llama architecture with no positional encoding (NoPE) in some layers:
`no_rope_layers[i]` is 1 where layer i rotates its queries and keys, 0 where it does not; by
default every `no_rope_layer_interval`-th layer (4: layers 3, 7, 11, ...) goes without.
Sliding-window layers where `layer_types` says so (none in the released 3B)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxcel.errors import MlxcelError
from mlxcel.models import llama
from mlxcel.models.base import NoRoPE
from mlxcel.models.rotating_cache import SlidingWindowLayers, read_layer_windows

REQUIRED_KEYS = llama.REQUIRED_KEYS


def read_rope_layers(config: dict) -> list[bool]:
    """Which layers apply RoPE (transformers' SmolLM3Config: no_rope_layers, else the interval)."""
    n = config["num_hidden_layers"]
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = config.get("no_rope_layer_interval", 4)
        return [(i + 1) % interval != 0 for i in range(n)]
    if len(flags) != n:
        raise MlxcelError(f"config.json: no_rope_layers has {len(flags)} entries for num_hidden_layers={n}")
    return [bool(flag) for flag in flags]


@dataclass
class ModelArgs(llama.ModelArgs):
    rope_layers: list[bool] = field(default_factory=list)
    layer_windows: list[int | None] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict, **overrides) -> ModelArgs:
        rope_layers = read_rope_layers(config)
        window = config.get("sliding_window") if config.get("use_sliding_window") else None
        # transformers' default layer_types: the NoPE layers slide, where sliding is on
        default = ["full_attention" if rope or window is None else "sliding_attention" for rope in rope_layers]
        values = {
            "tie_word_embeddings": config.get("tie_word_embeddings", True),
            "rope_layers": rope_layers,
            "layer_windows": read_layer_windows(config, config.get("sliding_window"), default),
        }
        return super().from_config(config, **{**values, **overrides})


class Model(SlidingWindowLayers, llama.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layer_windows = args.layer_windows
        for layer, rope in zip(self.model.layers, args.rope_layers):
            if not rope:
                layer.self_attn.rope = NoRoPE()
