"""Mistral (sliding window on every layer) and the rotating KV cache, against transformers."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.models.rotating_cache import RotatingKVCache
from tests.family_fixtures import (
    PROMPT,
    assert_batch_rows_match_alone,
    assert_parity,
    assert_pieces_match_one_shot,
    make_family_checkpoint,
)

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory):
    return make_family_checkpoint(tmp_path_factory.mktemp("tiny_mistral"), "mistral", seed=3)


@pytest.fixture(scope="module")
def mistral_parity(tiny_mistral):
    return assert_parity(tiny_mistral)


def test_mistral_matches_transformers_past_the_window(mistral_parity):
    """The 40-token prompt and 32 greedy tokens run far past the 16-position window."""
    model = mistral_parity["model"]
    assert model.layer_windows == [16, 16]


def test_mistral_cache_keeps_only_the_window(mistral_parity):
    model = mistral_parity["model"]
    cache = model.make_cache(1)
    model(mx.array([PROMPT]), cache)
    for token in range(30):
        model(mx.array([[token + 5]]), cache)
    assert all(isinstance(c, RotatingKVCache) for c in cache)
    assert cache[0].offset == 70 and cache[0].keys.shape[2] == 16


def test_mistral_batch_rows_match_alone(mistral_parity):
    prompts = [PROMPT, PROMPT[5:28], PROMPT[:9], PROMPT[3:34]]
    assert_batch_rows_match_alone(mistral_parity["model"], prompts)


@pytest.mark.parametrize("piece,tile", [(7, None), (12, 8), (16, 16), (5, 4)])
def test_mistral_pieces_match_one_shot(mistral_parity, piece, tile):
    assert mistral_parity["model"].supports_multi_piece_prefill and mistral_parity["model"].supports_padded_prefill
    assert_pieces_match_one_shot(mistral_parity["model"], PROMPT, piece, tile)


def test_mistral_without_window_is_llama(tmp_path):
    folder = make_family_checkpoint(tmp_path / "m", "mistral", seed=4, sliding_window=None)
    result = assert_parity(folder)
    assert result["model"].layer_windows == [None, None]


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


def test_compiled_decode_falls_back_to_the_eager_step_on_sliding_window_layers(mistral_parity, monkeypatch):
    from mlxcel.engine.compiled import CompiledDecoder
    from tests.family_fixtures import mlxcel_generate

    model = mistral_parity["model"]
    assert not CompiledDecoder.can_drive(model.make_cache(1))  # rotating caches
    eager = mlxcel_generate(model, [PROMPT], 8)
    monkeypatch.setenv("MLXCEL_COMPILE", "1")
    assert mlxcel_generate(model, [PROMPT], 8) == eager
