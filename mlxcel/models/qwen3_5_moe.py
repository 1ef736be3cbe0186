"""Qwen 3.5 MoE (`qwen3_5_moe_text`, and `qwen3_5_moe` checkpoints' language model): Qwen 3.5's
layers (models/qwen3_5.py) with a sparse mixture of experts as the MLP, beside a shared expert.

A token goes through its top num_experts_per_tok experts (softmax over all experts, the top k
renormalised to sum to one) and through the shared expert, whose output is scaled by
sigmoid(shared_expert_gate(x)). Every layer is sparse in Qwen 3.5 MoE; Qwen3-Next (qwen3_next.py)
builds on this and keeps dense MLPs off the decoder_sparse_step stride and in mlp_only_layers.

Experts load from either checkpoint layout: per expert (`experts.N.gate_proj`, what transformers 5's
save_pretrained writes) or fused (`experts.gate_up_proj` [E, 2I, H] and `experts.down_proj`, the
released checkpoints' and transformers 5's in-memory layout); mlx-lm's converted folders already
name them `switch_mlp.*`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxcel.models import qwen3_5
from mlxcel.models.switch import SparseMoeBlock, stack_expert_weights

REQUIRED_KEYS = (
    *(key for key in qwen3_5.REQUIRED_KEYS if key != "intermediate_size"),
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
EXPERT_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
normalize_config = qwen3_5.normalize_config  # a vision-language folder's text_config, as the loader checks it


@dataclass
class ModelArgs(qwen3_5.ModelArgs):
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    sparse_layers: list[bool] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict, **overrides: Any) -> ModelArgs:
        config = qwen3_5.text_config(config)
        layers, experts = config["num_hidden_layers"], config["num_experts"]
        step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or [])
        values = {
            "num_experts": experts,
            "num_experts_per_tok": config["num_experts_per_tok"],
            "moe_intermediate_size": config["moe_intermediate_size"],
            "shared_expert_intermediate_size": config.get("shared_expert_intermediate_size", 0),
            # Qwen 3.5 MoE always renormalises (its config has no such key); Qwen3-Next says
            "norm_topk_prob": config.get("norm_topk_prob", True),
            "sparse_layers": [i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers)],
        }
        # Qwen 3.5 MoE has no dense layer, and its config no intermediate_size
        config = {"intermediate_size": config["moe_intermediate_size"], **config}
        return super().from_config(config, **{**values, **overrides})


class SharedExpertMoeBlock(SparseMoeBlock):
    """The routed experts plus a shared expert gated by sigmoid(shared_expert_gate(x))."""

    def __init__(self, args: ModelArgs):
        experts, top_k = args.num_experts, args.num_experts_per_tok
        super().__init__(args.hidden_size, args.moe_intermediate_size, experts, top_k, args.norm_topk_prob)
        self.shared_expert = qwen3_5.MLP(args.hidden_size, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        shared = mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().__call__(x) + shared


class Model(qwen3_5.Model):
    def make_mlp(self, index: int) -> nn.Module:
        if self.args.sparse_layers[index]:
            return SharedExpertMoeBlock(self.args)
        return super().make_mlp(index)

    def fuse_projections(self) -> None:
        """Qwen 3.5's fusions, and in MoE layers the experts' and the shared expert's gate and up."""
        super().fuse_projections()
        for layer in self.model.layers:
            if isinstance(layer.mlp, SharedExpertMoeBlock):
                layer.mlp.shared_expert.fuse()

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        for i, sparse in enumerate(self.args.sparse_layers):
            if sparse:
                weights = stack_expert_weights(weights, f"model.layers.{i}.mlp", self.args.num_experts, EXPERT_NAMES)
        return weights
