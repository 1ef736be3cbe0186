"""Phi-3 / Phi-4 (fused qkv_proj and gate_up_proj, partial rotary, longrope, sliding window)
against transformers."""

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


def longrope(pairs: int, original: int) -> dict:
    return {
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(pairs)],
            "long_factor": [2.0 + 1.5 * i for i in range(pairs)],
        },
        "original_max_position_embeddings": original,
        "max_position_embeddings": 256,
    }


@pytest.fixture(scope="module")
def phi3_parity(tmp_path_factory):
    return assert_parity(make_family_checkpoint(tmp_path_factory.mktemp("tiny_phi3"), "phi3", seed=13))


@pytest.fixture(scope="module")
def phi4_mini_parity(tmp_path_factory):
    """Phi-4-mini's shape: partial rotary (here half the head) and longrope whose long factors
    start mid-decode (40 prompt + 32 generated > 64 positions), as transformers switches."""
    folder = make_family_checkpoint(
        tmp_path_factory.mktemp("tiny_phi4_mini"),
        "phi3",
        seed=14,
        partial_rotary_factor=0.5,
        tie_word_embeddings=True,
        **longrope(4, 64),
    )
    return assert_parity(folder)


def test_phi3_loads_the_fused_checkpoint_projections(phi3_parity, monkeypatch, tmp_path):
    layer = phi3_parity["model"].model.layers[0]
    assert layer.self_attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 16, 64) and "q_proj" not in layer.self_attn
    assert layer.mlp.gate_up_proj.weight.shape == (2 * 128, 64)
    assert phi3_parity["model"].layer_windows == [None, None] and phi3_parity["model"].supports_compiled_decode


def test_phi4_mini_partial_rotary_longrope_switches_mid_decode(phi4_mini_parity):
    rope = phi4_mini_parity["model"].model.layers[0].self_attn.rope
    assert rope.dims == 8 and rope.original_max == 64 and rope.attention_factor > 1.0
    assert phi4_mini_parity["model"].supports_compiled_decode is False


def test_phi3_longrope_past_the_original_context_from_the_prompt(tmp_path):
    folder = make_family_checkpoint(tmp_path / "p", "phi3", seed=15, **longrope(8, 32))
    assert_parity(folder)


def test_phi3_mini_4k_sliding_window(tmp_path):
    folder = make_family_checkpoint(tmp_path / "p", "phi3", seed=16, sliding_window=16)
    result = assert_parity(folder)
    assert result["model"].layer_windows == [16, 16]
    assert_pieces_match_one_shot(result["model"], PROMPT, 12, 8)


def test_phi3_batch_rows_match_alone(phi3_parity, phi4_mini_parity):
    prompts = [PROMPT, PROMPT[6:30], PROMPT[:11], PROMPT[2:39]]
    assert_batch_rows_match_alone(phi3_parity["model"], prompts)
    assert_batch_rows_match_alone(phi4_mini_parity["model"], prompts, n=30)  # rows cross 64 positions


@pytest.mark.parametrize("piece,tile", [(16, None), (12, 8)])
def test_phi3_pieces_match_one_shot(phi3_parity, piece, tile):
    assert phi3_parity["model"].supports_padded_prefill
    assert_pieces_match_one_shot(phi3_parity["model"], PROMPT, piece, tile)


@pytest.mark.parametrize("prompt_length", [40, 80])
def test_phi3_longrope_pieces_match_one_shot_across_the_switch(phi4_mini_parity, prompt_length):
    """Pieces of 24 over an 80-token prompt cross 64 positions in the third piece."""
    model = phi4_mini_parity["model"]
    assert model.supports_multi_piece_prefill and not model.supports_padded_prefill
    assert_pieces_match_one_shot(model, (PROMPT * 2)[:prompt_length], 24, None)


def test_phi3_longrope_without_factors_is_a_clear_error():
    from mlxcel.errors import MlxcelError
    from mlxcel.models import phi3

    config = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 300,
        "rope_scaling": {"type": "su", "short_factor": [1.0] * 8},
    }
    with pytest.raises(MlxcelError, match="long_factor"):
        phi3.ModelArgs.from_config(config)


def test_longrope_rows_run_through_the_scheduler_across_the_switch(tmp_path):
    """The paged cache gives each row its own positions, from which longrope picks its factors; a
    row that passes the switch (mid-decode, or in a prefill piece) runs its sequence again in one
    piece, as the batch engine does, so every row equals its run alone, beside rows that stay short."""
    import mlx.core as mx

    from mlxcel.checkpoints.loader import load_model
    from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
    from mlxcel.engine.scheduler import BatchScheduler, supports_scheduling
    from mlxcel.sampling import Sampler

    folder = make_family_checkpoint(
        tmp_path / "p", "phi3", seed=14, partial_rotary_factor=0.5, tie_word_embeddings=True, **longrope(4, 64)
    )
    model = load_model(str(folder), dtype="float32").model
    long_prompt = (PROMPT * 3)[:100]
    # (prompt, max_tokens): crosses mid-decode; stays short; crosses in its prefill pieces; starts long
    shapes = [(PROMPT[:40], 40), (PROMPT[:9], 30), (long_prompt[:70], 12), (long_prompt, 10), (PROMPT[:30], 36)]
    rows = [RowRequest(p, row_id=i, max_tokens=m) for i, (p, m) in enumerate(shapes)]
    greedy = Sampler("greedy")
    assert supports_scheduling(model, GenerationRequest(rows, greedy))
    with mx.stream(mx.cpu):
        alone = [
            DirectEngine(model, 256).generate(GenerationRequest([row], greedy)).results[0].token_ids for row in rows
        ]
        for max_rows, chunk in [(2, 16), (5, None), (3, 7)]:
            scheduled = BatchScheduler(model, 256, max_rows, chunk_size=chunk).generate(GenerationRequest(rows, greedy))
            assert [r.token_ids for r in scheduled.results] == alone, (max_rows, chunk)
    assert [len(ids) for ids in alone] == [m for _, m in shapes]
