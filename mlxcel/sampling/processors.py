"""The stateless stages of the chain (docs/sampling.md), batch-wide on [B, V] float32 logits.

A removed candidate is a logit of -inf; "the candidates" are the finite logits. Truncations keep
every token whose value ties the last one kept (a threshold, never a sort position), so equal
logits are treated alike and no stage depends on a sort's tie order. No host read anywhere.

The truncations (MASKING_STAGES) also take the model's bf16/fp16 logits as they are: they only
compare, sort and select values, which is exact in any dtype, and do their arithmetic (exp,
sums, thresholds) in float32, so they give the same result as on the float32 copy while
sorting and reducing half the bytes (on the H200 at batch 32 x 152k, the sort is most of top-p).
"""

from __future__ import annotations

import math

import mlx.core as mx

NEG_INF = -math.inf


# The stages that only remove candidates: they run on the logits' own dtype (see above).
MASKING_STAGES = frozenset({"top_n_sigma", "top_k", "typical_p", "top_p", "min_p", "xtc"})


def is_candidate(x: mx.array) -> mx.array:
    return x > NEG_INF


def remove_below(x: mx.array, threshold: mx.array) -> mx.array:
    return mx.where(x >= threshold, x, NEG_INF)


def count_candidates(x: mx.array) -> mx.array:
    return is_candidate(x).sum(axis=-1, keepdims=True)


def softmax_candidates(x: mx.array) -> mx.array:
    """Probabilities over the candidates (0 for removed ones), safe when all are removed."""
    x = x.astype(mx.float32)
    top = mx.max(x, axis=-1, keepdims=True)
    e = mx.exp(x - mx.where(is_candidate(top), top, 0.0))
    return e / mx.maximum(e.sum(axis=-1, keepdims=True), 1e-38)


def entropy(p: mx.array) -> mx.array:
    return -mx.where(p > 0, p * mx.log(mx.maximum(p, 1e-38)), 0.0).sum(axis=-1, keepdims=True)


def kth_largest(x: mx.array, k: int) -> mx.array:
    """[B, 1]: the k-th largest value of each row (1-based)."""
    return mx.min(mx.topk(x, k, axis=-1), axis=-1, keepdims=True)


def sort_descending(x: mx.array) -> mx.array:
    return -mx.sort(-x, axis=-1)


def take_at(sorted_x: mx.array, count: mx.array) -> mx.array:
    """The value at 1-based position `count` [B, 1] of each sorted row."""
    index = mx.clip(count - 1, 0, sorted_x.shape[-1] - 1).astype(mx.int32)
    return mx.take_along_axis(sorted_x, index, axis=-1)


NEG_INF_BITS = 0xFF800000  # float32 -inf


