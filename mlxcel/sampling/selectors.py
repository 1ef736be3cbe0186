"""The draws (docs/sampling.md, step 10): greedy, categorical, mirostat v1/v2, adaptive-p.

Every draw is Gumbel-max over the logits it samples from (an exact draw from their softmax),
with the row's own noise (rng.py, from the step keys [B, KEY_WORDS]): one CUDA kernel on MLX's
CUDA backend (cuda_draw.py), the same hash and ops as an MLX graph elsewhere. The stateful ones
keep their state ([B] arrays) on the device and update it from the drawn token there, so
decoding never waits on the host for them.
Each returns (tokens [B], the logits of the distribution drawn from, new state).
"""

from __future__ import annotations

import math

import mlx.core as mx

from mlxcel.sampling import cuda_draw
from mlxcel.sampling.processors import (
    NEG_INF,
    remove_below,
    softmax_candidates,
    sort_descending,
    take_at,
)
from mlxcel.sampling.rng import gumbel_from_step_keys

MIROSTAT_M = 100
LN2 = math.log(2.0)


def draw_greedy(x: mx.array) -> mx.array:
    return mx.argmax(x, axis=-1)


def draw_categorical(x: mx.array, step_keys: mx.array) -> mx.array:
    if cuda_draw.is_available():
        return cuda_draw.gumbel_max(x, step_keys)
    return graph_gumbel_max(x, step_keys)


def graph_gumbel_max(x: mx.array, step_keys: mx.array) -> mx.array:
    return mx.argmax(x + gumbel_from_step_keys(step_keys, x.shape[-1]), axis=-1)


def take_token(values: mx.array, tokens: mx.array) -> mx.array:
    return mx.take_along_axis(values, tokens[:, None], axis=-1)[:, 0]


def log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def surprise_bits(z: mx.array, tokens: mx.array) -> mx.array:
    """-log2 p(token) in the distribution softmax(z)."""
    return -take_token(log_softmax(z), tokens) / LN2


def draw_mirostat_v2(x: mx.array, step_keys: mx.array, mu: mx.array, tau: float, eta: float):
    """Keep the candidates with surprise -log2 p <= mu (the most probable at least), draw, and
    move mu by eta times the observed surprise (after renormalisation) minus tau."""
    surprise = -mx.log(mx.maximum(softmax_candidates(x), 1e-38)) / LN2
    top = mx.max(x, axis=-1, keepdims=True)
    z = mx.where((surprise <= mu[:, None]) | (x >= top), x, NEG_INF)
    tokens = draw_categorical(z, step_keys)
    return tokens, z, mu - eta * (surprise_bits(z, tokens) - tau)


def draw_mirostat_v1(x: mx.array, step_keys: mx.array, mu: mx.array, tau: float, eta: float):
    """Estimate the Zipf exponent s from the top m=100 probabilities, keep the top k =
    (e 2^mu / (1 - N^-e))^(1/s) (e = s - 1, N the vocabulary size), draw, update mu."""
    vocab = x.shape[-1]
    m = min(MIROSTAT_M, vocab)
    top = sort_descending(mx.topk(x, m, axis=-1))
    i = mx.arange(m - 1, dtype=mx.float32)
    t = mx.log((i + 2) / (i + 1))
    b = top[:, :-1] - top[:, 1:]  # ln(p_i / p_(i+1)): the normaliser cancels
    pair = top[:, 1:] > NEG_INF
    s = mx.where(pair, t * b, 0.0).sum(axis=-1) / mx.maximum(mx.where(pair, t * t, 0.0).sum(axis=-1), 1e-30)
    e = s - 1
    k = mx.power(e * mx.power(2.0, mu) / (1 - mx.power(float(vocab), -e)), 1 / s)
    k = mx.where(mx.isnan(k), 1.0, mx.clip(k, 1.0, float(vocab)))  # llama.cpp: max(int(k), 1)
    k = mx.floor(k).astype(mx.int32)[:, None]
    z = remove_below(x, take_at(sort_descending(x), k))
    tokens = draw_categorical(z, step_keys)
    return tokens, z, mu - eta * (surprise_bits(z, tokens) - tau)


def transform_adaptive_p(x: mx.array, weight: mx.array, total: mx.array, target: float) -> tuple[mx.array, mx.array]:
    """(the reshaped logits, the candidates' original probabilities)."""
    probs = softmax_candidates(x)
    aim = mx.clip(2 * min(max(target, 0.0), 1.0) - weight / total, 0.0, 1.0)[:, None]
    d = mx.abs(probs - aim) / 0.3
    return mx.where(x > NEG_INF, 5 - 10 * d * d / (1 + d), NEG_INF), probs


def draw_adaptive_p(x: mx.array, step_keys: mx.array, weight: mx.array, total: mx.array, target: float, decay: float):
    z, probs = transform_adaptive_p(x, weight, total, target)
    tokens = draw_categorical(z, step_keys)
    return tokens, z, take_token(probs, tokens) + decay * weight, 1 + decay * total


def clamp_decay(decay: float) -> float:
    return min(max(decay, 0.0), 0.99)
