"""Nemotron-H (NVIDIA): Mamba-2 layers beside a few attention layers, and MLP or MoE layers.

Each block is a pre-norm residual around one mixer, of four kinds (`layers_block_type`, or the
older `hybrid_override_pattern` string: M mamba, * attention, - mlp, E moe):
- a Mamba-2 mixer, which keeps a fixed-size state per row (models/recurrent.py): the last
  kernel - 1 inputs of a depthwise causal convolution over x, B and C, and the SSM state [H, P, N]
  (models/ssd.py). Its output passes an RMSNorm over n_groups groups, gated by silu(z) first;
- attention without positions (no RoPE), grouped-query;
- an MLP of up/down projections with relu(x)^2 between (no gate);
- a mixture of experts of such MLPs (Nemotron 3): a sigmoid router with a score-correction bias
  for the choice (not the weights), optionally routed within groups, a shared expert beside, and
  an optional latent projection around the routed experts.
MLP and MoE blocks keep nothing between calls: they get no cache entry (`make_cache` has one per
Mamba or attention block, in order).

Checkpoints name the model `backbone` (NVIDIA's and transformers' files, mlx-lm's folders) and
every mixer `mixer`; sanitize renames them to ours (`model.embed_tokens`, `self_attn`, `mlp`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxcel.errors import MlxcelError
from mlxcel.models import llama
from mlxcel.models.cache import KVCache, make_attention_mask
from mlxcel.models.recurrent import RecurrentCache, causal_conv, token_mask
from mlxcel.models.ssd import discretize_dt, ssd
from mlxcel.models.switch import GroupedSigmoidRouter, SwitchLinear, through_experts

REQUIRED_KEYS = ("hidden_size", "num_attention_heads", "vocab_size", "mamba_num_heads", "mamba_head_dim")
# block kinds as the configs spell them (transformers 5, NVIDIA's first configs, the pattern string)
KINDS = {
    "linear_attention": "mamba",
    "mamba": "mamba",
    "M": "mamba",
    "full_attention": "attention",
    "attention": "attention",
    "*": "attention",
    "mlp": "mlp",
    "-": "mlp",
    "moe": "moe",
    "E": "moe",
}
STATEFUL = ("mamba", "attention")


@dataclass
class ModelArgs(llama.ModelArgs):
    layer_types: list[str] = field(default_factory=list)  # mamba / attention / mlp / moe
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False  # the Mamba mixer's in/out projections
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    n_routed_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    @classmethod
    def from_config(cls, config: dict, **overrides: Any) -> ModelArgs:
        types = read_layer_types(config)
        for key, allowed in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if config.get(key, allowed) != allowed:
                raise MlxcelError(f"config.json: {key} must be {allowed!r} for nemotron_h, got {config[key]!r}")
        values = {
            "layer_types": types,
            "mamba_num_heads": config["mamba_num_heads"],
            "mamba_head_dim": config["mamba_head_dim"],
            "ssm_state_size": config.get("ssm_state_size", 128),
            "n_groups": config.get("n_groups", config.get("mamba_n_groups", 8)),
            "conv_kernel": config.get("conv_kernel", config.get("mamba_d_conv", 4)),
            "use_conv_bias": config.get("use_conv_bias", config.get("mamba_conv_bias", True)),
            "use_bias": config.get("use_bias", False),
            "time_step_limit": read_time_step_limit(config),
            "n_routed_experts": config.get("n_routed_experts", 0) or 0,
            "num_experts_per_tok": config.get("num_experts_per_tok", 1) or 1,
            "moe_intermediate_size": config.get("moe_intermediate_size", 0) or 0,
            "moe_shared_expert_intermediate_size": config.get("moe_shared_expert_intermediate_size", 0) or 0,
            "moe_latent_size": config.get("moe_latent_size"),
            "n_group": config.get("n_group", 1) or 1,
            "topk_group": config.get("topk_group", 1) or 1,
            "norm_topk_prob": config.get("norm_topk_prob", True),
            "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.0) or 1.0),
            "rms_norm_eps": config.get("layer_norm_epsilon", config.get("rms_norm_eps", 1e-5)),
            "attention_bias": False,  # transformers' attention has no biases, whatever the config says
            "rope_scaling": None,  # attention here has no positions
        }
        config = {**config, "num_hidden_layers": len(types), "intermediate_size": config.get("intermediate_size", 0)}
        return super().from_config(config, **{**values, **overrides})


def read_layer_types(config: dict) -> list[str]:
    """Each block's kind, from layers_block_type (a list) or hybrid_override_pattern (a string)."""
    spelled = config.get("layers_block_type") or config.get("layer_types") or config.get("hybrid_override_pattern")
    if not spelled:
        raise MlxcelError("config.json: nemotron_h needs layers_block_type (or hybrid_override_pattern)")
    unknown = sorted({str(t) for t in spelled} - KINDS.keys())
    if unknown:
        raise MlxcelError(
            f"config.json: layers_block_type holds {unknown}; each block is one of mamba/linear_attention, "
            "attention/full_attention, mlp, moe (or M, *, -, E in hybrid_override_pattern)"
        )
    return [KINDS[t] for t in spelled]


