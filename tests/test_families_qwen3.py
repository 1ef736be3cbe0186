"""Qwen3 (q/k RMSNorm per head) against transformers."""

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
def qwen3_parity(tmp_path_factory):
    return assert_parity(make_family_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", seed=5))


def test_qwen3_matches_transformers(qwen3_parity):
    attn = qwen3_parity["model"].model.layers[0].self_attn
    assert "qkv_proj" in attn and attn.q_norm.weight.shape == (32,)  # head_dim 32 != hidden / heads
    assert qwen3_parity["model"].eos_token_ids() == [2]


def test_qwen3_batch_rows_match_alone(qwen3_parity):
    assert_batch_rows_match_alone(qwen3_parity["model"], [PROMPT, PROMPT[4:21], PROMPT[:7]])


@pytest.mark.parametrize("piece,tile", [(16, None), (12, 8)])
def test_qwen3_pieces_match_one_shot(qwen3_parity, piece, tile):
    assert_pieces_match_one_shot(qwen3_parity["model"], PROMPT, piece, tile)


def test_qwen3_sliding_window_layers_match_transformers(tmp_path):
    folder = make_family_checkpoint(
        tmp_path / "q", "qwen3", seed=6, use_sliding_window=True, sliding_window=12, max_window_layers=1
    )
    result = assert_parity(folder)
    assert result["model"].layer_windows == [None, 12]
