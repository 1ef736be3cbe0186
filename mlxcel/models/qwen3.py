"""Qwen3 (dense): the Llama architecture with an RMSNorm on each query and key head before RoPE,
no Q/K/V bias, and an explicit head_dim."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx import nn

from mlxcel.models import llama
from mlxcel.models.rotating_cache import SlidingWindowLayers, read_layer_windows

REQUIRED_KEYS = llama.REQUIRED_KEYS


@dataclass
class ModelArgs(llama.ModelArgs):
    layer_windows: list[int | None] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict, **overrides) -> ModelArgs:
        # use_sliding_window is off in every released Qwen3; when on, layers from max_window_layers slide
        window = config.get("sliding_window") if config.get("use_sliding_window") else None
        first_sliding = config.get("max_window_layers", config["num_hidden_layers"])
        default = [
            "sliding_attention" if i >= first_sliding else "full_attention" for i in range(config["num_hidden_layers"])
        ]
        windows = read_layer_windows(config, window, default)
        return super().from_config(config, **{"layer_windows": windows, **overrides})


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)

    def project_heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = super().project_heads(x)
        return self.q_norm(q), self.k_norm(k), v


class Model(SlidingWindowLayers, llama.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        for layer in self.model.layers:
            layer.self_attn = Attention(args)
        self.layer_windows = args.layer_windows