def read_time_step_limit(config: dict) -> tuple[float, float]:
    """time_step_limit as two floats: JSON has no infinity, so configs write `Infinity` (Python's
    json reads it) or, from transformers 5, {"__float__": "Infinity"}."""
    limit = config.get("time_step_limit", config.get("mamba_dt_limit", (0.0, math.inf)))
    return tuple(float(v["__float__"]) if isinstance(v, dict) else float(v) for v in limit)


class Attention(llama.Attention):
    """Grouped-query attention without positions: Nemotron-H's attention layers have no RoPE."""

    def prepare(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return self.project_heads(x)


class GroupedGatedRMSNorm(nn.Module):
    """x * silu(z), RMS-normalised within each of `groups` groups, times weight (float32 inside)."""

    def __init__(self, dims: int, groups: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.groups, self.eps = groups, eps

    def __call__(self, x: mx.array, z: mx.array) -> mx.array:
        gated = x.astype(mx.float32) * nn.silu(z.astype(mx.float32))
        grouped = gated.reshape(*gated.shape[:-1], self.groups, -1)
        normed = mx.fast.rms_norm(grouped, None, self.eps).reshape(gated.shape)
        return (normed * self.weight.astype(mx.float32)).astype(x.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads, self.head_dim = args.mamba_num_heads, args.mamba_head_dim
        self.n_groups, self.state_size = args.n_groups, args.ssm_state_size
        if self.num_heads % self.n_groups:
            raise MlxcelError(
                f"config.json: mamba_num_heads ({self.num_heads}) must be a multiple of n_groups ({self.n_groups})"
            )
        self.intermediate = self.num_heads * self.head_dim
        self.conv_dim = self.intermediate + 2 * self.n_groups * self.state_size
        self.kernel = args.conv_kernel
        self.time_step_limit = args.time_step_limit
        hidden = args.hidden_size
        self.in_proj = nn.Linear(hidden, self.intermediate + self.conv_dim + self.num_heads, bias=args.use_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=args.use_conv_bias
        )
        self.dt_bias = mx.ones((self.num_heads,))
        self.A_log = mx.zeros((self.num_heads,))
        self.D = mx.ones((self.num_heads,))
        self.norm = GroupedGatedRMSNorm(self.intermediate, self.n_groups, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.intermediate, hidden, bias=args.use_bias)

    def initial_states(self, rows: int) -> list[mx.array]:
        """A fresh row's state: the conv window (activations' dtype) and the SSM state (fp32)."""
        return [
            mx.zeros((rows, self.kernel - 1, self.conv_dim), dtype=self.norm.weight.dtype),
            mx.zeros((rows, self.num_heads, self.head_dim, self.state_size), dtype=mx.float32),
        ]

    def __call__(self, x: mx.array, cache: RecurrentCache) -> mx.array:
        states, leads = cache.read(self.initial_states)
        out, states = self.advance(x, states, leads)
        cache.write(states, x.shape[1])
        return out

    def advance(self, x: mx.array, states: list[mx.array], leads) -> tuple[mx.array, list[mx.array]]:
        """The mixer's output for x [B, L, hidden] from `states` (conv window, SSM state), and the
        states after it; `leads` as RecurrentCache.read gives them (None in a decode step)."""
        B, L, _ = x.shape
        conv_state, state = states
        mask = token_mask(leads, L)
        if mask is not None:  # padding's projections are zero, as transformers masks its inputs
            x = mx.where(mask[..., None], x, 0)
        gate, xbc, dt = mx.split(self.in_proj(x), [self.intermediate, self.intermediate + self.conv_dim], axis=-1)
        conv, conv_state = causal_conv(xbc, conv_state, self.conv1d.weight, leads, self.conv1d.get("bias"))
        xs, b, c = mx.split(nn.silu(conv), [self.intermediate, self.intermediate + self.n_groups * self.state_size], -1)
        y, state = ssd(
            xs.reshape(B, L, self.num_heads, self.head_dim),
            discretize_dt(dt, self.dt_bias, self.time_step_limit),
            -mx.exp(self.A_log.astype(mx.float32)),
            b.reshape(B, L, self.n_groups, self.state_size),
            c.reshape(B, L, self.n_groups, self.state_size),
            self.D,
            state,
            mask,
        )
        return self.out_proj(self.norm(y.reshape(B, L, -1), gate)), [conv_state, state]


def relu2(x: mx.array) -> mx.array:
    return mx.square(nn.relu(x))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(relu2(self.up_proj(x)))


class SwitchMLP(nn.Module):
    """Each token through its k experts' up/relu^2/down MLPs (mlx-lm's names: fc1 up, fc2 down):
    [..., H] and indices [..., k] -> [..., k, H]."""

    def __init__(self, input_dims: int, hidden_dims: int, num_experts: int):
        super().__init__()
        self.fc1 = SwitchLinear(input_dims, hidden_dims, num_experts)
        self.fc2 = SwitchLinear(hidden_dims, input_dims, num_experts)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return through_experts(x, indices, lambda x, idx, sort: self.fc2(relu2(self.fc1(x, idx, sort)), idx, sort))


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        latent = args.moe_latent_size
        self.gate = GroupedSigmoidRouter.from_args(args)
        self.switch_mlp = SwitchMLP(latent or args.hidden_size, args.moe_intermediate_size, args.n_routed_experts)
        self.shared_experts = MLP(args.hidden_size, args.moe_shared_expert_intermediate_size, args.mlp_bias)
        if latent is not None:
            self.fc1_latent_proj = nn.Linear(args.hidden_size, latent, bias=args.mlp_bias)
            self.fc2_latent_proj = nn.Linear(latent, args.hidden_size, bias=args.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        indices, weights = self.gate(x)
        routed = self.fc1_latent_proj(x) if "fc1_latent_proj" in self else x
        y = (self.switch_mlp(routed, indices) * weights[..., None]).sum(axis=-2).astype(x.dtype)
        if "fc2_latent_proj" in self:
            y = self.fc2_latent_proj(y)
        return y + self.shared_experts(x)


class Block(nn.Module):
    """x + mixer(norm(x)); the mixer is `mixer` (Mamba), `self_attn` or `mlp` (MLP or MoE)."""

    def __init__(self, args: ModelArgs, kind: str):
        super().__init__()
        self.kind = kind
        self.keeps_state = kind in STATEFUL
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if kind == "mamba":
            self.mixer = Mamba2Mixer(args)
        elif kind == "attention":
            self.self_attn = Attention(args)
        elif kind == "moe":
            self.mlp = MoE(args)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size, args.mlp_bias)

    def __call__(self, x: mx.array, mask: Any, cache) -> mx.array:
        h = self.norm(x)
        if self.kind == "mamba":
            return x + self.mixer(h, cache)
        if self.kind == "attention":
            return x + self.self_attn(h, mask, cache)
        return x + self.mlp(h)

    # the segmented decode step's halves (engine/segmented.py)
    def input_layernorm(self, x: mx.array) -> mx.array:
        return self.norm(x)

    def finish_block(self, x: mx.array, attended: mx.array) -> mx.array:
        return x + attended

    def run_with_states(self, x: mx.array, states: list[mx.array]) -> tuple[mx.array, list[mx.array]]:
        """A Mamba block's step from its states, or an MLP / MoE block's (no states)."""
        if self.kind != "mamba":
            return x + self.mlp(self.norm(x)), states
        mixed, states = self.mixer.advance(self.norm(x), states, None)
        return x + mixed, states

    def initial_states(self, rows: int) -> list[mx.array]:
        return self.mixer.initial_states(rows)


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Block(args, kind) for kind in args.layer_types]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(llama.Model):
    supports_padded_prefill = False  # a padded token would advance the recurrent state
    # the SSM's decay, skip and step bias, and the router (transformers keeps it in float32)
    float32_weights = (".A_log", ".D", ".dt_bias", ".gate.weight", ".e_score_correction_bias")

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.args = args
        self.model_type = args.model_type
        self.model = Backbone(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def stateful_layers(self) -> list[Block]:
        """The blocks that own a cache entry, in the order of make_cache's list."""
        return [layer for layer in self.model.layers if layer.keeps_state]

    def forward_with_embeddings(
        self, embeddings: mx.array, cache: list, mask: Any = None, logits_at: int | None = None
    ) -> mx.array:
        h = embeddings
        masks = self.make_masks(h.shape[1], cache) if mask is None else [mask] * len(cache)
        entries = iter(zip(cache, masks))
        for layer in self.model.layers:
            layer_cache, layer_mask = next(entries) if layer.keeps_state else (None, None)
            h = layer(h, layer_mask, layer_cache)
        if logits_at is not None:
            h = h[:, logits_at : logits_at + 1, :]
        return self.compute_logits(self.model.norm(h))

    def layer_entries(self) -> list[tuple[int | None, None]]:
        """Each block's make_cache entry (None for MLP and MoE blocks), for the segmented step."""
        entries = iter(range(len(self.stateful_layers())))
        return [(next(entries) if layer.keeps_state else None, None) for layer in self.model.layers]

    def make_cache(self, batch_size: int = 1, left_pad: list[int] | None = None) -> list:
        pad = mx.array(left_pad, dtype=mx.int32) if left_pad is not None and any(left_pad) else None
        return [
            RecurrentCache(batch_size, left_pad if pad is not None else None)
            if layer.kind == "mamba"
            else KVCache(batch_size, pad)
            for layer in self.stateful_layers()
        ]

    def make_masks(self, length: int, cache: list) -> list:
        """The attention layers' mask (from the first one's cache); Mamba layers take none."""
        kinds = [layer.kind for layer in self.stateful_layers()]
        first = next((c for c, kind in zip(cache, kinds) if kind == "attention"), None)
        mask = make_attention_mask(length, first) if first is not None else None
        return [mask if kind == "attention" else None for kind in kinds]

    def state_bytes_per_row(self) -> int:
        """A row's recurrent state in every Mamba layer (the same at any position)."""
        return sum(
            sum(x.nbytes for x in layer.mixer.initial_states(1)) for layer in self.model.layers if layer.kind == "mamba"
        )

    def fuse_projections(self) -> None:
        for layer in self.model.layers:
            if layer.kind == "attention":
                layer.self_attn.fuse()

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        kinds = self.args.layer_types
        renamed = {}
        for key, value in weights.items():
            name = rename_weight(key, kinds)
            if name is None:
                continue
            if name.endswith("conv1d.weight") and value.shape[-1] != 1:  # transformers' [C, 1, K] -> MLX's [C, K, 1]
                value = value.moveaxis(2, 1)
            renamed[name] = value
        if self.args.tie_word_embeddings:
            renamed.pop("lm_head.weight", None)
        for i, kind in enumerate(kinds):
            if kind == "moe":
                renamed = stack_experts(renamed, f"model.layers.{i}.mlp", self.args.n_routed_experts)
        return renamed


def rename_weight(key: str, kinds: list[str]) -> str | None:
    """A checkpoint's tensor name as this model names it; None for the multi-token-prediction head."""
    if key.startswith(("mtp.", "backbone.mtp.", "model.mtp.")):
        return None
    for prefix in ("backbone.", "model."):
        if key.startswith(prefix):
            key = "model." + key[len(prefix) :]
            break
    if key.startswith("model.embeddings."):
        return "model.embed_tokens." + key[len("model.embeddings.") :]
    if key.startswith("model.norm_f."):
        return "model.norm." + key[len("model.norm_f.") :]
    parts = key.split(".")
    if len(parts) > 4 and parts[1] == "layers" and parts[3] == "mixer" and parts[2].isdigit():
        kind = kinds[int(parts[2])] if int(parts[2]) < len(kinds) else "mamba"
        parts[3] = {"attention": "self_attn", "mlp": "mlp", "moe": "mlp"}.get(kind, "mixer")
    return ".".join(parts)


def stack_experts(weights: dict[str, mx.array], prefix: str, experts: int) -> dict[str, mx.array]:
    """Routed experts -> `prefix.switch_mlp.fc1/fc2`: per expert (`experts.N.up_proj.weight`, what
    checkpoints hold) or stacked (`experts.up_proj` [E, I, H], transformers 5 in memory)."""
    for source, target in (("up_proj", "fc1"), ("down_proj", "fc2")):
        stacked = weights.pop(f"{prefix}.experts.{source}", None)
        if stacked is None and f"{prefix}.experts.0.{source}.weight" in weights:
            stacked = mx.stack([weights.pop(f"{prefix}.experts.{e}.{source}.weight") for e in range(experts)])
        if stacked is not None:
            weights[f"{prefix}.switch_mlp.{target}.weight"] = stacked
    return weights
