"""Mistral's sliding window: the rotating KV cache on its own (the family against transformers is in
tests/test_text_families.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.models.rotating_cache import RotatingKVCache

pytest.importorskip("torch")


def test_rotating_cache_returns_the_window_in_ring_order():
    cache = RotatingKVCache(4)
    values = [mx.full((1, 1, 1, 2), float(p)) for p in range(10)]
    keys, _ = cache.update_and_fetch(mx.concatenate(values[:6], axis=2), mx.concatenate(values[:6], axis=2))
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5]  # a piece sees all it needs
    for p in range(6, 10):
        keys, _ = cache.update_and_fetch(values[p], values[p])
        assert sorted(keys[0, 0, :, 0].tolist()) == list(range(p - 3, p + 1))
    cache.update_and_fetch(mx.concatenate(values[:2], axis=2), mx.concatenate(values[:2], axis=2))
    assert cache.start == 7 and cache.offset == 12  # back to linear: the last 3 kept before the piece


def test_rotating_cache_refuses_to_trim_the_ring():
    from mlxcel.errors import MlxcelError

    cache = RotatingKVCache(4)
    cache.update_and_fetch(mx.zeros((1, 1, 1, 2)), mx.zeros((1, 1, 1, 2)))
    with pytest.raises(MlxcelError, match="cannot trim"):
        cache.trim(1)
    np.testing.assert_equal(cache.offset, 1)
