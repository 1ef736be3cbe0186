"""Qwen 3.5 (dense): three Gated DeltaNet layers to each full-attention layer (`layer_types`).

A linear-attention layer (GatedDeltaNet) keeps a fixed-size state per row (models/recurrent.py):
the last kernel - 1 inputs of a depthwise causal convolution over its q/k/v projections, and the
gated delta rule's [Dk, Dv] matrix per value head (models/gated_delta.py). Its output passes an
RMSNorm gated by silu(z). A full-attention layer is Qwen3's (per-head q/k RMSNorm) with an output
gate: q_proj gives each head's query and gate side by side, and the attention output is multiplied
by sigmoid(gate) before o_proj; RoPE turns the first `partial_rotary_factor` of each head only
(text positions: M-RoPE's three sections see the same position, so it is plain RoPE).

RMSNorms other than the gated one are zero-centred in transformers (1 + weight); the weights are
shifted by one at load, as mlx-lm's converted folders store them. `qwen3_5` checkpoints (the
vision-language model) load their language model: the vision tower is not read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxcel.models import gated_delta_cuda, llama
from mlxcel.models.base import RoPE, fuse_linears
from mlxcel.models.cache import KVCache, make_attention_mask
from mlxcel.models.gated_delta import gated_delta
from mlxcel.models.recurrent import RecurrentCache, causal_conv, token_mask
from mlxcel.models.text_backbone import rename_language_model

REQUIRED_KEYS = (*llama.REQUIRED_KEYS, "linear_num_value_heads", "linear_num_key_heads")
# zero-centred in transformers (1 + w): stored shifted by one, as mlx-lm's folders keep them
# what the text model does not use: the vision tower, the multi-token-prediction head
DROPPED = ("model.visual.", "visual.", "vision_tower.", "mtp.", "model.mtp.")
SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", "_norm.weight")


@dataclass
class ModelArgs(llama.ModelArgs):
    layer_types: list[str] = field(default_factory=list)
    linear_num_value_heads: int = 32
    linear_num_key_heads: int = 16
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_config(cls, config: dict, **overrides: Any) -> ModelArgs:
        config = text_config(config)
        layers = config["num_hidden_layers"]
        interval = config.get("full_attention_interval", 4)
        default = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        types = config.get("layer_types") or default
        if len(types) != layers or set(types) - {"full_attention", "linear_attention"}:
            from mlxcel.errors import MlxcelError

            raise MlxcelError(
                f"config.json: layer_types must hold {layers} entries of full_attention / linear_attention, got {types}"
            )
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        values = {
            "layer_types": list(types),
            "linear_num_value_heads": config["linear_num_value_heads"],
            "linear_num_key_heads": config["linear_num_key_heads"],
            "linear_key_head_dim": config.get("linear_key_head_dim", 128),
            "linear_value_head_dim": config.get("linear_value_head_dim", 128),
            "linear_conv_kernel_dim": config.get("linear_conv_kernel_dim", 4),
            "partial_rotary_factor": rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)),
            # M-RoPE's sections over one text position are plain RoPE
            "rope_scaling": None,
        }
        return super().from_config(config, **{**values, **overrides})


def text_config(config: dict) -> dict:
    """A `qwen3_5` (vision-language) config's language model settings; a text config as it is."""
    if "text_config" not in config:
        return config
    text = dict(config["text_config"])
    if "eos_token_id" in config and "eos_token_id" not in text:
        text["eos_token_id"] = config["eos_token_id"]
    # the vision-language model ties (or not) by its own setting, whatever its text_config says
    text["tie_word_embeddings"] = config.get("tie_word_embeddings", False)
    return text


def normalize_config(config: dict) -> dict:
    """config.json as the loader checks it (REQUIRED_KEYS): a vision-language folder's text_config."""
    return text_config(config)


