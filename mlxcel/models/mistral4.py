"""Mistral 4 (`mistral4`: Mistral-Small-4's language model), transformers' Mistral4ForCausalLM: DeepSeek V3's
layout with its own routing and query scale.

- multi-head latent attention (models/mla.py: the cache keeps each position's latent and shared RoPE key),
  RoPE on interleaved pairs (`rope_interleave`, default true) over the qk_rope_head_dim dimensions, YaRN as
  rope_parameters sets it, the softmax scale times mscale(factor, mscale_all_dim)^2;
- Llama 4's position-dependent query scale (`rope_parameters.llama_4_scaling_beta`): every query, its
  no-RoPE and RoPE parts alike, times 1 + beta * log(1 + floor(p / original_max_position_embeddings)) at
  position p (1 below the original context: 8192 positions in the released config);
- the first `first_k_dense_replace` layers dense (SwiGLU of intermediate_size), the rest a mixture of
  experts: a softmax router over every expert that keeps the best topk_group of n_group groups (a group
  scored by its two best, the others' scores zeroed), takes the top k, weights them by their softmax scores
  (normalised when norm_topk_prob, the default), times routed_scaling_factor; SwiGLU experts of
  moe_intermediate_size, plus n_shared_experts' worth of shared expert every token runs.

Weights: transformers' stacked experts (experts.gate_up_proj [E, 2I, H], experts.down_proj), what
save_pretrained writes, and mlx-lm's names (switch_mlp.*, embed_q / unembed_out: its converted and quantized
folders). A config.json without rope_parameters takes Mistral4Config's (YaRN factor 128 over 8192 positions,
llama_4_scaling_beta 0.1), as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxcel.errors import MlxcelError
from mlxcel.models import deepseek_v3
from mlxcel.models.mla import MultiHeadLatentAttention
from mlxcel.models.switch import pick_experts

REQUIRED_KEYS = deepseek_v3.REQUIRED_KEYS
# transformers' Mistral4Config defaults for the keys read here, where config.json is silent
CONFIG_DEFAULTS = {
    "n_shared_experts": 1,
    "n_routed_experts": 128,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 2048,
    "routed_scaling_factor": 1.0,
    "q_lora_rank": 1024,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 0,
    "norm_topk_prob": True,
    "rope_interleave": True,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1048576,
}
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 128.0,
    "original_max_position_embeddings": 8192,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}


@dataclass
class ModelArgs(deepseek_v3.ModelArgs):
    llama_4_scaling_beta: float = 0.0  # 0: no query scale
    llama_4_scaling_length: int = 8192  # original_max_position_embeddings: the scale's step

    @classmethod
    def from_config(cls, config: dict, **overrides: Any) -> ModelArgs:
        config = {**CONFIG_DEFAULTS, **config}
        if not (config.get("rope_parameters") or config.get("rope_scaling")):
            config["rope_parameters"] = dict(DEFAULT_ROPE)
        rope = config.get("rope_parameters") or config.get("rope_scaling")
        beta = float(rope.get("llama_4_scaling_beta") or 0.0)
        length = rope.get("original_max_position_embeddings")
        if beta and not (isinstance(length, int) and length > 0):
            raise MlxcelError(
                f"config.json: rope_parameters.llama_4_scaling_beta={beta} scales queries by position in steps of "
                f"rope_parameters.original_max_position_embeddings, which is {length!r}; set it to a positive "
                "integer (8192 in the released Mistral 4 config)"
            )
        values = {
            "topk_method": "mistral4",
            "llama_4_scaling_beta": beta,
            "llama_4_scaling_length": int(length or 8192),
            "norm_topk_prob": bool(config["norm_topk_prob"]),
        }
        # (deepseek_v3 reads model_type deepseek_v2 as V2; anything else, this one too, with V3's keys)
        return super().from_config(config, **{**values, **overrides})


class Attention(MultiHeadLatentAttention):
    """MLA with Llama 4's query scale by position (mla.py's `queries` hook)."""

    @classmethod
    def from_args(cls, args: ModelArgs) -> Attention:
        attention = super().from_args(args)
        attention.query_scaling = (args.llama_4_scaling_beta, args.llama_4_scaling_length)
        return attention

    def queries(self, q: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array]:
        q_nope, q_pe = super().queries(q, offset)
        beta, length = self.query_scaling
        if not beta:
            return q_nope, q_pe
        scales = query_scales(offset, q.shape[1], beta, length)
        return (q_nope * scales).astype(q_nope.dtype), (q_pe * scales).astype(q_pe.dtype)


def query_scales(offset: int | mx.array, length: int, beta: float, step: int) -> mx.array:
    """[B or 1, 1, L, 1]: transformers' get_llama_4_attn_scale at each query's position (a left-padded
    row's padding counted at 0)."""
    start = offset[..., None] if isinstance(offset, mx.array) else offset
    positions = mx.maximum(mx.arange(length) + start, 0).astype(mx.float32)
    return (1 + beta * mx.log1p(mx.floor(positions / step))).reshape(-1, 1, length, 1)


class Router:
    """transformers' Mistral4TopkRouter on the gate's logits, in float32: softmax over every expert; with
    groups, the best topk_group of n_group (a group scored by the sum of its two best) kept and the rest
    zeroed for the choice; the top k's softmax scores as weights, normalised when norm_topk_prob, times the
    scale. (The gate itself is a Linear: mlx-lm quantizes it in its folders.)"""

    def __init__(self, args: ModelArgs):
        experts, top_k, groups = args.n_routed_experts, args.num_experts_per_tok, args.n_group
        if not 1 <= top_k <= experts or experts % groups or not 1 <= args.topk_group <= groups:
            raise MlxcelError(
                f"config.json: num_experts_per_tok={top_k} must be between 1 and n_routed_experts ({experts}), "
                f"n_routed_experts a multiple of n_group ({groups}) and topk_group ({args.topk_group}) between 1 "
                "and n_group"
            )
        self.top_k, self.normalize, self.scale = top_k, args.norm_topk_prob, args.routed_scaling_factor
        self.groups = (groups, args.topk_group) if args.topk_group < groups else None

    def __call__(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        scores = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
        return pick_experts(scores, scores, self.top_k, self.groups, 2, 0.0, self.normalize, self.scale)


class MoE(deepseek_v3.MoE):
    """DeepSeek's block (gate, experts `switch_mlp`, `shared_experts`) with Mistral 4's router."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.gate = nn.Linear(args.hidden_size, args.n_routed_experts, bias=False)
        self.router = Router(args)

    def __call__(self, x: mx.array) -> mx.array:
        # a dense gate's weight is float32 (Model.float32_weights): its input too; a quantized one as loaded
        logits = self.gate(x.astype(mx.float32) if isinstance(self.gate, nn.Linear) else x)
        indices, weights = self.router(logits)
        y = (self.switch_mlp(x, indices) * weights[..., None]).sum(axis=-2).astype(x.dtype)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y


def make_block(args: ModelArgs, sparse: bool) -> deepseek_v3.TransformerBlock:
    """DeepSeek V3's block with Mistral 4's attention (its query scale) and router."""
    return deepseek_v3.TransformerBlock(args, sparse, attention=Attention.from_args, moe=MoE)


class Model(deepseek_v3.Model):
    """DeepSeek's weights handling (kv_b_proj split per head, experts stacked, FP8 blocks dequantized), and
    Mistral's FP8 layout before it (dequantize_fp8_per_tensor)."""

    float32_weights = (".gate.weight",)  # the router computes in float32
    make_block = make_block

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return super().sanitize(dequantize_fp8_per_tensor(weights))


def dequantize_fp8_per_tensor(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Mistral's FP8 releases (mlx-lm's mistral4 reads the same): `X.weight`, or a stacked expert tensor `X`,
    as e4m3 bytes with `X.weight_scale_inv` / `X_scale_inv` a float32 scale that broadcasts over it (one a
    tensor, or [E, 1, 1] one an expert) -> bfloat16; the static activation scales (`*.activation_scale`, for
    FP8 matmuls) dropped. Scales per 128 x 128 block are left to deepseek_v3.dequantize_fp8."""
    weights = {k: v for k, v in weights.items() if not k.endswith(".activation_scale")}
    for key in [k for k in weights if k.endswith("_scale_inv")]:
        name, scale = key[: -len("_scale_inv")], weights[key]
        weight = weights.get(name)
        if weight is None or not broadcasts(scale.shape, weight.shape):
            continue
        dense = mx.from_fp8(weight.view(mx.uint8), dtype=mx.float32) * scale.astype(mx.float32)
        weights[name] = dense.astype(mx.bfloat16)
        del weights[key]
    return weights


def broadcasts(scale: tuple[int, ...], weight: tuple[int, ...]) -> bool:
    padded = (1,) * (len(weight) - len(scale)) + tuple(scale)
    return len(scale) <= len(weight) and all(s in (1, w) for s, w in zip(padded, weight))
