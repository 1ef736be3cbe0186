"""Gemma 2: Gemma with RMSNorms before and after both the attention and the feed-forward,
tanh soft-capping of attention scores and of the final logits, queries scaled by
query_pre_attn_scalar**-0.5, and sliding-window layers alternating with global ones."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx import nn

from mlxcel.models import gemma, llama
from mlxcel.models.paged_cache import PagedRows
from mlxcel.models.rotating_cache import SlidingWindowLayers, read_layer_windows

REQUIRED_KEYS = llama.REQUIRED_KEYS


@dataclass
class ModelArgs(llama.ModelArgs):
    query_pre_attn_scalar: float | None = None  # None: head_dim
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    layer_windows: list[int | None] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict, **overrides) -> ModelArgs:
        n = config["num_hidden_layers"]
        default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]  # even layers slide
        values = {
            "tie_word_embeddings": config.get("tie_word_embeddings", True),
            "query_pre_attn_scalar": config.get("query_pre_attn_scalar"),
            "attn_logit_softcapping": config.get("attn_logit_softcapping"),
            "final_logit_softcapping": config.get("final_logit_softcapping"),
            "layer_windows": read_layer_windows(config, config.get("sliding_window"), default),
        }
        return super().from_config(config, **{**values, **overrides})


def softcap(x: mx.array, cap: float) -> mx.array:
    return mx.tanh(x / cap) * cap


def expand_mask(mask: Any, length: int, total: int) -> mx.array | None:
    """An attention mask (None, "causal", [L, S] or [B, 1, L|1, S]) as a boolean array broadcastable
    to scores [B, kv_heads, groups, L, S]."""
    if mask is None:
        return None
    if isinstance(mask, str):
        query_pos = mx.arange(total - length, total)
        return mx.arange(total)[None, :] <= query_pos[:, None]
    return mask[:, :, None] if mask.ndim == 4 else mask


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.scale = (args.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.softcap = args.attn_logit_softcapping

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask: Any) -> mx.array:
        """The fused kernel takes no soft-cap: scores by hand, grouped by KV head, softmax in fp32."""
        if isinstance(mask, PagedRows):  # batch-invariant decode: one row at a time, through this method
            return mask.attend(q, k, v, self.scale, dense=self.attend)
        if not self.softcap:
            return super().attend(q, k, v, mask)
        B, n_heads, L, D = q.shape
        groups = n_heads // self.n_kv_heads
        q = q.reshape(B, self.n_kv_heads, groups, L, D)
        scores = softcap((q * self.scale) @ k[:, :, None].swapaxes(-1, -2), self.softcap)
        mask = expand_mask(mask, L, k.shape[2])
        if mask is not None:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        weights = mx.softmax(scores.astype(mx.float32), axis=-1).astype(v.dtype)
        return (weights @ v[:, :, None]).reshape(B, n_heads, L, -1)


class TransformerBlock(llama.TransformerBlock):
    def __init__(self, args: ModelArgs, attention: nn.Module):
        nn.Module.__init__(self)
        self.self_attn = attention
        self.mlp = gemma.MLP(args)
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = gemma.RMSNorm(dim, eps)
        self.post_attention_layernorm = gemma.RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = gemma.RMSNorm(dim, eps)
        self.post_feedforward_layernorm = gemma.RMSNorm(dim, eps)

    def finish_block(self, x: mx.array, attended: mx.array) -> mx.array:
        h = x + self.post_attention_layernorm(attended)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Model(SlidingWindowLayers, gemma.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.layer_windows = args.layer_windows

    def make_layers(self, args: ModelArgs) -> list[nn.Module]:
        return [TransformerBlock(args, Attention(args)) for _ in range(args.num_hidden_layers)]

    def compute_logits(self, h: mx.array) -> mx.array:
        logits = super().compute_logits(h)
        cap = self.args.final_logit_softcapping
        return softcap(logits, cap) if cap else logits
