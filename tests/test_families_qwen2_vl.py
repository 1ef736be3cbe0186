"""Qwen2-VL's language side against transformers' Qwen2VLForConditionalGeneration: text prompts,
a prefill with explicit M-RoPE positions (image placeholders), and decoding after it at the
row's position shift."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.models.cache import make_kv_caches
from mlxcel.models.mrope import make_mrope_positions
from tests.family_fixtures import (
    GREEDY_TOKENS,
    LOGIT_TOLERANCE,
    PROMPT,
    mlxcel_generate,
    mlxcel_logits,
    reference_greedy,
    reference_logits,
)
from tests.helpers import write_tiny_tokenizer
from tests.qwen2_vl_fixtures import TEXT

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IMAGE = 5
VISION = {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2_vl")
    config = transformers.Qwen2VLConfig(
        text_config={**TEXT, "vocab_size": write_tiny_tokenizer(folder)}, vision_config=VISION, image_token_id=IMAGE
    )
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # wider weights than the init's 0.02: logits far enough apart to compare
        for p in model.model.language_model.parameters():
            p.normal_(0, 0.15)
    model.save_pretrained(folder)
    return folder, model


def test_text_prompts_match_transformers(checkpoint):
    folder, reference = checkpoint
    got, loaded = mlxcel_logits(folder, PROMPT)
    assert np.abs(got - reference_logits(reference, PROMPT)).max() <= LOGIT_TOLERANCE
    greedy = mlxcel_generate(loaded.model, [PROMPT], GREEDY_TOKENS)[0]
    assert greedy == reference_greedy(reference, PROMPT, GREEDY_TOKENS)
    assert len(set(greedy)) >= 3  # a varied continuation, not one repeated token


def test_explicit_positions_prefill_and_shifted_decode_match_transformers(checkpoint):
    folder, reference = checkpoint
    model = load_model(str(folder), dtype="float32").model
    grids = [(1, 4, 6)]
    ids = PROMPT[:7] + [IMAGE] * 6 + PROMPT[7:20]
    positions, delta = make_mrope_positions(ids, grids, IMAGE, merge_size=2)
    embeddings = (
        np.random.default_rng(1).standard_normal((1, len(ids), 64)).astype(np.float32)
    )  # stand-in image features
    with torch.no_grad():
        want = reference.model.language_model(
            inputs_embeds=torch.tensor(embeddings), position_ids=torch.tensor(positions)[:, None]
        )
        want = reference.lm_head(want.last_hidden_state).numpy()
    cache = make_kv_caches(2)
    got = model.forward_with_embeddings(mx.array(embeddings), cache, positions=mx.array(positions)[:, None])
    np.testing.assert_allclose(np.array(got), want, atol=1e-3)
    assert delta < 0
    # the next token decodes as plain RoPE at len(ids) + delta, all three ids equal
    for layer_cache in cache:
        layer_cache.position_shift = mx.array([delta], dtype=mx.int32)
    token = 42
    with torch.no_grad():
        everything = torch.cat(
            [torch.tensor(embeddings), reference.model.language_model.embed_tokens(torch.tensor([[token]]))], dim=1
        )
        next_positions = np.concatenate([positions, np.full((3, 1), len(ids) + delta)], axis=1)
        want_next = reference.lm_head(
            reference.model.language_model(
                inputs_embeds=everything, position_ids=torch.tensor(next_positions)[:, None]
            ).last_hidden_state
        )
    got_next = model(mx.array([[token]]), cache)
    np.testing.assert_allclose(np.array(got_next)[0, -1], want_next[0, -1].numpy(), atol=1e-3)
