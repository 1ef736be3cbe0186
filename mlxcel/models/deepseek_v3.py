"""DeepSeek V2 / V2-Lite (`deepseek_v2`), DeepSeek V3 / V3.1 / R1 (`deepseek_v3`), Kimi K2 (`kimi_k2`: a
DeepSeek V3 text model) and Kimi K2.5's language model (`kimi_k25`: a vision-language folder whose
text_config is DeepSeek V3; the vision tower is not loaded). transformers' DeepseekV2ForCausalLM and
DeepseekV3ForCausalLM:

- multi-head latent attention (models/mla.py): the cache keeps each position's latent and shared
  RoPE key; RoPE on interleaved pairs (V3's `rope_interleave`, default true; always in V2), YaRN as the
  config scales it, the softmax scale times mscale(factor, mscale_all_dim)^2;
- the first `first_k_dense_replace` layers dense (SwiGLU of intermediate_size), then every
  `moe_layer_freq`-th layer a mixture of experts (SwiGLU experts of moe_intermediate_size, plus
  n_shared_experts' worth of shared expert every token runs);
- routing, in float32 as transformers keeps it: V3 (and Kimi) a sigmoid whose choice adds
  e_score_correction_bias and keeps the best topk_group of n_group groups (a group scored by its two
  best), the plain scores as weights, normalised when norm_topk_prob (switch.GroupedSigmoidRouter);
  V2 a softmax, `greedy` (the top k) or `group_limited_greedy` (the top k of the topk_group groups
  whose best expert scores highest), never renormalised (as transformers and mlx-lm: V2's
  norm_topk_prob is not read; DeepSeek's released V2 configs set it false); both times
  routed_scaling_factor;
- the multi-token-prediction layers after the last (model.layers.{num_hidden_layers}...) dropped.

Weights: transformers' per-expert tensors (save_pretrained), its stacked ones (in memory), and
mlx-lm's (switch_mlp.*, embed_q / unembed_out: mlx-community's folders, quantized too); DeepSeek's and
Kimi's FP8 releases (e4m3 weights with a float scale per 128 x 128 block, weight_scale_inv) are
dequantized at load. DeepSeek V3.2 (its indexer's sparse attention) and V4 are refused at load
(checkpoints/loader.py names what they lack).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxcel.errors import MlxcelError
from mlxcel.models import glm4_moe, llama
from mlxcel.models.mla import MultiHeadLatentAttention
from mlxcel.models.switch import pick_experts, stack_expert_weights
from mlxcel.models.text_backbone import rename_language_model

REQUIRED_KEYS = (*llama.REQUIRED_KEYS, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
EXPERT_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
# transformers' DeepseekV3Config defaults, where a kimi_k25 folder's text_config is silent
TEXT_CONFIG_DEFAULTS = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
}
# what the language model does not use: Kimi K2.5's vision tower and projector
DROPPED = ("vision_tower.", "mm_projector.", "model.vision_tower.", "model.mm_projector.", "multi_modal_projector.")
V2_ROUTING = ("greedy", "group_limited_greedy")
FP8_BLOCK = 128  # DeepSeek's FP8 checkpoints: one scale per 128 x 128 block of a weight


@dataclass
class ModelArgs(llama.ModelArgs):
    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    num_experts_per_tok: int = 1
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    topk_method: str = "noaux_tc"  # V3: sigmoid with the correction bias; V2: greedy or group_limited_greedy
    sparse_layers: list[bool] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict, **overrides: Any) -> ModelArgs:
        config = text_config(config)
        v2 = config.get("model_type") == "deepseek_v2"
        method = (config.get("topk_method") or "greedy") if v2 else "noaux_tc"
        if v2 and method not in V2_ROUTING:
            raise MlxcelError(
                f"config.json: deepseek_v2 routes with topk_method {' or '.join(V2_ROUTING)}; got {method!r}"
            )
        experts = config.get("n_routed_experts") or 0
        first_dense = config.get("first_k_dense_replace") or 0
        frequency = config.get("moe_layer_freq") or 1
        layers = config["num_hidden_layers"]
        values = {
            "kv_lora_rank": config["kv_lora_rank"],
            "q_lora_rank": config.get("q_lora_rank"),
            "qk_nope_head_dim": config["qk_nope_head_dim"],
            "qk_rope_head_dim": config["qk_rope_head_dim"],
            "v_head_dim": config["v_head_dim"],
            "rope_interleave": True if v2 else bool(config.get("rope_interleave", True)),
            "moe_intermediate_size": config.get("moe_intermediate_size") or 0,
            "n_routed_experts": experts,
            "num_experts_per_tok": config.get("num_experts_per_tok") or 1,
            "n_shared_experts": config.get("n_shared_experts") or 0,
            "n_group": config.get("n_group") or 1,
            "topk_group": config.get("topk_group") or 1,
            "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
            "norm_topk_prob": bool(config.get("norm_topk_prob", not v2)),
            "topk_method": method,
            "sparse_layers": [bool(experts) and i >= first_dense and i % frequency == 0 for i in range(layers)],
            "mlp_bias": config.get("mlp_bias", False),
            # (head_dim is the RoPE key's in transformers' config: the MLA sizes are read above)
            "head_dim": None,
        }
        return super().from_config(config, **{**values, **overrides})


def text_config(config: dict) -> dict:
    """A kimi_k25 (vision-language) config's language model settings over transformers'
    DeepseekV3Config defaults; a text config as it is."""
    if "text_config" not in config:
        return config
    text = {**TEXT_CONFIG_DEFAULTS, **(config["text_config"] or {})}
    text.setdefault("eos_token_id", config.get("eos_token_id"))
    # the vision-language model ties (or not) by its own setting (Kimi_K25Config's default: tied)
    text["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", True))
    return text


def normalize_config(config: dict) -> dict:
    """config.json as the loader checks it (REQUIRED_KEYS): a kimi_k25 folder's text_config."""
    return text_config(config)


