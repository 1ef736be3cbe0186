"""Multi-head latent attention (MLA: DeepSeek V2/V3, Kimi K2, Mistral 4): what a position caches is a
compressed latent (kv_lora_rank wide, shared by every head) and one rotated RoPE key (qk_rope_head_dim
wide, shared too), not per-head keys and values. The cache's "keys" are the latent [B, 1, S, R] and its
"values" the RoPE key [B, 1, S, P]: the paged pool keeps (R + P) values a position per layer.

Per head h, transformers' kv_b_proj decompresses the latent c into k_nope_h = W_uk[h] c and
v_h = W_uv[h] c. The same attention runs in two forms:
- absorbed (decode, short pieces): each query's no-RoPE part is carried into the latent space,
  q_lat_h = W_uk[h]^T q_nope_h, so q_nope_h . k_nope_h = q_lat_h . c; the keys are [c, k_pe]
  (R + P wide, one KV head for all heads), the values c, and the output W_uv[h] (sum_s p_s c_s).
  Nothing per head is built for the cached positions.
- plain (long prefill pieces): every position's per-head k_nope and v are decompressed and the shared
  k_pe broadcast to the heads; standard attention over nope + P wide keys. Its attention does less
  per (query, key, head) pair (nope + P + v against 2R + P), so it wins once a piece has enough
  queries to pay for decompressing its keys (ABSORBED_MAX_QUERIES).

W_uk and W_uv are kept per head as mlx-lm names them (so mlx-community's folders load as they are):
`embed_q` [H, R, nope] (W_uk[h]^T: q_nope -> latent; transposed, latent -> k_nope) and `unembed_out`
[H, v, R] (latent -> v). `sanitize` splits a checkpoint's kv_b_proj once, at load (a quantized one too).

Reuse (Mistral 4): the constructor takes plain sizes; `queries(x, offset)` returns the rotated
(q_nope, q_pe) [B, H, L, *] and is the hook for a per-position query scale. The module follows
llama.Attention's protocol (prepare / attend / finish, `__call__(x, mask, cache)`), so the engines and
the segmented decode step drive it as any attention.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxcel.errors import MlxcelError
from mlxcel.models.base import RoPE, apply_linear, fuse_linears, yarn_mscale
from mlxcel.models.cpu_attention import attention
from mlxcel.models.paged_cache import PagedMask
from mlxcel.models.switch import quantize_stacked

# Queries per row up to which attention runs absorbed; longer pieces decompress their keys (plain).
# Measured on the 2-core x86 VM (fp32, MLX 0.32, one V2-Lite-like layer: hidden 2048, 16 heads, R 512,
# nope 128, rope 64, v 128; prepare + attend + finish over S cached positions), absorbed / plain, ms,
# with OpenBLAS (with the mlx wheel's reference BLAS every time is longer, plain's up to 20x, and the
# forms cross at about the same lengths: ~120 queries at S 512, between 128 and 256 at S 2048):
#   S = 512:  L=1 11/33, L=4 14/33, L=16 21/43, L=64 44/55, L=128 88/78, L=256 172/130
#   S = 2048: L=1 19/140, L=4 22/140, L=16 38/150, L=64 106/194, L=128 190/242, L=256 389/336
# The forms cross between 100 (S 512) and 180 (S 2048) queries, near the FLOP count's L ~ 170
# (R * (nope + v) a key decompressed against (2R + P) - (nope + P + v) more a query-key pair absorbed).
ABSORBED_MAX_QUERIES = 128


class MultiLinear(nn.Module):
    """One linear map per head, weight [heads, out, in] (mlx-lm's mla.MultiLinear): x [..., heads, L, in]
    -> [..., heads, L, out]; `transpose=False` applies the transposed map, [..., in... out] the other way."""

    def __init__(self, input_dims: int, output_dims: int, num_heads: int):
        super().__init__()
        scale = math.sqrt(1.0 / input_dims)
        self.weight = mx.random.uniform(-scale, scale, (num_heads, output_dims, input_dims))

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        return x @ self.weight.swapaxes(-1, -2) if transpose else x @ self.weight

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine") -> QuantizedMultiLinear:
        """For nn.quantize: each head quantized along its input dimension, as mlx-lm does."""
        return quantize_stacked(QuantizedMultiLinear, self.weight, group_size, bits, mode)


class QuantizedMultiLinear(nn.Module):
    def __init__(
        self, input_dims: int, output_dims: int, num_heads: int, group_size: int = 64, bits: int = 4, mode="affine"
    ):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales, *biases = mx.quantize(
            mx.zeros((num_heads, output_dims, input_dims)), group_size, bits, mode=mode
        )
        if biases:
            self.biases = biases[0]
        self.freeze()

    def __call__(self, x: mx.array, transpose: bool = True) -> mx.array:
        return mx.quantized_matmul(
            x,
            self.weight,
            scales=self.scales,
            biases=self.get("biases"),
            transpose=transpose,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )


def softmax_scale(qk_head_dim: int, rope_scaling: dict | None) -> float:
    """transformers' yarn_apply_mscale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when a
    scaled RoPE sets mscale_all_dim (DeepSeek scales every dimension's logits, not only the rotated)."""
    scale = qk_head_dim**-0.5
    if rope_scaling and rope_scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"])
        scale *= mscale * mscale
    return scale


def split_kv_b(kv_b: mx.array, heads: int, nope: int) -> tuple[mx.array, mx.array]:
    """kv_b_proj [H * (nope + v), R] (or its packed parts, along R) per head: (W_uk^T [H, R, nope],
    embed_q: q_nope -> latent; W_uv [H, v, R], unembed_out: latent -> v)."""
    per_head = kv_b.reshape(heads, -1, kv_b.shape[-1])
    return mx.contiguous(per_head[:, :nope].swapaxes(-1, -2)), mx.contiguous(per_head[:, nope:])


class MultiHeadLatentAttention(nn.Module):
    """MLA over plain sizes (module docstring). `rope_interleave`: the RoPE dimensions come in
    interleaved pairs (transformers' rope_interleave, DeepSeek's layout; MLX's traditional RoPE);
    `rope_scaling`: read_rope_scaling's dict (YaRN with mscale / mscale_all_dim for DeepSeek);
    `norm_eps`: the q_a and kv_a RMSNorms' epsilon (transformers leaves them at 1e-6)."""

    n_kv_heads = 1  # one latent a position, shared by every head

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        attention_bias: bool = False,
        rope_theta: float = 10000.0,
        rope_interleave: bool = True,
        rope_scaling: dict | None = None,
        max_position_embeddings: int | None = None,
        norm_eps: float = 1e-6,
    ):
        super().__init__()
        self.n_heads = num_heads
        self.kv_lora_rank, self.q_lora_rank = kv_lora_rank, q_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.head_dim = kv_lora_rank  # (what code reading head_dim sizes per KV head: the latent)
        self.cache_dims = (kv_lora_rank, qk_rope_head_dim)  # the pool's key and value widths
        self.scale = softmax_scale(qk_nope_head_dim + qk_rope_head_dim, rope_scaling)
        q_width = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, q_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=attention_bias)
            self.q_a_layernorm = nn.RMSNorm(q_lora_rank, eps=norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=attention_bias)
        self.kv_a_layernorm = nn.RMSNorm(kv_lora_rank, eps=norm_eps)
        self.embed_q = MultiLinear(qk_nope_head_dim, kv_lora_rank, num_heads)  # W_uk^T: [H, R, nope]
        self.unembed_out = MultiLinear(kv_lora_rank, v_head_dim, num_heads)  # W_uv: [H, v, R]
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=attention_bias)
        self.rope = RoPE(qk_rope_head_dim, rope_theta, rope_interleave, rope_scaling, max_position_embeddings)
        self.absorbed_max_queries = ABSORBED_MAX_QUERIES  # (a test sets it to run one form throughout)

    @classmethod
    def from_args(cls, args) -> MultiHeadLatentAttention:
        """From a family's args under DeepSeek's config names (DeepSeek V2/V3, Mistral 4)."""
        return cls(
            hidden_size=args.hidden_size,
            num_heads=args.num_attention_heads,
            kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=args.qk_nope_head_dim,
            qk_rope_head_dim=args.qk_rope_head_dim,
            v_head_dim=args.v_head_dim,
            q_lora_rank=args.q_lora_rank,
            attention_bias=args.attention_bias,
            rope_theta=args.rope_theta,
            rope_interleave=args.rope_interleave,
            rope_scaling=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )

    # --- weights ---------------------------------------------------------------------------------

    def fuse(self) -> None:
        """The first query projection and kv_a_proj_with_mqa read the same input: one matmul (after
        the weights are loaded under their own names; not when their biases or quantization differ)."""
        first = "q_a_proj" if self.q_lora_rank is not None else "q_proj"
        fused = fuse_linears([self[first], self.kv_a_proj_with_mqa])
        if fused is not None:
            self.q_kv_a_proj = fused
            delattr(self, first)
            del self.kv_a_proj_with_mqa

    def sanitize(self, weights: dict[str, mx.array], prefix: str) -> dict[str, mx.array]:
        """The checkpoint's `{prefix}.kv_b_proj` [H * (nope + v), R] split per head into embed_q and
        unembed_out (mlx-lm's names: a folder that has them already is left as it is). An MLX-quantized
        kv_b_proj (mlx-lm's deepseek_v2 keeps it whole) gives unembed_out its value rows as they are
        packed (quantized along R, as unembed_out reads them) and embed_q, which runs along the other
        axis, dequantized: the folder's numbers exactly (quantizing them again along nope would not be)."""
        packed = weights.pop(f"{prefix}.kv_b_proj.weight", None)
        if packed is None:
            return weights
        scales = weights.pop(f"{prefix}.kv_b_proj.scales", None)
        biases = weights.pop(f"{prefix}.kv_b_proj.biases", None)
        H, R, nope, v = self.n_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim
        if scales is not None:
            if biases is None:
                raise MlxcelError(f"{prefix}.kv_b_proj: only affine-quantized (scales and biases) is read")
            group, bits = R // scales.shape[-1], packed.shape[-1] * 32 // R
            weight = mx.dequantize(packed, scales, biases, group_size=group, bits=bits)
        else:
            weight = packed
        expected = (H * (nope + v), R)
        if tuple(weight.shape) != expected:
            raise MlxcelError(
                f"{prefix}.kv_b_proj: shape {tuple(weight.shape)}, but the config gives {expected} "
                "(does config.json belong to these weights?)"
            )
        weights[f"{prefix}.embed_q.weight"] = split_kv_b(weight, H, nope)[0]
        parts = {"weight": packed} if scales is None else {"weight": packed, "scales": scales, "biases": biases}
        for name, part in parts.items():  # (packed along R, as unembed_out reads it)
            weights[f"{prefix}.unembed_out.{name}"] = split_kv_b(part, H, nope)[1]
        return weights

    # --- attention -------------------------------------------------------------------------------

    def project(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(queries [B, L, H * (nope + P)], compressed kv [B, L, R + P]) from the block's input."""
        if "q_kv_a_proj" in self:
            first = self.q_lora_rank or self.n_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
            q, kv = mx.split(apply_linear(self.q_kv_a_proj, x), [first], axis=-1)
        else:
            q = apply_linear(self.q_a_proj if self.q_lora_rank is not None else self.q_proj, x)
            kv = apply_linear(self.kv_a_proj_with_mqa, x)
        if self.q_lora_rank is not None:
            q = apply_linear(self.q_b_proj, self.q_a_layernorm(q))
        return q, kv

    def queries(self, q: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array]:
        """[B, L, H * (nope + P)] -> (q_nope, rotated q_pe), [B, H, L, *] each. (The hook for a family
        that scales its queries by position: Mistral 4.)"""
        B, L, _ = q.shape
        q = q.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(q, [self.qk_nope_head_dim], axis=-1)
        return q_nope, self.rope(q_pe, offset)

    def prepare(self, x: mx.array, offset: int | mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(queries in the form their length picks, the latent [B, 1, L, R], the rotated RoPE key
        [B, 1, L, P]): the last two go into the cache as its keys and values."""
        B, L, _ = x.shape
        q, kv = self.project(x)
        q_nope, q_pe = self.queries(q, offset)
        latent, k_pe = mx.split(kv, [self.kv_lora_rank], axis=-1)
        latent = self.kv_a_layernorm(latent).reshape(B, 1, L, self.kv_lora_rank)
        k_pe = self.rope(k_pe.reshape(B, 1, L, self.qk_rope_head_dim), offset)
        if self.is_absorbed(L):
            q_nope = self.embed_q(q_nope)  # [B, H, L, R]: the query in the latent space
        return mx.concatenate([q_nope, q_pe], axis=-1), latent, k_pe

    def attend(self, q: mx.array, latent: mx.array, k_pe: mx.array, mask: Any) -> mx.array:
        """q from prepare, the rows' cached latents [B, 1, S, R] and RoPE keys [B, 1, S, P]. Returns
        [B, H, L, R] (absorbed: still in the latent space) or [B, H, L, v] (plain)."""
        if self.is_absorbed(q.shape[2]):
            keys, values = mx.concatenate([latent, k_pe], axis=-1), latent
        else:
            B, _, S, _ = latent.shape
            k_nope = self.embed_q(latent, transpose=False)  # [B, H, S, nope]
            k_pe = mx.broadcast_to(k_pe, (B, self.n_heads, S, self.qk_rope_head_dim))
            keys, values = mx.concatenate([k_nope, k_pe], axis=-1), self.unembed_out(latent)
        if isinstance(mask, PagedMask):  # the paged cache's own attention (batch-invariant rows)
            return mask.attend(q, keys, values, self.scale)
        return attention(q, keys, values, self.scale, mask=mask)

    def finish(self, out: mx.array) -> mx.array:
        """The attention output back to the residual stream (absorbed: through W_uv first)."""
        B, _, L, _ = out.shape
        if self.is_absorbed(L):
            out = self.unembed_out(out)  # [B, H, L, v]
        if L > 1:  # one token: [B, H, 1, v] is already [B, 1, H * v] in memory
            out = out.transpose(0, 2, 1, 3)
        return apply_linear(self.o_proj, out.reshape(B, L, -1))

    def __call__(self, x: mx.array, mask: Any, cache) -> mx.array:
        q, latent, k_pe = self.prepare(x, cache.rope_offset())
        latent, k_pe = cache.update_and_fetch(latent, k_pe)
        return self.finish(self.attend(q, latent, k_pe, mask))

    def is_absorbed(self, queries: int) -> bool:
        """The form a call of `queries` queries a row attends in (ABSORBED_MAX_QUERIES)."""
        return queries <= self.absorbed_max_queries
