"""GLM-4 dense (`glm4`: GLM-4-9B-0414, GLM-4-32B-0414): the Llama block with four differences.

- RoPE turns only the first `partial_rotary_factor` (0.5) of each head, and in the interleaved
  layout: pairs of adjacent features (x0, x1), (x2, x3), ... (transformers' glm4 rotate_half takes
  the even and odd features; MLX's traditional rope), the rest of the head passes unrotated.
- Two more norms: attention's output passes post_self_attn_layernorm before its residual, the
  MLP's output post_mlp_layernorm before its own.
- The MLP's gate and up are one matrix, `gate_up_proj` [2I, H] (gate first), in the checkpoints
  and in mlx-lm's folders alike.
- Q, K and V have biases (attention_bias, on by default), o_proj none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxcel.models import llama
from mlxcel.models.base import RoPE

REQUIRED_KEYS = llama.REQUIRED_KEYS
# transformers' Glm4Config defaults, where a config.json leaves a key out
DEFAULT_EOS = [151329, 151336, 151338]


def read_partial_rotary_factor(config: dict, default: float = 0.5) -> float:
    """The rotated share of a head: rope_parameters' (transformers 5) or config.json's own key;
    transformers defaults GLM's to 0.5."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", default)))


@dataclass
class ModelArgs(llama.ModelArgs):
    partial_rotary_factor: float = 0.5

    @classmethod
    def from_config(cls, config: dict, **overrides: Any) -> ModelArgs:
        eos = config.get("eos_token_id", DEFAULT_EOS)
        values = {
            "partial_rotary_factor": read_partial_rotary_factor(config),
            "rope_traditional": True,  # interleaved pairs (GGUF files keep the layout: no permutation)
            "head_dim": config.get("head_dim", 128),
            "attention_bias": config.get("attention_bias", True),
            "o_proj_bias": False,
            "rms_norm_eps": config.get("rms_norm_eps", 1.5625e-07),
            "eos_token_ids": [eos] if isinstance(eos, int) else list(eos or []),
        }
        return super().from_config(config, **{**values, **overrides})


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        dims = int(self.head_dim * args.partial_rotary_factor)
        self.rope = RoPE(dims, args.rope_theta, args.rope_traditional, args.rope_scaling)


class MLP(llama.MLP):
    """SwiGLU with gate and up stored as one matrix (already fused: `fuse` has nothing to do)."""

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        dim, hidden = args.hidden_size, args.intermediate_size
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=args.mlp_bias)
        self.down_proj = nn.Linear(hidden, dim, bias=args.mlp_bias)

    def fuse(self) -> None:
        pass


class TransformerBlock(llama.TransformerBlock):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.post_self_attn_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_mlp_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def finish_block(self, x: mx.array, attended: mx.array) -> mx.array:
        h = x + self.post_self_attn_layernorm(attended)
        return h + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(h)))


class Model(llama.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.model.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
