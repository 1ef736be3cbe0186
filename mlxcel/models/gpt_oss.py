"""gpt-oss (model_type gpt_oss): OpenAI's open-weight MoE. Llama-shaped attention with biases on
Q/K/V/O, a learned per-head sink logit in every query's softmax (Attention.sinks, which
llama.Attention.attend hands to MLX's fused attention), 128-token sliding-window layers
alternating with full ones (`layer_types`), YaRN RoPE (base.RoPE); every MLP a mixture of experts: a biased
router whose top-k logits are softmaxed over the chosen experts only, and biased experts with a
clamped SwiGLU: (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).

Experts load from four layouts:
- the released checkpoints: MXFP4 `experts.{gate_up,down}_proj_{blocks,scales}` (blocks
  [E, out, in/32, 16] uint8, two E2M1 codes a byte, low nibble first; scales [E, out, in/32] E8M0),
  which are MLX's `mxfp4` mode bit for bit (group 32): kept packed, never dequantized;
- transformers' dense layout: `experts.gate_up_proj` [E, H, 2I] (x @ W, gate and up interleaved
  column by column) and `experts.down_proj` [E, I, H], with `*_bias`;
- mlx-lm's (mlx-community folders): `experts.{gate,up,down}_proj.{weight,bias[,scales]}`;
- llama.cpp's GGUF (mlxcel/checkpoints/gguf.py renames its tensors to mlx-lm's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx import nn

from mlxcel.errors import MlxcelError
from mlxcel.models import llama
from mlxcel.models.base import apply_linear, read_rope_scaling, read_rope_theta
from mlxcel.models.rotating_cache import SlidingWindowLayers, read_layer_windows
from mlxcel.models.switch import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, concatenate_switch_linears

REQUIRED_KEYS = (*llama.REQUIRED_KEYS, "num_local_experts", "num_experts_per_tok")
MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}  # the released checkpoints' expert format
# transformers' GptOssConfig defaults where config.json is silent
DEFAULT_ROPE_THETA = 150000.0
DEFAULT_YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


@dataclass
class ModelArgs(llama.ModelArgs):
    num_local_experts: int = 0
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    layer_windows: list[int | None] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict, **overrides) -> ModelArgs:
        n = config["num_hidden_layers"]
        default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]  # even layers slide
        has_rope = "rope_scaling" in config or "rope_parameters" in config
        values = {
            "num_local_experts": config["num_local_experts"],
            "num_experts_per_tok": config["num_experts_per_tok"],
            # the released config.json names no alpha (transformers then uses 1.702)
            "swiglu_alpha": config.get("swiglu_alpha", 1.702),
            "swiglu_limit": config.get("swiglu_limit", 7.0),
            "layer_windows": read_layer_windows(config, config.get("sliding_window", 128), default),
            "attention_bias": config.get("attention_bias", True),
            "rope_theta": read_rope_theta(config, DEFAULT_ROPE_THETA),
            "rope_scaling": read_rope_scaling(config) if has_rope else DEFAULT_YARN,
        }
        return super().from_config(config, **{**values, **overrides})


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        # YaRN's attention factor scales the rotated q and k (base.RoPE multiplies them each call), so
        # q.k by its square: folded into the softmax scale instead, two fewer ops a layer each step
        self.scale *= self.rope.attention_factor**2
        self.rope.attention_factor = 1.0
        self.sinks = mx.zeros((self.n_heads,))  # llama.Attention.attend puts them in the softmax


def eager_clamped_swiglu(gate: mx.array, up: mx.array, alpha: float, limit: float) -> mx.array:
    gate = mx.minimum(gate, limit)
    up = mx.clip(up, -limit, limit)
    return (up + 1) * (gate * mx.sigmoid(gate * alpha))


fused_clamped_swiglu = mx.compile(eager_clamped_swiglu, shapeless=True)  # alpha, limit: compile-time constants


def clamped_swiglu(gate: mx.array, up: mx.array, alpha: float, limit: float) -> mx.array:
    """gpt-oss's expert activation (transformers' GptOssExperts._apply_gate). One compiled kernel
    on a GPU, eager on the CPU (as base.swiglu)."""
    if mx.default_device() == mx.gpu:
        return fused_clamped_swiglu(gate, up, alpha, limit)
    return eager_clamped_swiglu(gate, up, alpha, limit)


def add_expert_bias(out: mx.array, bias: mx.array, indices: mx.array) -> mx.array:
    """out [..., 1, out] from SwitchLinear, each row plus its expert's bias [E, out]."""
    return out + mx.expand_dims(bias[indices], -2)


