"""Qwen3-Next (`qwen3_next`): Qwen 3.5 MoE's layers (qwen3_5_moe.py) with two differences.

- A Gated DeltaNet layer projects its input with two matrices, `in_proj_qkvz` and `in_proj_ba`,
  whose rows are grouped per key head: for each of the linear_num_key_heads heads, its query, its
  key, then the values and the gates z of the value heads it serves; then per key head its b's and
  a's. transformers regroups the outputs on every call (fix_query_key_value_ordering); here the
  rows are put in the order Qwen 3.5 uses (all queries, all keys, all values, all z; all b, all a)
  once at load, so a call is one matmul and a split. The permutation moves whole rows, so it applies
  as it is to an MLX-quantized folder's packed weights, scales and biases, and the tensors keep the
  checkpoint's names (a quantized folder's per-layer settings still find them).
- Which layers are sparse follows decoder_sparse_step and mlp_only_layers (dense layers keep an
  MLP of intermediate_size), and norm_topk_prob says whether the top-k weights are renormalised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxcel.models import qwen3_5, qwen3_5_moe

REQUIRED_KEYS = (*qwen3_5.REQUIRED_KEYS, "num_experts", "num_experts_per_tok", "moe_intermediate_size")
GROUPED = (".weight", ".scales", ".biases")  # a (quantized) linear's tensors: all rows per output


@dataclass
class ModelArgs(qwen3_5_moe.ModelArgs):
    @classmethod
    def from_config(cls, config: dict, **overrides: Any) -> ModelArgs:
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if "partial_rotary_factor" not in rope and "partial_rotary_factor" not in config:
            overrides = {"partial_rotary_factor": 0.25, **overrides}  # transformers' default for Qwen3-Next
        return super().from_config(config, **overrides)


class GatedDeltaNet(qwen3_5.GatedDeltaNet):
    """Qwen 3.5's layer with q|k|v|z in one projection and b|a in another (rows regrouped at load)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        del self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a
        self.in_proj_qkvz = nn.Linear(args.hidden_size, self.conv_dim + self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(args.hidden_size, 2 * self.num_v_heads, bias=False)

    PROJECTIONS = ("in_proj_qkvz", "in_proj_ba")

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        qkvz, ba = self.projected(x)
        qkv, z = mx.split(qkvz, [self.conv_dim], axis=-1)
        b, a = mx.split(ba, 2, axis=-1)
        return qkv, z, b, a


def regroup_rows(value: mx.array, groups: int, sizes: list[int]) -> mx.array:
    """Rows laid out per group as [part 0 | part 1 | ...] (sizes[i] rows of part i), reordered to
    [part 0 of every group | part 1 of every group | ...]."""
    grouped = value.reshape(groups, sum(sizes), *value.shape[1:])
    bounds = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
    parts = mx.split(grouped, bounds, axis=1)
    return mx.concatenate([part.reshape(groups * size, *value.shape[1:]) for part, size in zip(parts, sizes)])


class Model(qwen3_5_moe.Model):
    linear_attention = GatedDeltaNet

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        args = self.args
        heads = args.linear_num_key_heads
        per_head = args.linear_num_value_heads // heads  # value heads per key head
        qkvz = [args.linear_key_head_dim] * 2 + [per_head * args.linear_value_head_dim] * 2
        for key, value in weights.items():
            if ".linear_attn.in_proj_qkvz" in key and key.endswith(GROUPED):
                weights[key] = regroup_rows(value, heads, qkvz)
            elif ".linear_attn.in_proj_ba" in key and key.endswith(GROUPED):
                weights[key] = regroup_rows(value, heads, [per_head, per_head])
        return weights
