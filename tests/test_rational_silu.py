"""rational_silu (models/base.py): silu from multiplies and adds, which MLX's CPU kernels vectorize on
x86-64 Linux where its sigmoid is a scalar libm exp. Against float64 silu, and swiglu's choice."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxcel.models import base


def silu64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / (1.0 + np.exp(-np.maximum(x, -700.0)))  # (exp(700) is finite in float64)


def test_within_a_few_float32_roundings_of_silu():
    x = mx.linspace(-80.0, 80.0, 2_000_001)
    want = silu64(np.array(x))
    got = np.array(base.rational_silu(x))
    assert np.abs(got - want).max() < 4e-6  # float32 silu's own rounding: 1.4e-6
    near = np.abs(np.array(x)) < 4  # where activations live: relative error below 1e-5 (measured 4.7e-6)
    assert (np.abs(got - want)[near] / np.maximum(np.abs(want[near]), 1e-3)).max() < 1e-5
    assert np.array(base.rational_silu(mx.array([-np.inf, 0.0])))[1] == 0.0


def test_swiglu_takes_it_for_large_float32_inputs_on_x86_linux(monkeypatch, on_the_cpu):
    calls, original = [], base.rational_silu
    monkeypatch.setattr(base, "SCALAR_CPU_EXP", True)
    monkeypatch.setattr(base, "rational_silu", lambda x: calls.append(x.size) or original(x))
    gate, up = mx.random.normal((3, 40, 1024)), mx.random.normal((3, 40, 1024))
    np.testing.assert_allclose(np.array(base.swiglu(gate, up)), np.array(nn.silu(gate) * up), atol=2e-5)
    assert calls == [gate.size]
    base.swiglu(gate[:, :1], up[:, :1])  # a decode step's few elements: the exps are cheaper than its ops
    base.swiglu(gate.astype(mx.bfloat16), up.astype(mx.bfloat16))
    assert calls == [gate.size]
    monkeypatch.setattr(base, "SCALAR_CPU_EXP", False)
    base.swiglu(gate, up)
    assert calls == [gate.size]


@pytest.mark.parametrize("value", [-1e4, -30.0, -9.5, 0.0, 1e-3, 9.5, 30.0, 1e4])
def test_its_tails(value):
    got = float(base.rational_silu(mx.array([value]))[0])
    assert abs(got - float(silu64(np.array([value]))[0])) <= 4e-6 * max(1.0, abs(value))
