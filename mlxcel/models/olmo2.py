"""OLMo 2 (olmo2): the Llama architecture with its norms moved after the sublayers (an RMSNorm on
the attention's output and one on the MLP's, each before its residual add; none before them) and
an RMSNorm on the queries and on the keys over the whole projection width (all heads together,
not per head as Qwen 3's), before RoPE."""

from __future__ import annotations

import mlx.core as mx
from mlx import nn

from mlxcel.models import llama
from mlxcel.models.llama import to_heads

REQUIRED_KEYS = llama.REQUIRED_KEYS
ModelArgs = llama.ModelArgs


class Attention(llama.Attention):
    def __init__(self, args: llama.ModelArgs):
        super().__init__(args)
        self.q_norm = nn.RMSNorm(self.n_heads * self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.n_kv_heads * self.head_dim, eps=args.rms_norm_eps)

    def project_heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = self.project_qkv(x)  # the norms see every head at once: before the split into heads
        q, k = self.q_norm(q), self.k_norm(k)
        return to_heads(q, self.n_heads), to_heads(k, self.n_kv_heads), to_heads(v, self.n_kv_heads)


class TransformerBlock(llama.TransformerBlock):
    def __init__(self, args: llama.ModelArgs, attention: nn.Module):
        nn.Module.__init__(self)
        self.self_attn = attention
        self.mlp = llama.MLP(args)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_feedforward_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def input_layernorm(self, x: mx.array) -> mx.array:
        """Attention reads the residual stream as it is (the segmented decoder calls this too)."""
        return x

    def finish_block(self, x: mx.array, attended: mx.array) -> mx.array:
        h = x + self.post_attention_layernorm(attended)
        return h + self.post_feedforward_layernorm(self.mlp(h))


class Model(llama.Model):
    def __init__(self, args: llama.ModelArgs):
        super().__init__(args)
        self.model.layers = [
            TransformerBlock(args, self.make_attention(args, i)) for i in range(args.num_hidden_layers)
        ]

    def make_attention(self, args: llama.ModelArgs, layer: int) -> Attention:
        return Attention(args)
