"""decode.kv_bits: a KV cache stored quantized. The error grows as bits shrink, 8 bits keeps the
greedy text, the cache holds fewer bytes, and bad settings fail with the key named."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
from mlxcel.errors import MlxcelError
from mlxcel.models.cache import KVCache
from mlxcel.models.quantized_cache import QuantizedKVCache, quantize_caches
from mlxcel.models.rotating_cache import RotatingKVCache
from mlxcel.sampling import Sampler
from tests.family_fixtures import PROMPT, make_family_checkpoint

pytest.importorskip("torch")

BATCH = [PROMPT, PROMPT[5:28], PROMPT[:9]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = make_family_checkpoint(tmp_path_factory.mktemp("kvq_qwen3"), "qwen3", seed=21)  # head_dim 32
    return load_model(str(folder), dtype="float32").model


def decode_logits(model, prompt: list[int], follow: list[int], kv_bits: int | None, group_size: int = 32) -> np.ndarray:
    """Prefill in two pieces, then one token at a time; every step's logits."""
    cache = model.make_cache(1)
    if kv_bits:
        cache = quantize_caches(cache, kv_bits, group_size)
    half = len(prompt) // 2
    out = [model(mx.array([prompt[:half]]), cache)[0, -1], model(mx.array([prompt[half:]]), cache)[0, -1]]
    out += [model(mx.array([[t]]), cache)[0, -1] for t in follow]
    return np.array(mx.stack(out))


def generate(model, prompts, kv_bits=None, group_size=32, n=24, chunk_size=2048):
    rows = [RowRequest(p, row_id=i) for i, p in enumerate(prompts)]
    request = GenerationRequest(
        rows, Sampler("greedy"), max_tokens=n, kv_bits=kv_bits, kv_group_size=group_size, chunk_size=chunk_size
    )
    return [r.token_ids for r in DirectEngine(model, max_context=512).generate(request).results]


def test_error_grows_as_bits_shrink_and_8_bits_stays_close(model):
    follow = [11, 42, 7, 99, 5, 18, 23, 64, 3, 77, 120, 9]
    exact = decode_logits(model, PROMPT, follow, None)
    errors = {bits: np.abs(decode_logits(model, PROMPT, follow, bits) - exact).max() for bits in (8, 4, 2)}
    assert 0 < errors[8] < errors[4] < errors[2], errors
    assert errors[8] < 0.05 * np.abs(exact).max(), errors


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_rows_in_a_batch_match_each_row_alone(model, bits):
    """Each token's keys are quantized on their own (groups along head_dim), so neither the
    batch nor its left padding changes a row."""
    together = generate(model, BATCH, kv_bits=bits)
    assert together == [generate(model, [prompt], kv_bits=bits)[0] for prompt in BATCH]
    assert together != generate(model, BATCH, kv_bits=2)  # the setting does reach the cache


def test_quantized_cache_holds_fewer_bytes(model):
    plain, quantized = model.make_cache(1), quantize_caches(model.make_cache(1), 4, 32)
    model(mx.array([PROMPT]), plain)
    model(mx.array([PROMPT]), quantized)
    mx.eval([c.state for c in plain], [c.state for c in quantized])
    plain_bytes = sum(a.nbytes for c in plain for a in c.state)
    quantized_bytes = sum(a.nbytes for c in quantized for a in c.state)
    # 4-bit codes plus an fp32 scale and bias per 32 values: 4/32 + 2 * 32/32/32 = 3/16 of fp32
    assert quantized_bytes == pytest.approx(plain_bytes * 3 / 16, rel=1e-6)


def test_sliding_window_layers_keep_their_own_cache():
    caches = quantize_caches([KVCache(1), RotatingKVCache(16, 1)], 4, 64)
    assert type(caches[0]) is QuantizedKVCache and type(caches[1]) is RotatingKVCache


def test_sliding_window_model_runs_with_a_quantized_cache(tmp_path):
    folder = make_family_checkpoint(tmp_path / "gemma3", "gemma3_text", seed=4, head_dim=32)
    gemma3 = load_model(str(folder), dtype="float32").model
    plain, quantized = generate(gemma3, BATCH, n=20), generate(gemma3, BATCH, kv_bits=8, n=20)
    assert quantized == [generate(gemma3, [prompt], kv_bits=8, n=20)[0] for prompt in BATCH]
    assert sum(a == b for p, q in zip(plain, quantized) for a, b in zip(p, q)) >= 0.8 * 60, (plain, quantized)


