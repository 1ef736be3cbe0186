"""Gemma 3 text (model_type gemma3_text): the Gemma 2 block with an RMSNorm on each query and key
head (in place of attention soft-capping), five sliding-window layers per global one by default,
and two RoPE bases: local (10k) on sliding layers, global (1M, optionally linearly scaled) on
global ones."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx import nn

from mlxcel.models import gemma, gemma2, llama
from mlxcel.models.base import RoPE, read_rope_scaling
from mlxcel.models.rotating_cache import read_layer_windows

REQUIRED_KEYS = llama.REQUIRED_KEYS


def read_rope_bases(config: dict) -> tuple[float, dict | None, float]:
    """(global base, global scaling, local base). transformers 5 writes rope_parameters per layer
    type; older configs write rope_theta, rope_scaling and rope_local_base_freq."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = params["full_attention"], params.get("sliding_attention") or {}
        return full.get("rope_theta", 1e6), read_rope_scaling({"rope_parameters": full}), local.get("rope_theta", 1e4)
    return config.get("rope_theta", 1e6), read_rope_scaling(config), config.get("rope_local_base_freq", 1e4)


@dataclass
class ModelArgs(gemma2.ModelArgs):
    rope_local_theta: float = 10000.0

    @classmethod
    def from_config(cls, config: dict, **overrides) -> ModelArgs:
        n = config["num_hidden_layers"]
        pattern = config.get("sliding_window_pattern", 6)
        default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        global_theta, global_scaling, local_theta = read_rope_bases(config)
        values = {
            "rope_theta": global_theta,
            "rope_scaling": global_scaling,
            "rope_local_theta": local_theta,
            "attn_logit_softcapping": None,  # in Gemma 3 configs but unused: the q/k norms replace it
            "layer_windows": read_layer_windows(config, config.get("sliding_window"), default),
        }
        return super().from_config(config, **{**values, **overrides})


class Attention(gemma2.Attention):
    def __init__(self, args: ModelArgs, window: int | None):
        super().__init__(args)
        self.q_norm = gemma.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = gemma.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        if window is not None:  # local layers: their own base, never scaled
            self.rope = RoPE(self.head_dim, args.rope_local_theta, args.rope_traditional)

    def project_heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = super().project_heads(x)
        return self.q_norm(q), self.k_norm(k), v


class Model(gemma2.Model):
    def make_layers(self, args: ModelArgs) -> list[nn.Module]:
        return [gemma2.TransformerBlock(args, Attention(args, window)) for window in args.layer_windows]
