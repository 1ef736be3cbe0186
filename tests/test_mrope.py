"""Qwen2-VL's multimodal RoPE against transformers: the [3, L] position ids of a prompt with
images (get_rope_index) and the rotation they give (Qwen2VLRotaryEmbedding + apply_rotary_pos_emb)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.errors import MlxcelError
from mlxcel.models.mrope import MRoPE, make_mrope_positions

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
qwen2_vl = pytest.importorskip("transformers.models.qwen2_vl.modeling_qwen2_vl")

IMAGE = 7  # image placeholder id in these tests
SECTIONS = [2, 3, 3]  # head_dim 16


def make_reference_model():
    text = {
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 50,
        "rope_scaling": {"type": "mrope", "mrope_section": SECTIONS},
    }
    config = transformers.Qwen2VLConfig(
        text_config=text,
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2},
        image_token_id=IMAGE,
    )
    return qwen2_vl.Qwen2VLModel(config).eval()


def prompt_with_images(grids, merge=2, text=(3, 5, 2)):
    ids, types = [], []
    for n, grid in zip(text, [*grids, None]):
        ids += list(range(10, 10 + n))
        types += [0] * n
        if grid is not None:
            count = grid[0] * grid[1] * grid[2] // merge**2
            ids += [IMAGE] * count
            types += [1] * count
    return ids, types


@pytest.mark.parametrize("grids", [[(1, 4, 6)], [(1, 6, 4), (1, 2, 2)], []], ids=["one", "two", "text-only"])
def test_positions_match_get_rope_index(grids):
    model = make_reference_model()
    ids, types = prompt_with_images(grids)
    want, want_delta = model.get_rope_index(
        torch.tensor([ids]),
        mm_token_type_ids=torch.tensor([types]),
        image_grid_thw=torch.tensor(grids) if grids else None,
    )
    got, delta = make_mrope_positions(ids, grids, IMAGE, merge_size=2)
    np.testing.assert_array_equal(got, want[:, 0].numpy())
    assert delta == int(want_delta[0, 0])
    if grids:
        assert delta < 0  # an image's grid takes fewer positions than tokens: decoding resumes early


def test_rotation_matches_transformers():
    model = make_reference_model()
    ids, types = prompt_with_images([(1, 4, 6), (1, 2, 2)])
    positions, _ = make_mrope_positions(ids, [(1, 4, 6), (1, 2, 2)], IMAGE, merge_size=2)
    x = np.random.default_rng(0).standard_normal((1, 4, len(ids), 16)).astype(np.float32)
    cos, sin = model.language_model.rotary_emb(torch.tensor(x), torch.tensor(positions)[:, None])
    want, _ = qwen2_vl.apply_rotary_pos_emb(torch.tensor(x), torch.tensor(x), cos, sin)
    rope = MRoPE(16, model.config.text_config.rope_parameters["rope_theta"], SECTIONS)
    got = rope(mx.array(x), mx.array(positions)[:, None])
    np.testing.assert_allclose(np.array(got), want.numpy(), atol=1e-5)
    # text-only positions (three equal ids) are the fused kernel's plain RoPE at that offset
    plain = np.broadcast_to(np.arange(5, 5 + len(ids)), (3, len(ids)))[:, None]
    np.testing.assert_allclose(np.array(rope(mx.array(x), mx.array(plain))), np.array(rope(mx.array(x), 5)), atol=1e-5)


def test_placeholder_counts_must_fit_the_images():
    ids, _ = prompt_with_images([(1, 4, 6)])
    with pytest.raises(MlxcelError, match="needs 4 placeholder tokens, the prompt holds 6"):
        make_mrope_positions(ids, [(1, 4, 4)], IMAGE, 2)
    with pytest.raises(MlxcelError, match="more image placeholder runs than images"):
        make_mrope_positions(ids, [], IMAGE, 2)
    with pytest.raises(MlxcelError, match="fewer image placeholder runs"):
        make_mrope_positions(ids, [(1, 4, 6), (1, 2, 2)], IMAGE, 2)
    with pytest.raises(MlxcelError, match="mrope_section"):
        MRoPE(16, 10000.0, [2, 2, 2])


def test_cache_position_shift_moves_every_rows_rope_position():
    from mlxcel.engine.compiled import CompiledDecoder
    from mlxcel.models.cache import make_kv_caches

    cache = make_kv_caches(1, batch_size=2, left_pad=[0, 3])[0]
    cache.offset = 10
    assert np.array(cache.rope_offset()).tolist() == [10, 7]
    assert CompiledDecoder.can_drive([cache])
    cache.position_shift = mx.array([-4, 0], dtype=mx.int32)
    assert np.array(cache.rope_offset()).tolist() == [6, 7]
    assert not CompiledDecoder.can_drive([cache])  # it derives positions from the offset alone
