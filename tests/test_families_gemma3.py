"""Gemma 3 text (local/global RoPE bases, q/k norm, sliding window pattern) against transformers."""

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
def gemma3_parity(tmp_path_factory):
    return assert_parity(make_family_checkpoint(tmp_path_factory.mktemp("tiny_gemma3"), "gemma3_text", seed=10))


def test_gemma3_matches_transformers(gemma3_parity):
    model = gemma3_parity["model"]
    assert model.args.tie_word_embeddings and "lm_head" not in model
    assert model.eos_token_ids() == [2]


def test_gemma3_batch_rows_match_alone(gemma3_parity):
    assert_batch_rows_match_alone(gemma3_parity["model"], [PROMPT, PROMPT[6:30], PROMPT[:11], PROMPT[2:39]])


@pytest.mark.parametrize("piece,tile", [(16, None), (12, 8)])
def test_gemma3_pieces_match_one_shot(gemma3_parity, piece, tile):
    assert_pieces_match_one_shot(gemma3_parity["model"], PROMPT, piece, tile)


def test_gemma3_layer_pattern_and_rope_bases(gemma3_parity):
    model = gemma3_parity["model"]
    assert model.layer_windows == [16, 16, None, 16]
    bases = [layer.self_attn.rope.base for layer in model.model.layers]
    assert bases == [10000.0, 10000.0, 1000000.0, 10000.0]


def test_gemma3_linear_scaled_global_rope_matches_transformers(tmp_path):
    folder = make_family_checkpoint(
        tmp_path / "g", "gemma3_text", seed=11, rope_scaling={"rope_type": "linear", "factor": 8.0}
    )
    model = assert_parity(folder)["model"]
    assert [layer.self_attn.rope.scale for layer in model.model.layers] == [1.0, 1.0, 0.125, 1.0]


def test_gemma3_reads_pre_transformers5_rope_keys(tmp_path):
    """Hub configs from before transformers 5: rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern and no layer_types; the same model as the new layout."""
    import json

    from mlxcel.models import gemma3

    folder = make_family_checkpoint(
        tmp_path / "g", "gemma3_text", seed=12, rope_scaling={"rope_type": "linear", "factor": 8.0}
    )
    new = json.loads((folder / "config.json").read_text())
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=6,
        num_hidden_layers=6,
    )
    new_args = gemma3.ModelArgs.from_config({**new, "num_hidden_layers": 6, "layer_types": None})
    old_args = gemma3.ModelArgs.from_config(old)
    for args in (new_args, old_args):
        assert args.layer_windows == [16, 16, 16, 16, 16, None]
        assert (args.rope_theta, args.rope_local_theta) == (1e6, 1e4)
        assert args.rope_scaling["rope_type"] == "linear" and args.rope_scaling["factor"] == 8.0
