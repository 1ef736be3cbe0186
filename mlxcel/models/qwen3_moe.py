"""Qwen3-MoE: the Qwen3 block (per-head q/k RMSNorm) with a sparse mixture of experts as the MLP:
softmax over num_experts, the top num_experts_per_tok, renormalised only when norm_topk_prob.
Layers listed in mlp_only_layers, or off the decoder_sparse_step stride, keep a dense MLP of
intermediate_size; the experts are moe_intermediate_size wide."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from mlxcel.models import llama, qwen3
from mlxcel.models.rotating_cache import read_layer_windows
from mlxcel.models.switch import SparseMoeBlock, stack_expert_weights

REQUIRED_KEYS = (*llama.REQUIRED_KEYS, "moe_intermediate_size", "num_experts_per_tok")
EXPERT_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


@dataclass
class ModelArgs(qwen3.ModelArgs):
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: list[bool] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict, **overrides) -> ModelArgs:
        layers = config["num_hidden_layers"]
        # transformers 5 writes num_local_experts; the released checkpoints say num_experts
        experts = config.get("num_experts", config.get("num_local_experts", 0))
        step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or [])
        window = config.get("sliding_window") if config.get("use_sliding_window") else None
        values = {
            "num_experts": experts,
            "num_experts_per_tok": config["num_experts_per_tok"],
            "moe_intermediate_size": config["moe_intermediate_size"],
            "norm_topk_prob": config.get("norm_topk_prob", False),
            "sparse_layers": [i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers)],
            # unlike dense Qwen3, every layer slides when use_sliding_window (max_window_layers unused)
            "layer_windows": read_layer_windows(config, window, ["sliding_attention"] * layers),
        }
        return super().from_config(config, **{**values, **overrides})


class Model(qwen3.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        for layer, sparse in zip(self.model.layers, args.sparse_layers):
            if sparse:
                layer.mlp = SparseMoeBlock(
                    args.hidden_size,
                    args.moe_intermediate_size,
                    args.num_experts,
                    args.num_experts_per_tok,
                    args.norm_topk_prob,
                )

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        for i, sparse in enumerate(self.args.sparse_layers):
            if sparse:
                weights = stack_expert_weights(weights, f"model.layers.{i}.mlp", self.args.num_experts, EXPERT_NAMES)
        return weights