class Attention(llama.Attention):
    """Qwen3's attention with per-head q/k norms, partial RoPE and a sigmoid output gate."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.q_proj = nn.Linear(args.hidden_size, 2 * self.n_heads * self.head_dim, bias=args.attention_bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.rope = RoPE(int(self.head_dim * args.partial_rotary_factor), args.rope_theta)

    def project_qkv(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(query and gate side by side per head, keys, values); fused (fuse) as one matmul."""
        if "qkv_proj" not in self:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q_size, kv_size = 2 * self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return tuple(mx.split(self.qkv_proj(x), [q_size, q_size + kv_size], axis=-1))

    def prepare(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """Q and K rotated to their positions, V, and the output gate [B, L, heads * D] (finish's)."""
        B, L, _ = x.shape
        query_gate, k, v = self.project_qkv(x)
        q, gate = mx.split(query_gate.reshape(B, L, self.n_heads, 2 * self.head_dim), 2, axis=-1)
        q = self.q_norm(q).transpose(0, 2, 1, 3)
        k = self.k_norm(k.reshape(B, L, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(q, offset), self.rope(k, offset), v, gate.reshape(B, L, -1)

    def finish(self, out: mx.array, gate: mx.array) -> mx.array:
        B, _, L, _ = out.shape
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(out * mx.sigmoid(gate))

    def __call__(self, x: mx.array, mask: Any, cache: KVCache) -> mx.array:
        q, k, v, gate = self.prepare(x, cache.rope_offset())
        k, v = cache.update_and_fetch(k, v)
        return self.finish(self.attend(q, k, v, mask), gate)


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * weight * silu(z), in float32 as transformers computes it."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, z: mx.array) -> mx.array:
        normed = mx.fast.rms_norm(x.astype(mx.float32), None, self.eps).astype(x.dtype) * self.weight
        return (normed.astype(mx.float32) * nn.silu(z.astype(mx.float32))).astype(x.dtype)


L2_EPS = 1e-6  # q's and k's l2 norms (the FLA kernels' and transformers' epsilon)


def l2_normalize(x: mx.array, eps: float = L2_EPS) -> mx.array:
    """x / sqrt(sum(x^2) + eps) in float32 (as the FLA kernels and transformers' fallback), as
    rms_norm(x, eps / d) / sqrt(d): one fused kernel where a sum, an rsqrt and a product were three
    (per-op cost bounds a GPU's batch-1 decode)."""
    dims = x.shape[-1]
    return mx.fast.rms_norm(x.astype(mx.float32), None, eps / dims) * dims**-0.5


class GatedDeltaNet(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_v_heads, self.num_k_heads = args.linear_num_value_heads, args.linear_num_key_heads
        self.head_k_dim, self.head_v_dim = args.linear_key_head_dim, args.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            from mlxcel.errors import MlxcelError

            raise MlxcelError(
                f"config.json: linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_k_heads})"
            )
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = args.linear_conv_kernel_dim
        hidden = args.hidden_size
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = mx.ones((self.num_v_heads,))
        self.A_log = mx.zeros((self.num_v_heads,))
        self.norm = GatedRMSNorm(self.head_v_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def initial_states(self, rows: int) -> list[mx.array]:
        """A fresh row's state: the conv window (activations' dtype) and the delta rule's matrices (fp32)."""
        return [
            mx.zeros((rows, self.kernel - 1, self.conv_dim), dtype=self.norm.weight.dtype),
            mx.zeros((rows, self.num_v_heads, self.head_k_dim, self.head_v_dim), dtype=mx.float32),
        ]

    PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """The input projections: (q|k|v for the convolution, z for the output gate, b, a)."""
        return tuple(self.projected(x))

    def projected(self, x: mx.array) -> list[mx.array]:
        """Each of PROJECTIONS applied to x: one matmul and a split once fused (fuse)."""
        if "in_proj" not in self:
            return [getattr(self, name)(x) for name in self.PROJECTIONS]
        widths = [getattr(self, f"{name}_width") for name in self.PROJECTIONS]
        bounds = [sum(widths[: i + 1]) for i in range(len(widths) - 1)]
        return mx.split(self.in_proj(x), bounds, axis=-1)

    def fuse(self) -> None:
        """The input projections as one matmul (a decode step's ops are its cost on a GPU)."""
        layers = [getattr(self, name) for name in self.PROJECTIONS]
        fused = fuse_linears(layers)
        if fused is None:
            return
        for name, layer in zip(self.PROJECTIONS, layers):
            setattr(self, f"{name}_width", layer.weight.shape[0])
            delattr(self, name)
        self.in_proj = fused

    def __call__(self, x: mx.array, cache: RecurrentCache) -> mx.array:
        states, leads = cache.read(self.initial_states)
        out, states = self.advance(x, states, leads)
        cache.write(states, x.shape[1])
        return out

    def advance(self, x: mx.array, states: list[mx.array], leads) -> tuple[mx.array, list[mx.array]]:
        """The layer's output for x [B, L, hidden] from `states` (conv window, delta-rule matrices),
        and the states after it; `leads` as RecurrentCache.read gives them (None in a decode step)."""
        B, L, _ = x.shape
        conv_state, state = states
        if L == 1 and leads is None and self.has_fused_step():
            out, conv_state, state = gated_delta_cuda.decode_step(
                self.projection_columns(x),
                conv_state,
                self.conv1d.weight,
                self.A_log,
                self.dt_bias,
                self.norm.weight,
                state,
                (self.num_k_heads, self.num_v_heads),
                (self.head_k_dim, self.head_v_dim),
                (L2_EPS, self.norm.eps),
            )
            return self.out_proj(out), [conv_state, state]
        mask = token_mask(leads, L)
        qkv, z, b, a = self.project(x)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        mixed, conv_state = causal_conv(qkv, conv_state, self.conv1d.weight, leads)
        q, k, v = mx.split(nn.silu(mixed), [self.key_dim, 2 * self.key_dim], axis=-1)
        q = l2_normalize(q.reshape(B, L, self.num_k_heads, self.head_k_dim)) * self.head_k_dim**-0.5
        k = l2_normalize(k.reshape(B, L, self.num_k_heads, self.head_k_dim))
        v = v.reshape(B, L, self.num_v_heads, self.head_v_dim)
        beta = mx.sigmoid(b.astype(mx.float32))
        g = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(a.astype(mx.float32) + self.dt_bias.astype(mx.float32))
        y, state = gated_delta(q, k, v, g, beta, state, mask)
        z = z.reshape(B, L, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm(y, z).reshape(B, L, -1)), [conv_state, state]

    def has_fused_step(self) -> bool:
        """A decode step as one kernel (gated_delta_cuda: MLX's CUDA backend) from the conv window to
        the gated norm."""
        return gated_delta_cuda.is_available(self.head_k_dim, self.head_v_dim, self.num_k_heads, self.num_v_heads)

    def projection_columns(self, x: mx.array) -> list[tuple[mx.array, int]]:
        """qkv, z, b and a as (the input projection's output that holds it, its first column): the
        fused step reads them where the matmuls wrote them (a split would copy each). Every family
        here lays them out in that order across its projections (Qwen 3.5: four or one fused;
        Qwen3-Next: qkv|z and b|a)."""
        outputs = [self.in_proj(x)] if "in_proj" in self else [getattr(self, name)(x) for name in self.PROJECTIONS]
        ends = [sum(output.shape[-1] for output in outputs[: i + 1]) for i in range(len(outputs))]
        starts = [0, self.conv_dim, self.conv_dim + self.value_dim, self.conv_dim + self.value_dim + self.num_v_heads]
        columns = []
        for start in starts:
            i = next(i for i, end in enumerate(ends) if start < end)
            columns.append((outputs[i], start - (ends[i - 1] if i else 0)))
        return columns


class MLP(llama.MLP):
    """llama's SwiGLU MLP (its fusion of gate and up too), built from sizes: the shared experts'
    width is not the config's intermediate_size."""

    def __init__(self, hidden: int, intermediate: int):
        nn.Module.__init__(self)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, kind: str, mlp: nn.Module, linear_attention: type = GatedDeltaNet):
        super().__init__()
        self.is_linear = kind == "linear_attention"
        if self.is_linear:
            self.linear_attn = linear_attention(args)
        else:
            self.self_attn = Attention(args)
        self.mlp = mlp
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, mask: Any, cache) -> mx.array:
        normed = self.input_layernorm(x)
        mixed = self.linear_attn(normed, cache) if self.is_linear else self.self_attn(normed, mask, cache)
        return self.finish_block(x, mixed)

    def finish_block(self, x: mx.array, mixed: mx.array) -> mx.array:
        """After the mixer (attention or Gated DeltaNet): the residual and the MLP."""
        h = x + mixed
        return h + self.mlp(self.post_attention_layernorm(h))

    def run_with_states(self, x: mx.array, states: list[mx.array]) -> tuple[mx.array, list[mx.array]]:
        """A linear-attention layer's decode step from its states (the segmented step: segmented.py)."""
        mixed, states = self.linear_attn.advance(self.input_layernorm(x), states, None)
        return self.finish_block(x, mixed), states

    def initial_states(self, rows: int) -> list[mx.array]:
        return self.linear_attn.initial_states(rows)


class TextModel(nn.Module):
    def __init__(self, args: ModelArgs, layers: list[DecoderLayer]):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = layers
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(llama.Model):
    supports_padded_prefill = False  # a padded token would advance the recurrent state
    float32_weights = (".A_log",)  # the decay's log: bf16 would move every step's decay
    linear_attention = GatedDeltaNet  # the linear-attention layers' class (Qwen3-Next projects differently)

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)
        self.args = args
        self.model_type = args.model_type
        mixer = self.linear_attention
        layers = [DecoderLayer(args, kind, self.make_mlp(i), mixer) for i, kind in enumerate(args.layer_types)]
        self.model = TextModel(args, layers)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def make_mlp(self, index: int) -> nn.Module:
        """Layer `index`'s MLP: dense here; the MoE families give sparse blocks."""
        return MLP(self.args.hidden_size, self.args.intermediate_size)

    def make_cache(self, batch_size: int = 1, left_pad: list[int] | None = None) -> list:
        pad = mx.array(left_pad, dtype=mx.int32) if left_pad is not None and any(left_pad) else None
        return [
            RecurrentCache(batch_size, left_pad if pad is not None else None)
            if layer.is_linear
            else KVCache(batch_size, pad)
            for layer in self.model.layers
        ]

    def make_masks(self, length: int, cache: list) -> list:
        """The attention layers' mask (from the first one's cache); recurrent layers take none."""
        first = next(c for c, layer in zip(cache, self.model.layers) if not layer.is_linear)
        mask = make_attention_mask(length, first)
        return [None if layer.is_linear else mask for layer in self.model.layers]

    def state_bytes_per_row(self) -> int:
        """A row's recurrent state in every linear-attention layer (the same at any position)."""
        return sum(
            sum(x.nbytes for x in layer.linear_attn.initial_states(1)) for layer in self.model.layers if layer.is_linear
        )

    def fuse_projections(self) -> None:
        """Each layer's input projections, attention's q/k/v and the MLP's gate/up as single matmuls."""
        for layer in self.model.layers:
            (layer.linear_attn if layer.is_linear else layer.self_attn).fuse()
            if hasattr(layer.mlp, "fuse"):
                layer.mlp.fuse()

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = rename_language_model(weights, DROPPED)
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        # transformers' layout: conv1d weights [C, 1, K] and zero-centred norms; mlx-lm's: [C, K, 1], shifted
        from_transformers = any(k.endswith("conv1d.weight") and v.shape[-1] != 1 for k, v in weights.items())
        if from_transformers:
            for key, value in weights.items():
                if key.endswith("conv1d.weight"):
                    weights[key] = value.moveaxis(2, 1)
                elif key.endswith(SHIFTED_NORMS) and ".linear_attn." not in key:
                    weights[key] = value + 1.0
        return weights
