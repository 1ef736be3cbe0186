"""models/cpu_attention.py: attention whose softmax takes a polynomial 2^t (x86-64 Linux CPUs, where
MLX's exp is a scalar libm call an element), against mx.fast.scaled_dot_product_attention for every
mask kind the models pass, sinks, grouped heads, MLA's narrower values and query blocks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.models import base, cpu_attention


def test_exp2_is_within_float32_rounding():
    t = np.linspace(-126.0, 0.0, 1_000_001, dtype=np.float32)
    got = np.array(cpu_attention.exp2(mx.array(t))).astype(np.float64)
    want = np.exp2(t.astype(np.float64))
    assert (np.abs(got - want) / want).max() < 3e-7
    assert float(cpu_attention.exp2(mx.array([0.0]))[0]) == 1.0
    # a masked score's weight is exactly 0 (a subnormal one slows the matmul after it)
    assert np.array(cpu_attention.exp2(mx.array([-np.inf, -1e9, -127.0, -126.6]))).tolist() == [0.0] * 4


def draw(batch, heads, kv_heads, queries, keys, dims, value_dims=None):
    mx.random.seed(queries * 7 + keys)
    q = mx.random.normal((batch, heads, queries, dims))
    k = mx.random.normal((batch, kv_heads, keys, dims))
    v = mx.random.normal((batch, kv_heads, keys, value_dims or dims))
    return q, k, v


def masks(batch, heads, queries, keys):
    seen = mx.random.uniform(shape=(batch, 1, queries, keys)) > 0.3
    seen = seen | (mx.arange(keys) == 0)  # every query sees a key
    additive = mx.where(seen, 0.0, -mx.inf) + 0.1 * mx.random.normal(seen.shape)
    return {
        "none": None,
        "causal": "causal",
        "boolean": seen,
        "additive": additive,
        "additive per head": mx.broadcast_to(additive, (batch, heads, queries, keys)),
        "2-d": additive[0, 0],
    }


@pytest.mark.parametrize(
    "shape",
    [
        (1, 9, 3, 128, 256, 64, None),
        (2, 8, 2, 37, 100, 32, None),
        (1, 4, 4, 30, 30, 16, None),
        (3, 6, 1, 5, 40, 24, 16),
    ],
    ids=["smollm2-piece", "gqa-batch", "mha-square", "mla-values"],
)
@pytest.mark.parametrize("block_scores", [1 << 17, 500])  # 500: a block of a query or a few
def test_matches_mlx_for_every_mask_and_sinks(shape, block_scores, monkeypatch):
    monkeypatch.setattr(cpu_attention, "BLOCK_SCORES", block_scores)
    batch, heads, kv_heads, queries, keys, dims, value_dims = shape
    q, k, v = draw(batch, heads, kv_heads, queries, keys, dims, value_dims)
    sinks = mx.random.normal((heads,))
    for name, mask in masks(batch, heads, queries, keys).items():
        for with_sinks in (None, sinks):
            want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask, sinks=with_sinks)
            got = cpu_attention.blocked_attention(q, k, v, 0.3, mask, with_sinks)
            assert got.shape == want.shape
            error = mx.abs(got - want).max().item()
            assert error < 2e-5, (name, with_sinks is not None, error)


def test_attention_takes_it_for_every_float32_score_tensor_on_x86_linux_cpus(monkeypatch, on_the_cpu):
    calls, original = [], cpu_attention.blocked_attention
    monkeypatch.setattr(cpu_attention, "blocked_attention", lambda *a: calls.append(a[0].shape) or original(*a))
    monkeypatch.setattr(base, "SCALAR_CPU_EXP", True)
    piece = draw(1, 9, 3, 128, 256, 64)
    np.testing.assert_allclose(
        np.array(cpu_attention.attention(*piece, 0.125, mask="causal")),
        np.array(mx.fast.scaled_dot_product_attention(*piece, scale=0.125, mask="causal")),
        atol=2e-5,
    )
    cpu_attention.attention(*draw(1, 9, 3, 1, 16, 64), 0.125)  # a lone row's short decode too: as in a batch
    assert calls == [(1, 9, 128, 64), (1, 9, 1, 64)]
    cpu_attention.attention(*(x.astype(mx.bfloat16) for x in piece), 0.125)
    monkeypatch.setattr(base, "SCALAR_CPU_EXP", False)
    cpu_attention.attention(*piece, 0.125)
    assert calls == [(1, 9, 128, 64), (1, 9, 1, 64)]
