"""A prefill asks for one position's logits (logits_at): the last layer still writes every
position's keys and values, but its MLP runs for that position only (nothing reads the others),
as mlx-lm's lazy prefill computes only what its caches need."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxcel.checkpoints.loader import load_model


def test_logits_at_one_position_equal_the_whole_forward_and_run_one_mlp_row(tiny_llama):
    model = load_model(str(tiny_llama), dtype="float32").model
    ids = mx.array([[(7 * i) % 200 + 3 for i in range(37)]])
    whole_cache, one_cache = model.make_cache(1), model.make_cache(1)
    whole = model(ids, whole_cache)
    last_mlp, seen = model.model.layers[-1].mlp, []
    original = type(last_mlp).__call__

    class Spy(type(last_mlp)):
        def __call__(self, x):
            seen.append(x.shape[1])
            return original(self, x)

    last_mlp.__class__ = Spy
    try:
        one = model(ids, one_cache, logits_at=30)
    finally:
        last_mlp.__class__ = Spy.__mro__[1]
    assert seen == [1]  # the last layer's MLP saw one position
    np.testing.assert_allclose(np.array(one[:, 0]), np.array(whole[:, 30]), atol=1e-5)
    for a, b in zip(whole_cache, one_cache):  # and every position's keys and values are cached
        for x, y in zip(a.state, b.state):
            assert mx.array_equal(x, y)