def apply_token_bitmask(x: mx.array, bitmask: mx.array) -> mx.array:
    """Structured output's mask, before every stage: bit t of bitmask[b, t // 32] (int32,
    llguidance's layout; rows past the logits' are not read) allows token t of row b; the others
    become -inf. Plain MLX ops, so it runs on every backend (llguidance's own MLX glue is a Metal
    kernel). The mask is added as a bias of 0 or -inf (bits of float32 -inf times "not allowed"):
    MLX's CPU `where` over a [32, 128k] batch took 16 ms against 4.5 ms for this (docs/benchmarks.md)."""
    # (the bit positions are made here: an array made at import belongs to the importing thread's
    # stream, and a server samples on its engine thread)
    words = bitmask[: x.shape[0]].view(mx.uint32)  # (a MaskBuffer has rows for the largest batch)
    allowed = (words[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
    allowed = allowed.reshape(words.shape[0], -1)[:, : x.shape[-1]]
    bias = ((1 - allowed) * NEG_INF_BITS).view(mx.float32)
    return x + bias.astype(x.dtype)


def apply_logit_bias(x: mx.array, bias: mx.array) -> mx.array:
    return x + bias  # bias: [V], -inf for suppressed tokens (and EOS with ignore_eos)


def apply_top_n_sigma(x: mx.array, n: float) -> mx.array:
    """Keep logit >= max - n*sigma over the finite logits (population std)."""
    keep = is_candidate(x)
    x32 = x.astype(mx.float32)
    count = mx.maximum(keep.sum(axis=-1, keepdims=True), 1)
    mean = mx.where(keep, x32, 0.0).sum(axis=-1, keepdims=True) / count
    std = mx.sqrt(mx.where(keep, (x32 - mean) ** 2, 0.0).sum(axis=-1, keepdims=True) / count)
    return remove_below(x, mx.max(x32, axis=-1, keepdims=True) - n * std)


def apply_top_k(x: mx.array, k: int, min_keep: int) -> mx.array:
    k = max(k, min_keep)
    if k >= x.shape[-1]:
        return x
    return remove_below(x, kth_largest(x, k))


def apply_typical_p(x: mx.array, p: float, min_keep: int) -> mx.array:
    """Keep candidates in order of increasing |-ln p_i - H| until the mass exceeds p (min_keep at least)."""
    probs = softmax_candidates(x)
    score = mx.where(probs > 0, mx.abs(-mx.log(mx.maximum(probs, 1e-38)) - entropy(probs)), math.inf)
    order = mx.argsort(score, axis=-1)
    sorted_score = mx.take_along_axis(score, order, axis=-1)
    mass_before = mx.cumsum(mx.take_along_axis(probs, order, axis=-1), axis=-1, inclusive=False)
    position = mx.arange(x.shape[-1])
    kept = ((mass_before <= p) | (position < min_keep)).sum(axis=-1, keepdims=True)
    return mx.where(score <= take_at(sorted_score, kept), x, NEG_INF)


def apply_top_p(x: mx.array, p: float, min_keep: int) -> mx.array:
    """The smallest prefix of the sorted candidates whose mass reaches p (min_keep at least).

    Sorted ascending, with the mass of the more probable entries as a reverse cumulative sum:
    one sort and one scan, no negated copies and no separate max or sum passes over the
    vocabulary (at batch 32 x 152k on the H200 those passes cost more than the sort)."""
    vocab = x.shape[-1]
    ascending = mx.sort(x, axis=-1)  # removed candidates (-inf) first, the most probable last
    ascending32 = ascending.astype(mx.float32)
    top = ascending32[..., -1:]
    weights = mx.exp(ascending32 - mx.where(is_candidate(top), top, 0.0))
    mass_above = mx.cumsum(weights, axis=-1, reverse=True, inclusive=False)
    total = mass_above[..., :1] + weights[..., :1]
    rank = (vocab - 1) - mx.arange(vocab)  # 0 for the most probable
    kept = ((mass_above < p * total) | (rank < max(min_keep, 1))).sum(axis=-1, keepdims=True)
    return remove_below(x, mx.take_along_axis(ascending, (vocab - kept).astype(mx.int32), axis=-1))


def apply_min_p(x: mx.array, p: float, min_keep: int) -> mx.array:
    threshold = mx.max(x, axis=-1, keepdims=True).astype(mx.float32) + math.log(p)
    if min_keep > 1:
        threshold = mx.minimum(threshold, kth_largest(x, min(min_keep, x.shape[-1])))
    return remove_below(x, threshold)


def apply_xtc(x: mx.array, u: mx.array, probability: float, threshold: float, min_keep: int) -> mx.array:
    """When the row's gate u [B, 1] <= probability: remove every candidate with p >= threshold
    except the least probable of them, if at least two are above it and min_keep remain."""
    # p >= threshold as x - logsumexp(x) >= log(threshold): one reduction instead of the
    # softmax's two (max, sum) and no divided copy of the vocabulary.
    above = (
        x - mx.logsumexp(x.astype(mx.float32), axis=-1, keepdims=True) >= math.log(threshold)
        if threshold > 0
        else is_candidate(x)
    )
    least = mx.min(mx.where(above, x, math.inf), axis=-1, keepdims=True)
    fire = u <= probability
    # "At least two above" needs no count: with one above, it is the least and nothing is > it.
    # min_keep <= 1 always holds (n_candidates - (n_above - 1) >= 1), so only a larger one counts.
    if min_keep > 1:
        n_above = above.sum(axis=-1, keepdims=True)
        fire = fire & (count_candidates(x) - (n_above - 1) >= min_keep)
    return mx.where(fire & above & (x > least), NEG_INF, x)


def apply_temperature(x: mx.array, value: float) -> mx.array:
    return x * (1.0 / value)


def apply_dynamic_temperature(x: mx.array, value: float, spread: float, exponent: float) -> mx.array:
    """T = max(0, T - range) + 2*range*(H / ln N)^exponent over the N candidates; T = 0 keeps the max."""
    count = count_candidates(x)
    normalized = entropy(softmax_candidates(x)) / mx.log(mx.maximum(count, 2).astype(mx.float32))
    temperature = max(0.0, value - spread) + 2.0 * spread * mx.power(normalized, exponent)
    top = mx.max(x, axis=-1, keepdims=True)
    scaled = mx.where(temperature > 0, x / mx.maximum(temperature, 1e-30), mx.where(x >= top, x, NEG_INF))
    return mx.where(count > 1, scaled, x)
