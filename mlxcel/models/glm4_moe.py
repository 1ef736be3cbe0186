"""GLM-4.5 (`glm4_moe`: GLM-4.5, GLM-4.5-Air, GLM-4.6): the Llama block (no extra norms, unlike
GLM-4 dense) with partial RoPE, optional per-head Q/K norms, and a mixture of experts.

- RoPE turns the first `partial_rotary_factor` (0.5) of each head in the half-split layout
  (transformers' glm4_moe rotate_half: first half against second half, not GLM-4's interleave).
- `use_qk_norm`: an RMSNorm over each query and key head before RoPE (GLM-4.5 sets it, -Air not).
- Layers from first_k_dense_replace on are sparse: a sigmoid router whose choice adds
  e_score_correction_bias and keeps the best topk_group of n_group expert groups, the chosen
  experts' plain scores as weights (normalised when norm_topk_prob, times routed_scaling_factor;
  switch.GroupedSigmoidRouter, in float32), n_routed_experts SwiGLU experts of
  moe_intermediate_size, and beside them n_shared_experts' worth of shared expert every token runs.
  The layers before are dense MLPs of intermediate_size.
- The checkpoints carry num_nextn_predict_layers multi-token-prediction layers after the last
  (model.layers.{num_hidden_layers}...): not used for generation, dropped at load, as transformers does.

Experts load per expert (`experts.N.gate_proj`, the released checkpoints and transformers 5's
save_pretrained), fused (`experts.gate_up_proj` [E, 2I, H], transformers 5 in memory) or as
mlx-lm's `switch_mlp.*` (its converted and quantized folders).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxcel.errors import MlxcelError
from mlxcel.models import glm4, llama
from mlxcel.models.switch import GroupedSigmoidRouter, SwitchGLU, stack_expert_weights

REQUIRED_KEYS = (*llama.REQUIRED_KEYS, "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")
EXPERT_NAMES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}


@dataclass
class ModelArgs(glm4.ModelArgs):
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 1
    use_qk_norm: bool = False
    sparse_layers: list[bool] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict, **overrides: Any) -> ModelArgs:
        method = config.get("topk_method", "noaux_tc")
        scoring = config.get("scoring_func", "sigmoid")
        if (method, scoring) != ("noaux_tc", "sigmoid"):
            raise MlxcelError(
                f"config.json: glm4_moe routes with scoring_func='sigmoid' and topk_method='noaux_tc'; "
                f"got {scoring!r} and {method!r}"
            )
        first_dense = config.get("first_k_dense_replace", 1)
        eos = config.get("eos_token_id")
        values = {
            "moe_intermediate_size": config["moe_intermediate_size"],
            "n_routed_experts": config["n_routed_experts"],
            "num_experts_per_tok": config["num_experts_per_tok"],
            "n_shared_experts": config.get("n_shared_experts", 1) or 0,
            "n_group": config.get("n_group", 1) or 1,
            "topk_group": config.get("topk_group", 1) or 1,
            "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
            "norm_topk_prob": config.get("norm_topk_prob", True),
            "first_k_dense_replace": first_dense,
            "use_qk_norm": config.get("use_qk_norm", False),
            "sparse_layers": [i >= first_dense for i in range(config["num_hidden_layers"])],
            # unlike GLM-4 dense: half-split RoPE, no default biases, head_dim from the shape
            "rope_traditional": False,
            "head_dim": config.get("head_dim"),
            "attention_bias": config.get("attention_bias", False),
            "rms_norm_eps": config.get("rms_norm_eps", 1e-5),
            "eos_token_ids": [eos] if isinstance(eos, int) else list(eos or []),
        }
        return super().from_config(config, **{**values, **overrides})


class Attention(glm4.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        if args.use_qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)

    def project_heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        q, k, v = super().project_heads(x)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v


class MoE(nn.Module):
    """The router (`gate`), the routed experts (`switch_mlp`) and the shared experts beside them."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = GroupedSigmoidRouter.from_args(args)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.n_routed_experts)
        if args.n_shared_experts:
            shared = args.moe_intermediate_size * args.n_shared_experts
            self.shared_experts = llama.MLP(dataclasses.replace(args, intermediate_size=shared))

    def fuse(self) -> None:
        self.switch_mlp.fuse()
        if "shared_experts" in self:
            self.shared_experts.fuse()

    def __call__(self, x: mx.array) -> mx.array:
        indices, weights = self.gate(x)
        y = (self.switch_mlp(x, indices) * weights[..., None]).sum(axis=-2).astype(x.dtype)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y


class Model(llama.Model):
    # the router computes in float32 (transformers keeps these two in float32 whatever the dtype)
    float32_weights = (".gate.weight", ".e_score_correction_bias")

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        for layer, sparse in zip(self.model.layers, args.sparse_layers):
            layer.self_attn = Attention(args)
            if sparse:
                layer.mlp = MoE(args)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        layers = self.args.num_hidden_layers
        # the multi-token-prediction layers sit after the last decoder layer
        weights = {k: v for k, v in weights.items() if not is_past_last_layer(k, layers)}
        for i, sparse in enumerate(self.args.sparse_layers):
            if sparse:
                prefix = f"model.layers.{i}.mlp"
                weights = stack_expert_weights(weights, prefix, self.args.n_routed_experts, EXPERT_NAMES)
        return weights


def is_past_last_layer(key: str, layers: int) -> bool:
    parts = key.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= layers
