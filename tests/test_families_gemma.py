"""Gemma (scaled embeddings, 1 + weight RMSNorm, GeGLU) against transformers."""

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
def gemma_parity(tmp_path_factory):
    return assert_parity(make_family_checkpoint(tmp_path_factory.mktemp("tiny_gemma"), "gemma", seed=7))


def test_gemma_matches_transformers(gemma_parity):
    model = gemma_parity["model"]
    assert model.args.tie_word_embeddings and "lm_head" not in model
    assert model.eos_token_ids() == [2]


def test_gemma_batch_rows_match_alone(gemma_parity):
    assert_batch_rows_match_alone(gemma_parity["model"], [PROMPT, PROMPT[6:30], PROMPT[:11]])


@pytest.mark.parametrize("piece,tile", [(16, None), (12, 8)])
def test_gemma_pieces_match_one_shot(gemma_parity, piece, tile):
    assert_pieces_match_one_shot(gemma_parity["model"], PROMPT, piece, tile)
