"""PrefillPlan: one test per rule of docs/design.md, plus the edges."""

from __future__ import annotations

import pytest

from mlxcel import prefill_plan
from mlxcel.prefill_plan import choose_tile_size, has_neural_accelerators, plan_prefill


def spans(plan):
    return [(p.start, p.end, p.pad) for p in plan.pieces]


def test_rule1_adopted_prefix_is_not_run_again():
    plan = plan_prefill(100, chunk_size=2048, adopted_prefix=40)
    assert spans(plan) == [(40, 100, 0)]
    assert plan.adopted_prefix == 40


def test_rule2_history_boundary_is_a_cut_and_the_chunk_bounds_the_span_before_it():
    plan = plan_prefill(100, chunk_size=16, history_boundary=70)
    assert [p.end for p in plan.pieces] == [16, 32, 48, 64, 70, 86, 100]
    assert all(p.pad == 0 and p.length <= 16 for p in plan.pieces)


def test_rule2_the_history_span_is_never_padded_even_at_the_end_of_the_prompt():
    plan = plan_prefill(100, chunk_size=64, history_boundary=70, tile_size=32)
    assert spans(plan) == [(0, 64, 0), (64, 70, 0), (70, 100, 2)]
    assert spans(plan_prefill(70, chunk_size=64, history_boundary=70, tile_size=32)) == [(0, 64, 0), (64, 70, 0)]
    assert spans(plan_prefill(70, chunk_size=64, history_boundary=70, tile_size=32, supports_multi_piece=False)) == [
        (0, 70, 0)
    ]


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


def test_rule4_chunk_sizes_round_to_whole_tiles():
    # chunk 20 with 32-token tiles used to pad 45 tokens onto 51 (20+12, 20+12, 11+21)
    assert spans(plan_prefill(51, chunk_size=20, tile_size=32)) == [(0, 32, 0), (32, 51, 13)]
    assert spans(plan_prefill(200, chunk_size=100, tile_size=32)) == [(0, 96, 0), (96, 192, 0), (192, 200, 24)]
    for total in (1, 33, 51, 700):
        for chunk in (1, 20, 31, 32, 100, 2048):
            plan = plan_prefill(total, chunk_size=chunk, tile_size=32, history_boundary=total // 3)
            assert all(p.pad < 32 for p in plan.pieces) and sum(p.pad > 0 for p in plan.pieces) <= 2


@pytest.mark.parametrize(
    ("architecture", "macos", "expected"),
    [
        ("applegpu_g17s", "26.2", True),  # M5
        ("applegpu_g17g", "26.5.2", True),
        ("applegpu_g17s", "26.1", False),  # MLX's NAX kernels need macOS 26.2
        ("applegpu_g16s", "26.2", False),  # M4
        ("applegpu_g17p", "26.2", False),  # phone-class parts from generation 18
        ("applegpu_g18p", "27.0", True),
        ("x86_64", "", False),
        ("NVIDIA H200", "", False),
    ],
)
def test_neural_accelerators_by_architecture(architecture, macos, expected):
    assert has_neural_accelerators(architecture, macos) is expected


def test_auto_tile_size_follows_the_device(monkeypatch):
    import mlx.core as mx

    assert choose_tile_size(16) == 16 and choose_tile_size(None) is None
    assert choose_tile_size("auto") is None  # this CPU
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(prefill_plan.platform, "mac_ver", lambda: ("26.2", ("", "", ""), "arm64"))
    monkeypatch.setattr(mx, "device_info", lambda: {"architecture": "applegpu_g17s"})
    assert choose_tile_size("auto") == 32
    monkeypatch.setattr(mx, "device_info", lambda: {"architecture": "applegpu_g16s"})
    assert choose_tile_size("auto") is None


@pytest.mark.parametrize(
    "kwargs", [dict(total_tokens=0), dict(total_tokens=10, chunk_size=0), dict(total_tokens=10, adopted_prefix=10)]
)
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
