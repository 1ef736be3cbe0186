"""PrefillPlan: one test per rule of SPEC.md, plus the edges."""

from __future__ import annotations

import pytest

from mlxcel.prefill_plan import PrefillPiece, plan_prefill


def spans(plan):
    return [(p.start, p.end, p.pad) for p in plan.pieces]


def test_rule1_adopted_prefix_is_not_run_again():
    plan = plan_prefill(100, chunk_size=2048, adopted_prefix=40)
    assert spans(plan) == [(40, 100, 0)]
    assert plan.adopted_prefix == 40


def test_rule2_history_boundary_is_one_unpadded_piece():
    plan = plan_prefill(100, chunk_size=16, history_boundary=70, tile_size=32)
    assert plan.pieces[0] == PrefillPiece(0, 70, 0)  # longer than a chunk, still one piece, never padded
    assert all(p.length <= 16 for p in plan.pieces[1:])
    assert plan.pieces[1].start == 70


def test_rule2_history_boundary_after_adopted_prefix():
    plan = plan_prefill(100, chunk_size=2048, adopted_prefix=30, history_boundary=70)
    assert spans(plan) == [(30, 70, 0), (70, 100, 0)]


def test_rule3_chunks_of_chunk_size():
    assert spans(plan_prefill(5000, chunk_size=2048)) == [(0, 2048, 0), (2048, 4096, 0), (4096, 5000, 0)]
    assert spans(plan_prefill(10, chunk_size=4)) == [(0, 4, 0), (4, 8, 0), (8, 10, 0)]


def test_rule3_no_split_without_multi_piece_support_or_for_embeddings():
    assert spans(plan_prefill(5000, chunk_size=2048, supports_multi_piece=False)) == [(0, 5000, 0)]
    assert spans(plan_prefill(5000, chunk_size=2048, input_is_tokens=False, history_boundary=10)) == [(0, 5000, 0)]


def test_rule4_tile_padding_when_supported():
    plan = plan_prefill(70, chunk_size=64, tile_size=32)
    assert spans(plan) == [(0, 64, 0), (64, 70, 26)]
    assert plan.padded_tokens == 26
    assert spans(plan_prefill(70, chunk_size=64, tile_size=32, supports_padded=False)) == [(0, 64, 0), (64, 70, 0)]
    assert spans(plan_prefill(70, chunk_size=64)) == [(0, 64, 0), (64, 70, 0)]


def test_rule4_piece_ending_at_history_boundary_is_never_padded():
    plan = plan_prefill(50, chunk_size=64, history_boundary=45, tile_size=32)
    assert spans(plan) == [(0, 45, 0), (45, 50, 27)]


@pytest.mark.parametrize("kwargs", [dict(total_tokens=0), dict(total_tokens=10, chunk_size=0), dict(total_tokens=10, adopted_prefix=10)])
def test_invalid_inputs_raise(kwargs):
    total = kwargs.pop("total_tokens")
    with pytest.raises(ValueError):
        plan_prefill(total, **kwargs)


def test_pieces_cover_the_prompt_exactly():
    for total in (1, 31, 32, 33, 700):
        for chunk in (1, 7, 32, 2048):
            plan = plan_prefill(total, chunk_size=chunk, history_boundary=total // 2, tile_size=8)
            assert plan.pieces[0].start == 0 and plan.pieces[-1].end == total
            assert all(a.end == b.start for a, b in zip(plan.pieces, plan.pieces[1:]))
