"""Scaled dot-product attention for an x86-64 Linux CPU, where MLX's softmax takes one scalar libm
exp an element (its SIMD paths are ARM's): over a prefill piece's [heads, queries, keys] scores
that exp was most of attention's time (docs/benchmarks.md). Here the exp is 2^t from a polynomial
and an exponent written into the float's bits: multiplies and adds that MLX's CPU kernels
vectorize. The queries go in blocks whose scores stay in the cache (each of the dozen elementwise
passes over scores that do not fit costs a trip to memory). Every float32 score tensor takes it,
whatever its size, so a row's attention runs the same code alone and in a batch (a cut by size
once sent a row alone to the fast kernel and the same row in a batch here: its logprobs differed
in the last bits). Everywhere else `attention` is mx.fast.scaled_dot_product_attention."""

from __future__ import annotations

import math

import mlx.core as mx

from mlxcel.models import base

# score elements a block of queries computes at once (512 KB of float32): its passes stay in cache
# (2-core VM, 9 heads, [256 queries x 512 keys]: blocks of 2^17 ~10 ms, 2^20 ~20, the fast kernel 17)
BLOCK_SCORES = 1 << 17
LOG2E = 1.4426950408889634
# 2^f on [-0.5, 0.5]: Taylor terms ln(2)^k / k!, relative error <= 2.6e-7 after range reduction
EXP2_TERMS = (
    1.0,
    0.6931471805599453,
    0.2402265069591007,
    0.05550410866482158,
    0.009618129107628477,
    0.0013333558146428443,
    0.00015403530393381606,
)
ROUNDING = 12582912.0  # 1.5 * 2^23: t + ROUNDING rounds t to an integer kept in the low mantissa bits
EXPONENT_BIAS = 127 - 0x4B400000  # that integer's float32 bits (0x4B400000 + n) -> n + 127


def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: mx.array | str | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """mx.fast.scaled_dot_product_attention's contract: q/k [B, H|KV, L|S, D], v [B, KV, S, DV] (H a
    multiple of KV), mask None, "causal" (the last query sees every key) or an array broadcasting to
    [B, H, L, S] (boolean: True attends; else added to the scores), sinks [H] logits in every
    query's softmax."""
    if takes_poly_exp(q):
        return blocked_attention(q, k, v, scale, mask, sinks)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


def takes_poly_exp(q: mx.array) -> bool:
    # (2-core VM, 9 heads x 64 over 3, fast kernel / blocked form ms: one decode row over 64 keys
    # 0.10 / 0.16, over 300 0.30 / 0.35, over 600 0.52 / 0.42; 8 rows over 64 keys 0.49 / 0.41, over
    # 300 1.51 / 0.80; causal [128 x 256] 9.9 / 4.4: a lone short row pays ~0.05 ms a layer for sameness)
    return base.SCALAR_CPU_EXP and q.dtype == mx.float32 and mx.default_device() == mx.cpu


def exp2(t: mx.array) -> mx.array:
    """2^t for t <= 0 (float32), within 2.6e-7 relative from -126 up; exactly 0 below -126.5 (a
    masked score's weight: a tiny nonzero one made the weights-by-values matmul run on subnormal
    products, ~2x slower on x86; the softmax's sum is at least 1, so such weights are below
    float32's resolution of it)."""
    t = mx.maximum(t, -127.0)  # 2^-127's exponent field is 0: the scale below is +0.0
    shifted = t + ROUNDING
    f = t - (shifted - ROUNDING)
    p = f * EXP2_TERMS[6] + EXP2_TERMS[5]
    for c in EXP2_TERMS[4::-1]:
        p = p * f + c
    return p * mx.view((mx.view(shifted, mx.int32) + EXPONENT_BIAS) << 23, mx.float32)


def blocked_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None,
) -> mx.array:
    batch, heads, queries, dims = q.shape
    kv_heads, keys, value_dims = k.shape[1], k.shape[2], v.shape[-1]
    group = heads // kv_heads
    # scores in base 2: scale * log2(e) folded into the queries
    q = (q * (scale * LOG2E)).reshape(batch, kv_heads, group, queries, dims)
    k_t = k.swapaxes(-1, -2)
    if isinstance(mask, mx.array):
        mask = mask if mask.dtype == mx.bool_ else mask * LOG2E
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)  # [B|1, H|1, L|1, S]
        if mask.shape[1] != 1:
            mask = mask.reshape(mask.shape[0], kv_heads, group, *mask.shape[2:])
        else:
            mask = mx.expand_dims(mask, 2)
    if sinks is not None:
        sinks = (sinks.astype(mx.float32) * LOG2E).reshape(1, kv_heads, group, 1, 1)
    if isinstance(mask, str):  # "causal": query i sees keys up to keys - queries + i
        key_positions = mx.arange(keys)[None]
    step = max(1, BLOCK_SCORES // (batch * heads * keys))
    outs = []
    for start in range(0, queries, step):
        stop = min(queries, start + step)
        rows = stop - start
        # causal: the block's last query sees no key past keys - queries + stop (the rest are skipped)
        span = min(keys, keys - queries + stop) if isinstance(mask, str) else keys
        block_k_t, block_v = (k_t, v) if span == keys else (k_t[..., :span], v[:, :, :span])
        scores = q[:, :, :, start:stop].reshape(batch, kv_heads, group * rows, dims) @ block_k_t
        scores = scores.reshape(batch, kv_heads, group, rows, span)
        if isinstance(mask, str):
            seen = key_positions[:, :span] <= mx.arange(start, stop)[:, None] + (keys - queries)
            scores = mx.where(seen, scores, -math.inf)
        elif isinstance(mask, mx.array):
            part = mask if mask.shape[3] == 1 else mask[:, :, :, start:stop]
            scores = mx.where(part, scores, -math.inf) if part.dtype == mx.bool_ else scores + part
        top = scores.max(-1, keepdims=True)
        if sinks is not None:
            top = mx.maximum(top, sinks)
        weights = exp2(scores - top)
        total = weights.sum(-1, keepdims=True)
        if sinks is not None:
            total = total + exp2(sinks - top)
        out = weights.reshape(batch, kv_heads, group * rows, span) @ block_v
        outs.append(out.reshape(batch, kv_heads, group, rows, value_dims) / total)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return out.reshape(batch, heads, queries, value_dims)
