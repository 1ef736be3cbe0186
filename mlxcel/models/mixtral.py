"""Mixtral: the Mistral block (optional sliding window) with its MLP replaced by a sparse mixture
of experts: a router picks each token's top-k of num_local_experts SwiGLU experts (softmax over
all experts, top-k, renormalised to sum to 1) and sums their outputs by those weights."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlxcel.models import llama, mistral
from mlxcel.models.switch import SparseMoeBlock, stack_expert_weights

REQUIRED_KEYS = (*llama.REQUIRED_KEYS, "num_local_experts", "num_experts_per_tok")
# Mixtral's per-expert checkpoint names: w1 gate, w3 up, w2 down
EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass
class ModelArgs(mistral.ModelArgs):
    num_local_experts: int = 8
    num_experts_per_tok: int = 2

    @classmethod
    def from_config(cls, config: dict, **overrides) -> ModelArgs:
        values = {
            "num_local_experts": config["num_local_experts"],
            "num_experts_per_tok": config["num_experts_per_tok"],
        }
        return super().from_config(config, **{**values, **overrides})


class TransformerBlock(llama.TransformerBlock):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        del self.mlp
        self.block_sparse_moe = SparseMoeBlock(
            args.hidden_size, args.intermediate_size, args.num_local_experts, args.num_experts_per_tok, normalize=True
        )

    def finish_block(self, x: mx.array, attended: mx.array) -> mx.array:
        h = x + attended
        return h + self.block_sparse_moe(self.post_attention_layernorm(h))


class Model(mistral.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.model.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]

    def fuse_projections(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.block_sparse_moe.fuse()

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        for i in range(self.args.num_hidden_layers):
            prefix = f"model.layers.{i}.block_sparse_moe"
            # transformers 5 in memory names the block `mlp`; its checkpoints and mlx-lm's say block_sparse_moe
            for key in [k for k in weights if k.startswith(f"model.layers.{i}.mlp.")]:
                weights[prefix + key[len(f"model.layers.{i}.mlp") :]] = weights.pop(key)
            weights = stack_expert_weights(weights, prefix, self.args.num_local_experts, EXPERT_NAMES)
        return weights
