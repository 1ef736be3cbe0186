"""Llama family (Llama 1/2/3.x, SmolLM2, and the base Qwen2 builds on)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxcel.models.base import (
    RoPE,
    apply_linear,
    fuse_linears,
    read_rope_scaling,
    read_rope_theta,
    swiglu,
)
from mlxcel.models.cache import KVCache, make_attention_mask, make_kv_caches
from mlxcel.models.cpu_attention import attention
from mlxcel.models.paged_cache import PagedMask

REQUIRED_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)


@dataclass
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_traditional: bool = False  # True for GGUF files: llama.cpp permutes Q/K for interleaved RoPE
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool | None = None  # None: same as attention_bias
    mlp_bias: bool = False
    max_position_embeddings: int = 4096
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        if self.o_proj_bias is None:
            self.o_proj_bias = self.attention_bias
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict, **overrides: Any) -> ModelArgs:
        """Read leniently: unknown keys are ignored, missing optional ones take defaults."""
        eos = config.get("eos_token_id")
        values = dict(
            model_type=config.get("model_type", "llama"),
            hidden_size=config["hidden_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            num_key_value_heads=config.get("num_key_value_heads"),
            head_dim=config.get("head_dim"),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=read_rope_theta(config),
            rope_scaling=read_rope_scaling(config),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=config.get("attention_bias", False),
            mlp_bias=config.get("mlp_bias", False),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
        )
        values.update(overrides)
        return cls(**values)


def to_heads(x: mx.array, n_heads: int) -> mx.array:
    """[B, L, heads * D] -> [B, heads, L, D]. One token needs no transpose: the same memory read
    in the other order, so a decode step carries one view op per tensor instead of two (each op,
    even a view, costs host time in a step that is host-bound on a GPU)."""
    B, L, _ = x.shape
    if L == 1:
        return x.reshape(B, n_heads, 1, -1)
    return x.reshape(B, L, n_heads, -1).transpose(0, 2, 1, 3)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        dim, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=args.o_proj_bias)
        self.rope = RoPE(self.head_dim, args.rope_theta, args.rope_traditional, args.rope_scaling)

    def fuse(self) -> None:
        """Q, K and V as one matmul (after the weights are loaded under their own names)."""
        fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if fused is not None:
            self.qkv_proj = fused
            del self.q_proj, self.k_proj, self.v_proj

    def project_qkv(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        if "qkv_proj" not in self:
            return apply_linear(self.q_proj, x), apply_linear(self.k_proj, x), apply_linear(self.v_proj, x)
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = mx.split(apply_linear(self.qkv_proj, x), [q_size, q_size + kv_size], axis=-1)
        if x.shape[1] > 1:
            # V goes into the cache as a view of the fused output, which kept every layer's whole
            # QKV buffer alive to the end of a prefill (+0.36 GB at batch 8 x 512 on SmolLM2,
            # 0.83 vs 0.47 GB above the weights); a copy frees it at once. Decode skips it.
            v = mx.contiguous(v)
        return q, k, v

    def project_heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Q, K, V as [B, heads, L, head_dim] (families with q/k norms extend this)."""
        q, k, v = self.project_qkv(x)
        return to_heads(q, self.n_heads), to_heads(k, self.n_kv_heads), to_heads(v, self.n_kv_heads)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, mask: Any) -> mx.array:
        # attention sinks (gpt-oss): a learned per-head logit in every query's softmax, where a family sets them
        sinks = self.sinks if "sinks" in self else None
        if isinstance(mask, PagedMask):  # the paged cache's own attention (paged_cache.py)
            return mask.attend(q, k, v, self.scale) if sinks is None else mask.attend(q, k, v, self.scale, sinks=sinks)
        return attention(q, k, v, self.scale, mask=mask, sinks=sinks)

    def prepare(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Q and K rotated to their positions, and V: what goes into the cache and the kernel."""
        q, k, v = self.project_heads(x)
        return self.rope(q, offset), self.rope(k, offset), v

    def finish(self, out: mx.array) -> mx.array:
        """The attention output [B, heads, L, head_dim] back to the residual stream."""
        B, _, L, _ = out.shape
        if L > 1:  # one token: [B, heads, 1, D] is already [B, 1, heads * D] in memory
            out = out.transpose(0, 2, 1, 3)
        return apply_linear(self.o_proj, out.reshape(B, L, -1))

    def __call__(self, x: mx.array, mask: Any, cache: KVCache) -> mx.array:
        if isinstance(mask, PagedMask) and mask.packed:  # decode rows and pieces in one line (paged_packed.py)
            return mask.run(self, x, cache)
        q, k, v = self.prepare(x, cache.rope_offset())
        k, v = cache.update_and_fetch(k, v)
        return self.finish(self.attend(q, k, v, mask))


def logit_positions(logits_at: int | mx.array) -> slice | mx.array:
    """The sequence index of `logits_at`: one position (kept as an axis) or an array of them."""
    return logits_at if isinstance(logits_at, mx.array) else slice(logits_at, logits_at + 1)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hidden, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def fuse(self) -> None:
        fused = fuse_linears([self.gate_proj, self.up_proj])
        if fused is not None:
            self.gate_up_proj = fused
            del self.gate_proj, self.up_proj

    def project_gate_up(self, x: mx.array) -> tuple[mx.array, mx.array]:
        if "gate_up_proj" in self:
            return tuple(mx.split(self.gate_up_proj(x), 2, axis=-1))
        return self.gate_proj(x), self.up_proj(x)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(*self.project_gate_up(x)))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Any, cache: KVCache) -> mx.array:
        return self.finish_block(x, self.self_attn(self.input_layernorm(x), mask, cache))

    def finish_block(self, x: mx.array, attended: mx.array) -> mx.array:
        """Everything after attention: residuals, norms, the MLP (families differ here)."""
        h = x + attended
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(nn.Module):
    supports_multi_piece_prefill = True
    supports_padded_prefill = True

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(
        self, input_ids: mx.array, cache: list[KVCache], mask: Any = None, logits_at: int | None = None
    ) -> mx.array:
        return self.forward_with_embeddings(self.embed_tokens(input_ids), cache, mask, logits_at)

    def embed_tokens(self, input_ids: mx.array) -> mx.array:
        return self.model.embed_tokens(input_ids)

    def forward_with_embeddings(
        self, embeddings: mx.array, cache: list[KVCache], mask: Any = None, logits_at: int | mx.array | None = None
    ) -> mx.array:
        """Logits [B, L, V]; with `logits_at`, only that position's ([B, 1, V]), or those positions'
        ([B, n, V]: an int32 array, a packed call's rows): a prefill needs one row of the
        vocabulary head, not one per prompt token (a quarter of a 0.5B model's FLOPs)."""
        h = embeddings
        masks = self.make_masks(h.shape[1], cache) if mask is None else [mask] * len(cache)
        *layers, last = self.model.layers
        for layer, layer_cache, layer_mask in zip(layers, cache, masks):
            h = layer(h, layer_mask, layer_cache)
        if logits_at is None or type(last).__call__ is not TransformerBlock.__call__:
            h = last(h, masks[-1], cache[len(layers)])
            return self.compute_logits(self.model.norm(h if logits_at is None else h[:, logit_positions(logits_at)]))
        # the last layer writes every position's keys and values, but its MLP runs only where the
        # logits are asked for: nothing reads its other positions (1/layers of a prefill's MLP work)
        attended = last.self_attn(last.input_layernorm(h), masks[-1], cache[len(layers)])
        at = logit_positions(logits_at)
        return self.compute_logits(self.model.norm(last.finish_block(h[:, at], attended[:, at])))

    def make_masks(self, length: int, cache: list[KVCache]) -> list:
        """One mask per layer; every layer here sees the same one (sliding-window families differ)."""
        return [make_attention_mask(length, cache[0])] * len(cache)

    def compute_logits(self, h: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def eos_token_ids(self) -> list[int]:
        return list(self.args.eos_token_ids)

    def after_prefill(self) -> None:
        pass

    def make_cache(self, batch_size: int = 1, left_pad: list[int] | None = None) -> list[KVCache]:
        return make_kv_caches(len(self.model.layers), batch_size, left_pad)

    def fuse_projections(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        # Rotary tables are recomputed; tied checkpoints may still carry an lm_head copy.
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights
