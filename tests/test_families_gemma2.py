"""Gemma 2 (soft-capping, alternating sliding window, pre/post norms) against transformers."""

from __future__ import annotations

import pytest

from tests.family_fixtures import (
    PROMPT,
    assert_batch_rows_match_alone,
    assert_parity,
    assert_pieces_match_one_shot,
    make_family_checkpoint,
)

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def gemma2_parity(tmp_path_factory):
    return assert_parity(make_family_checkpoint(tmp_path_factory.mktemp("tiny_gemma2"), "gemma2", seed=8))


def test_gemma2_matches_transformers(gemma2_parity):
    model = gemma2_parity["model"]
    assert model.args.tie_word_embeddings and "lm_head" not in model
    assert model.eos_token_ids() == [2]


def test_gemma2_batch_rows_match_alone(gemma2_parity):
    assert_batch_rows_match_alone(gemma2_parity["model"], [PROMPT, PROMPT[6:30], PROMPT[:11], PROMPT[2:39]])


@pytest.mark.parametrize("piece,tile", [(16, None), (12, 8)])
def test_gemma2_pieces_match_one_shot(gemma2_parity, piece, tile):
    assert_pieces_match_one_shot(gemma2_parity["model"], PROMPT, piece, tile)


def test_gemma2_layers_alternate_window_and_cache(gemma2_parity):
    from mlxcel.models.cache import KVCache
    from mlxcel.models.rotating_cache import RotatingKVCache

    model = gemma2_parity["model"]
    assert model.layer_windows == [16, None, 16, None]
    assert [type(c) for c in model.make_cache()] == [RotatingKVCache, KVCache, RotatingKVCache, KVCache]


def test_gemma2_without_softcaps_matches_transformers(tmp_path):
    folder = make_family_checkpoint(
        tmp_path / "g", "gemma2", seed=9, attn_logit_softcapping=None, final_logit_softcapping=None
    )
    assert_parity(folder)