def test_group_size_that_does_not_divide_head_dim_is_a_clear_error(model):
    with pytest.raises(MlxcelError, match=r"kv_group_size=64 does not divide the model's head_dim 32"):
        generate(model, BATCH[:1], kv_bits=4, group_size=64)


@pytest.mark.parametrize("step", ["segmented", "compiled"])
def test_every_decode_step_gives_the_eager_tokens_with_a_quantized_cache(model, step, monkeypatch):
    eager = generate(model, BATCH, kv_bits=4)
    monkeypatch.setenv("MLXCEL_DECODE_STEP", step)
    assert generate(model, BATCH, kv_bits=4) == eager  # the whole-step compile falls back to eager


def schedule(model, prompts, kv_bits, max_rows, chunk_size=None, n=24, group_size=32):
    from mlxcel.engine.scheduler import BatchScheduler

    rows = [RowRequest(p, row_id=i) for i, p in enumerate(prompts)]
    request = GenerationRequest(rows, Sampler("greedy"), max_tokens=n, kv_bits=kv_bits, kv_group_size=group_size)
    with mx.stream(mx.cpu):  # exactness is promised in fp32 on the CPU
        return [
            r.token_ids for r in BatchScheduler(model, 512, max_rows, chunk_size=chunk_size).generate(request).results
        ]


@pytest.mark.parametrize("bits", [8, 4])
def test_the_scheduler_with_a_quantized_cache_equals_each_row_alone(model, bits):
    """The paged pool stores what QuantizedKVCache stores (per-position groups), so any schedule
    gives the batch engine's tokens for the same pieces (a later piece attends to the earlier
    ones' quantized keys, so the chunk size is part of the answer); 2 bits differ, so the setting
    does reach the pool."""
    for max_rows, chunk in [(1, None), (3, 7), (2, 16)]:
        with mx.stream(mx.cpu):
            alone = [generate(model, [prompt], kv_bits=bits, chunk_size=chunk or 2048)[0] for prompt in BATCH]
        assert schedule(model, BATCH, bits, max_rows, chunk) == alone, (max_rows, chunk)
    assert schedule(model, BATCH, 2, 3, 16) != alone


def test_the_scheduler_budgets_the_quantized_pool(model):
    from mlxcel.engine.scheduler import kv_bytes_per_position

    assert kv_bytes_per_position(model, 4, 32) * 16 == kv_bytes_per_position(model) * 3  # 3/16 of fp32, as above


def test_the_scheduler_with_windows_and_a_quantized_cache(tmp_path):
    folder = make_family_checkpoint(tmp_path / "gemma3", "gemma3_text", seed=4, head_dim=32)
    gemma3 = load_model(str(folder), dtype="float32").model
    with mx.stream(mx.cpu):
        alone = [generate(gemma3, [prompt], kv_bits=8, n=20, chunk_size=5)[0] for prompt in BATCH]
    assert schedule(gemma3, BATCH, 8, 2, chunk_size=5, n=20) == alone


def test_pieces_with_a_quantized_cache_are_the_rows_own(model, monkeypatch):
    """While rows decode the scheduler prefills in smaller pieces, which would change a quantized
    row's tokens; with kv_bits a row's pieces are its chunk size whatever else runs."""
    from mlxcel.engine import scheduler

    monkeypatch.setattr(scheduler, "BUSY_CHUNK_SIZE", 4)
    monkeypatch.setattr(scheduler, "DEFAULT_CHUNK_SIZE", 16)
    lengths = [12, 3, 8, 5, 12, 2]  # rows end at different steps: new rows prefill beside decoding ones
    rows = [RowRequest(p, row_id=i, max_tokens=n) for i, (p, n) in enumerate(zip(BATCH * 2, lengths))]
    request = GenerationRequest(rows, Sampler("greedy"), max_tokens=12, kv_bits=2, kv_group_size=32, chunk_size=16)
    with mx.stream(mx.cpu):
        alone = [generate(model, [row.prompt_ids], kv_bits=2, n=row.max_tokens, chunk_size=16)[0] for row in rows]
        state = scheduler.BatchScheduler(model, 512, 2).generate(request)
    assert [r.token_ids for r in state.results] == alone
    assert any(
        p["end"] - p["start"] == 16 and p["step"] > 0 for p in state.timings.prefill_pieces
    )  # pieces ran beside decoding rows