class BiasedSwitchLinear(SwitchLinear):
    """SwitchLinear with a bias per expert [E, out]."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int):
        super().__init__(input_dims, output_dims, num_experts)
        self.bias = mx.zeros((num_experts, output_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return add_expert_bias(super().__call__(x, indices, sorted_indices), self.bias, indices)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine") -> QuantizedBiasedSwitchLinear:
        return QuantizedBiasedSwitchLinear.wrap(super().to_quantized(group_size, bits, mode), self.bias)


class QuantizedBiasedSwitchLinear(QuantizedSwitchLinear):
    """QuantizedSwitchLinear (any MLX mode: affine, or the checkpoints' mxfp4) with its bias."""

    @classmethod
    def wrap(cls, layer: QuantizedSwitchLinear, bias: mx.array) -> QuantizedBiasedSwitchLinear:
        wrapped = cls.__new__(cls)
        nn.Module.__init__(wrapped)
        wrapped.group_size, wrapped.bits, wrapped.mode = layer.group_size, layer.bits, layer.mode
        dict.update(wrapped, layer)  # weight, scales (and biases in affine mode)
        wrapped.bias = bias
        wrapped.freeze()
        return wrapped

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return add_expert_bias(super().__call__(x, indices, sorted_indices), self.bias, indices)


class Experts(SwitchGLU):
    """SwitchGLU with biased experts and the clamped activation (mlx-lm's names: experts.gate_proj...)."""

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        dim, hidden, experts = args.hidden_size, args.intermediate_size, args.num_local_experts
        self.alpha, self.limit = args.swiglu_alpha, args.swiglu_limit
        self.gate_proj = BiasedSwitchLinear(dim, hidden, experts)
        self.up_proj = BiasedSwitchLinear(dim, hidden, experts)
        self.down_proj = BiasedSwitchLinear(hidden, dim, experts)

    def activate(self, gate: mx.array, up: mx.array) -> mx.array:
        return clamped_swiglu(gate, up, self.alpha, self.limit)

    def fuse(self) -> None:
        fused = concatenate_switch_linears([self.gate_proj, self.up_proj])
        if fused is not None:
            fused.bias = mx.concatenate([self.gate_proj.bias, self.up_proj.bias], axis=1)
            self.gate_up_proj = fused
            del self.gate_proj, self.up_proj


class MLP(nn.Module):
    """The router picks each token's top k experts by logit; their weights are the softmax of
    those k logits only (transformers' GptOssTopKRouter)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        if not 1 <= args.num_experts_per_tok <= args.num_local_experts:
            raise MlxcelError(
                f"config.json: num_experts_per_tok={args.num_experts_per_tok} must be between 1 and "
                f"num_local_experts={args.num_local_experts}"
            )
        self.top_k = args.num_experts_per_tok
        self.router = nn.Linear(args.hidden_size, args.num_local_experts, bias=True)
        self.experts = Experts(args)

    def fuse(self) -> None:
        self.experts.fuse()

    def __call__(self, x: mx.array) -> mx.array:
        logits = apply_linear(self.router, x)  # (one row: a gemv and an add, not a cuBLASLt call)
        indices = mx.argpartition(-logits, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        weights = mx.softmax(mx.take_along_axis(logits, indices, axis=-1).astype(mx.float32), axis=-1)
        y = self.experts(x, indices)
        return (y * weights[..., None]).sum(axis=-2).astype(x.dtype)


class TransformerBlock(llama.TransformerBlock):
    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class GptOssModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(SlidingWindowLayers, llama.Model):
    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.args = args
        self.model_type = args.model_type
        self.model = GptOssModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.layer_windows = args.layer_windows

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        packed = []
        for i in range(self.args.num_hidden_layers):
            prefix = f"model.layers.{i}.mlp.experts"
            if f"{prefix}.gate_up_proj_blocks" in weights:
                weights = unpack_mxfp4_experts(weights, prefix)
                packed.append(prefix)
            elif f"{prefix}.gate_up_proj" in weights:
                weights = split_dense_experts(weights, prefix)
        if packed:  # those experts become MLX mxfp4 layers before the weights load
            names = {f"{prefix}.{proj}" for prefix in packed for proj in ("gate_proj", "up_proj", "down_proj")}
            nn.quantize(self, class_predicate=lambda path, _: MXFP4 if path in names else False)
        return weights


def unpack_mxfp4_experts(weights: dict[str, mx.array], prefix: str) -> dict[str, mx.array]:
    """The checkpoints' MXFP4 experts as MLX mxfp4 layers: each row's blocks [in/32, 16] bytes read
    as [in/8] little-endian uint32 words (code 2j in byte j's low nibble is MLX's element 2j, its
    lowest bits), the E8M0 scales as they are; gate and up are interleaved rows of gate_up."""
    weights = dict(weights)
    for proj in ("gate_up_proj", "down_proj"):
        blocks = weights.pop(f"{prefix}.{proj}_blocks")
        scales = weights.pop(f"{prefix}.{proj}_scales")
        if blocks.dtype != mx.uint8 or scales.dtype != mx.uint8 or blocks.shape[:-1] != scales.shape:
            raise MlxcelError(
                f"{prefix}.{proj}_blocks/_scales: expected uint8 blocks [E, out, in/32, 16] and scales "
                f"[E, out, in/32], got {blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}"
            )
        packed = blocks.view(mx.uint32).flatten(-2)
        bias = weights.pop(f"{prefix}.{proj}_bias")
        if proj == "down_proj":
            weights.update({f"{prefix}.down_proj.weight": packed, f"{prefix}.down_proj.scales": scales})
            weights[f"{prefix}.down_proj.bias"] = bias
            continue
        for name, rows in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
            weights[f"{prefix}.{name}.weight"] = mx.contiguous(packed[:, rows])
            weights[f"{prefix}.{name}.scales"] = mx.contiguous(scales[:, rows])
            weights[f"{prefix}.{name}.bias"] = mx.contiguous(bias[:, rows])
    return weights


def split_dense_experts(weights: dict[str, mx.array], prefix: str) -> dict[str, mx.array]:
    """transformers' dense experts (x @ W: gate_up [E, H, 2I], down [E, I, H]) as ours ([E, out, in])."""
    weights = dict(weights)
    gate_up, bias = weights.pop(f"{prefix}.gate_up_proj"), weights.pop(f"{prefix}.gate_up_proj_bias")
    for name, columns in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
        weights[f"{prefix}.{name}.weight"] = mx.contiguous(gate_up[..., columns].swapaxes(1, 2))
        weights[f"{prefix}.{name}.bias"] = mx.contiguous(bias[:, columns])
    weights[f"{prefix}.down_proj.weight"] = mx.contiguous(weights.pop(f"{prefix}.down_proj").swapaxes(1, 2))
    weights[f"{prefix}.down_proj.bias"] = weights.pop(f"{prefix}.down_proj_bias")
    return weights
