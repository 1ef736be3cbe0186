"""Attention sinks (gpt-oss): a learned logit per head joins every query's softmax and takes part
of the weight without a value. llama.Attention.attend passes `self.sinks` to every path: the
plain KV cache, the paged pool's masks (whole prompts, pieces, batch-invariant rows), so a model
whose layers have sinks draws the same tokens on each."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
from mlxcel.engine.scheduler import BatchScheduler, uses_kernels
from mlxcel.models import llama
from mlxcel.sampling import Sampler
from tests.family_fixtures import PROMPT


def reference_attention(q, k, v, sinks, scale):
    """softmax over [scores, sink] per head (causal), the sink's share dropped: numpy, float64."""
    q, k, v, sinks = (np.asarray(a, dtype=np.float64) for a in (q, k, v, sinks))
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    scores = q @ k.swapaxes(-1, -2) * scale  # [B, H, L, S]
    L, S = scores.shape[-2:]
    causal = np.arange(S)[None, :] <= np.arange(L)[:, None] + (S - L)
    scores = np.where(causal, scores, -np.inf)
    sink = np.broadcast_to(sinks[None, :, None, None], (*scores.shape[:-1], 1))
    joined = np.concatenate([scores, sink], axis=-1)
    weights = np.exp(joined - joined.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return weights[..., :-1] @ v


def test_attend_puts_the_sink_in_the_softmax():
    args = llama.ModelArgs("llama", 32, 1, 4, 64, 50, num_key_value_heads=2)
    attention = llama.Attention(args)
    attention.sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.normal(size=(1, h, 6, 8)).astype(np.float32)) for h in (4, 2, 2))
    got = attention.attend(q, k, v, "causal")
    expected = reference_attention(q, k, v, attention.sinks, attention.scale)
    assert np.abs(np.array(got) - expected).max() <= 1e-5
    # without sinks the same call is plain attention (and differs)
    del attention.sinks
    assert np.abs(np.array(attention.attend(q, k, v, "causal")) - expected).max() > 1e-3


@pytest.fixture(scope="module")
def sinked(tiny_llama):
    model = load_model(str(tiny_llama), dtype="float32").model
    rng = np.random.default_rng(1)
    for layer in model.model.layers:
        layer.self_attn.sinks = mx.array(rng.normal(size=layer.self_attn.n_heads).astype(np.float32) * 2)
    return model


def test_a_model_with_sinks_draws_the_same_tokens_on_every_path(sinked, tiny_llama):
    prompts = [PROMPT, PROMPT[5:28], PROMPT[:9]]

    def alone(model):
        engine = DirectEngine(model, max_context=256)
        request = lambda p: GenerationRequest([RowRequest(p)], Sampler("greedy"), max_tokens=12)  # noqa: E731
        return [engine.generate(request(p)).results[0].token_ids for p in prompts]

    expected = alone(sinked)
    for options in ({}, {"chunk_size": 16}, {"batch_invariant": True}):
        scheduler = BatchScheduler(sinked, 256, 4, **options)
        rows = [RowRequest(p, row_id=i) for i, p in enumerate(prompts)]
        state = scheduler.generate(GenerationRequest(rows, Sampler("greedy"), max_tokens=12))
        assert [r.token_ids for r in state.results] == expected, options
    # the sinks change the answer: the checks above could not pass with them ignored on every path
    assert alone(load_model(str(tiny_llama), dtype="float32").model) != expected


def test_layers_with_sinks_take_the_paged_decode_kernel(sinked, monkeypatch):
    """The kernel adds the sink to its softmax (tests/test_paged_attention.py checks its numbers on
    a GPU), so gpt-oss decodes in place like every llama-attention family."""
    from mlxcel.models import paged_attention

    monkeypatch.setattr(paged_attention, "is_available", lambda head_dim, group=1: True)
    assert uses_kernels(sinked) == (True, True)