class SoftmaxRouter(nn.Module):
    """DeepSeek V2's router (transformers' DeepseekV2TopkRouter): softmax over every expert in float32;
    `greedy` takes the top k, `group_limited_greedy` the top k of the topk_group groups whose best
    expert scores highest (the other groups' scores zeroed); weights times routed_scaling_factor."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        experts, top_k = args.n_routed_experts, args.num_experts_per_tok
        grouped = args.topk_method == "group_limited_greedy"
        if not 1 <= top_k <= experts or (grouped and (experts % args.n_group or args.topk_group > args.n_group)):
            raise MlxcelError(
                f"config.json: num_experts_per_tok={top_k} must be between 1 and n_routed_experts ({experts}), "
                f"n_routed_experts a multiple of n_group ({args.n_group}) and topk_group ({args.topk_group}) at most "
                "n_group"
            )
        self.weight = mx.zeros((experts, args.hidden_size))
        self.top_k, self.scale = top_k, args.routed_scaling_factor
        self.groups = (args.n_group, args.topk_group) if grouped and args.topk_group < args.n_group else None

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        scores = mx.softmax(x.astype(mx.float32) @ self.weight.astype(mx.float32).T, axis=-1, precise=True)
        # (a group scored by its best expert; transformers takes the weights from the group-masked scores,
        # which are the plain ones at the chosen experts)
        return pick_experts(scores, scores, self.top_k, self.groups, group_best=1, scale=self.scale)


class MoE(glm4_moe.MoE):
    """The router (`gate`), the routed experts (`switch_mlp`) and the shared experts beside them
    (GLM-4.5's block, itself DeepSeek V3's); V2 routes with its softmax."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        if args.topk_method in V2_ROUTING:
            self.gate = SoftmaxRouter(args)


class TransformerBlock(llama.TransformerBlock):
    """MLA, then the dense MLP (the first layers) or the experts; a family that shares the block
    (Mistral 4) names its own attention and MoE."""

    def __init__(self, args: ModelArgs, sparse: bool, attention=MultiHeadLatentAttention.from_args, moe=MoE):
        nn.Module.__init__(self)
        self.self_attn = attention(args)
        self.mlp = moe(args) if sparse else llama.MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class DeepseekModel(nn.Module):
    def __init__(self, args: ModelArgs, block=TransformerBlock):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [block(args, sparse) for sparse in args.sparse_layers]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(llama.Model):
    # the router computes in float32 (transformers keeps these two in float32 whatever the dtype)
    float32_weights = (".gate.weight", ".e_score_correction_bias")
    make_block = TransformerBlock  # (args, sparse) -> a layer

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.args = args
        self.model_type = args.model_type
        self.model = DeepseekModel(args, block=type(self).make_block)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = rename_language_model(weights, DROPPED)
        check_packed_int4(weights)
        weights = dequantize_fp8(weights)
        # transformers' save_pretrained writes a kimi_k25 folder's layers as `blocks` (its renaming of
        # the vision tower's blocks to layers, reversed for every key); Moonshot's own keep `layers`
        weights = {
            "model.layers." + k[len("model.blocks.") :] if k.startswith("model.blocks.") else k: v
            for k, v in weights.items()
        }
        weights = super().sanitize(weights)
        layers = self.args.num_hidden_layers
        # the multi-token-prediction layers sit after the last decoder layer
        weights = {k: v for k, v in weights.items() if not glm4_moe.is_past_last_layer(k, layers)}
        experts = self.args.n_routed_experts
        for i, (layer, sparse) in enumerate(zip(self.model.layers, self.args.sparse_layers)):
            weights = layer.self_attn.sanitize(weights, f"model.layers.{i}.self_attn")
            if sparse:
                weights = stack_expert_weights(weights, f"model.layers.{i}.mlp", experts, EXPERT_NAMES)
        return weights


def check_packed_int4(weights: dict[str, mx.array]) -> None:
    """Kimi K2-Thinking's and K2.5's INT4 releases (compressed-tensors: weight_packed, weight_scale) are
    not read: refused in one line rather than as a list of unexpected tensors."""
    packed = next((k for k in weights if k.endswith(".weight_packed")), None)
    if packed is not None:
        raise MlxcelError(
            f"checkpoint tensor {packed}: compressed-tensors INT4 weights are not read; convert the folder with "
            "mlx-lm (mlx_lm.convert -q) and load that"
        )


def dequantize_fp8(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """DeepSeek's FP8 releases: `X.weight` e4m3 bytes and `X.weight_scale_inv` one float32 scale per
    FP8_BLOCK x FP8_BLOCK block (the last blocks may be partial) -> `X.weight` in bfloat16."""
    scaled = [k for k in weights if k.endswith(".weight_scale_inv")]
    if not scaled:
        return weights
    weights = dict(weights)
    for key in scaled:
        scale_inv, name = weights.pop(key), key[: -len("_scale_inv")]
        weight = mx.from_fp8(weights[name].view(mx.uint8), dtype=mx.float32)
        rows, cols = weight.shape
        blocks = (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))
        if tuple(scale_inv.shape) != blocks:
            raise MlxcelError(
                f"{key}: shape {tuple(scale_inv.shape)}, but a {rows} x {cols} weight in {FP8_BLOCK}-wide blocks has "
                f"{blocks} (is this a block-quantized FP8 checkpoint?)"
            )
        scales = mx.repeat(mx.repeat(scale_inv.astype(mx.float32), FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)
        weights[name] = (weight * scales[:rows, :cols]).astype(mx.bfloat16)
    return weights
