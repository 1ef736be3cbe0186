"""Engine invariances and stop rules on a tiny random Llama (fp32, CPU)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
from mlxcel.engine.engine import Engine, PromptTooLongError
from mlxcel.models.cache import GROW_STEP
from mlxcel.sampling import Sampler

PROMPTS = [
    [(5 * i + 11) % 300 + 3 for i in range(37)],
    [(3 * i + 7) % 300 + 3 for i in range(9)],
    [(11 * i + 1) % 300 + 3 for i in range(23)],
]
GREEDY = Sampler("greedy")
CATEGORICAL = Sampler("categorical", temperature=1.0, seed=1234)


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load_model(str(tiny_llama), dtype="float32").model


def generate(model, prompts, sampler=GREEDY, max_tokens=24, pipeline=True, row_ids=None, **request_kwargs):
    rows = [RowRequest(list(p), row_id=(row_ids[i] if row_ids else i)) for i, p in enumerate(prompts)]
    request = GenerationRequest(rows, sampler, max_tokens=max_tokens, **request_kwargs)
    return DirectEngine(model, max_context=512, pipeline=pipeline).generate(request)


def tokens_of(state):
    return [r.token_ids for r in state.results]


def test_chunked_prefill_matches_single_pass(model):
    single = generate(model, PROMPTS[:1], chunk_size=2048)
    for chunk in (1, 5, 16):
        chunked = generate(model, PROMPTS[:1], chunk_size=chunk)
        assert tokens_of(chunked) == tokens_of(single)
        assert len(chunked.timings.prefill_pieces) == -(-len(PROMPTS[0]) // chunk)


def test_chunked_prefill_logits_match(model):
    ids = mx.array([PROMPTS[0]])
    full = model(ids, model.make_cache())[:, -1]
    cache = model.make_cache()
    for start in range(0, ids.shape[1], 8):
        out = model(ids[:, start : start + 8], cache)
    assert np.abs(np.array(full) - np.array(out[:, -1])).max() < 1e-4


def test_tile_padded_prefill_matches_unpadded(model):
    plain = generate(model, PROMPTS[:1], chunk_size=16)
    padded = generate(model, PROMPTS[:1], chunk_size=16, tile_size=32)
    assert sum(p["pad"] for p in padded.timings.prefill_pieces) > 0
    assert tokens_of(padded) == tokens_of(plain)
    assert padded.cache[0].offset == plain.cache[0].offset


def test_history_boundary_piece(model):
    rows = [RowRequest(PROMPTS[0], history_tokens=30)]
    state = DirectEngine(model, 512).generate(GenerationRequest(rows, GREEDY, max_tokens=8, chunk_size=4))
    pieces = state.timings.prefill_pieces
    assert [p["end"] for p in pieces] == [4, 8, 12, 16, 20, 24, 28, 30, 34, 37]  # bounded by the chunk, cut at 30
    assert all(p["ms"] > 0 for p in pieces)  # each piece is timed to its materialisation
    assert tokens_of(state) == tokens_of(generate(model, PROMPTS[:1], max_tokens=8))


@pytest.mark.parametrize("sampler", [GREEDY, CATEGORICAL], ids=["greedy", "categorical"])
def test_pipelined_matches_synchronous(model, sampler):
    assert tokens_of(generate(model, PROMPTS, sampler, pipeline=True)) == tokens_of(
        generate(model, PROMPTS, sampler, pipeline=False)
    )


def test_force_sync_env_selects_synchronous_path(model, monkeypatch):
    monkeypatch.setenv("MLXCEL_FORCE_SYNC", "1")
    assert DirectEngine(model, 512, pipeline=True).pipeline is False
    monkeypatch.setenv("MLXCEL_FORCE_SYNC", "0")
    assert DirectEngine(model, 512, pipeline=True).pipeline is True


@pytest.mark.parametrize("sampler", [GREEDY, CATEGORICAL], ids=["greedy", "categorical"])
def test_batch_rows_match_running_alone(model, sampler):
    batched = tokens_of(generate(model, PROMPTS, sampler))
    alone = [tokens_of(generate(model, [p], sampler, row_ids=[i]))[0] for i, p in enumerate(PROMPTS)]
    assert batched == alone
    reordered = tokens_of(generate(model, PROMPTS[::-1], sampler, row_ids=[2, 1, 0]))
    assert reordered == alone[::-1]


def test_categorical_is_seeded_and_not_greedy(model):
    a = tokens_of(generate(model, PROMPTS[:1], CATEGORICAL))
    assert a == tokens_of(generate(model, PROMPTS[:1], CATEGORICAL))
    other_seed = tokens_of(generate(model, PROMPTS[:1], Sampler("categorical", temperature=1.0, seed=99)))
    assert a != other_seed
    assert a != tokens_of(generate(model, PROMPTS[:1], GREEDY))


def test_categorical_draw_follows_the_softmax():
    """Gumbel-max draws over many row streams reproduce softmax(logits / T)."""
    logits = mx.array([[2.0, 1.0, 0.0, -1.0]])
    sampler = Sampler("categorical", temperature=0.7, seed=5)
    from mlxcel.sampling import RowKey

    draws = [sampler(logits, [RowKey(i)], [0]).item() for i in range(4000)]
    freq = np.bincount(draws, minlength=4) / len(draws)
    expected = np.array(mx.softmax(logits[0] / 0.7))
    assert np.abs(freq - expected).max() < 0.03


def test_stop_id_ends_row_and_is_not_emitted(model):
    free = tokens_of(generate(model, PROMPTS[:1], max_tokens=12))[0]
    stop = free[3]
    first = free.index(stop)
    state = generate(model, PROMPTS[:1], max_tokens=12, stop_token_ids=frozenset([stop]))
    assert state.results[0].token_ids == free[:first]
    assert state.results[0].finish_reason == "stop"


def test_max_tokens_and_cancel(model):
    state = generate(model, PROMPTS, max_tokens=5)
    assert [len(t) for t in tokens_of(state)] == [5, 5, 5]
    assert {r.finish_reason for r in state.results} == {"length"}
    seen = []

    def on_token(row, token):
        seen.append((row, token))
        return not (row == 1 and len([s for s in seen if s[0] == 1]) == 3)

    request = GenerationRequest([RowRequest(p, row_id=i) for i, p in enumerate(PROMPTS)], GREEDY, max_tokens=8)
    state = DirectEngine(model, 512).generate(request, on_token)
    assert [r.finish_reason for r in state.results] == ["length", "cancelled", "length"]
    assert len(state.results[1].token_ids) == 3


def test_per_row_max_tokens(model):
    rows = [RowRequest(PROMPTS[0], max_tokens=2), RowRequest(PROMPTS[1], row_id=1)]
    state = DirectEngine(model, 512).generate(GenerationRequest(rows, GREEDY, max_tokens=6))
    assert [len(r.token_ids) for r in state.results] == [2, 6]


def test_context_limit(model):
    state = DirectEngine(model, max_context=40).generate(
        GenerationRequest([RowRequest(PROMPTS[0])], GREEDY, max_tokens=50)
    )
    assert len(state.results[0].token_ids) == 40 - len(PROMPTS[0]) + 1
    assert state.results[0].finish_reason == "length"
    with pytest.raises(PromptTooLongError, match="37 tokens"):
        Engine(model, max_context=37).start(GenerationRequest([RowRequest(PROMPTS[0])], GREEDY))


def test_kv_cache_grows_in_steps(model):
    cache = model.make_cache()
    model(mx.array([PROMPTS[0]]), cache)
    assert cache[0].keys.shape[2] == GROW_STEP
    sizes = set()
    for _ in range(GROW_STEP):
        model(mx.array([[5]]), cache)
        sizes.add(cache[0].keys.shape[2])
    assert sizes == {GROW_STEP, 2 * GROW_STEP}  # reallocated once, not per token
    assert cache[0].offset == len(PROMPTS[0]) + GROW_STEP


def test_cache_is_sized_for_the_request_at_prefill(model):
    """Prompt + max_tokens positions are allocated by the prefill; decoding never grows (copies) it."""
    rows = [RowRequest(list(PROMPTS[0]), row_id=0)]
    engine = Engine(model, max_context=4096)
    state = engine.start(GenerationRequest(rows, GREEDY, max_tokens=300))
    planned = -(-(len(PROMPTS[0]) + 300) // GROW_STEP) * GROW_STEP
    assert state.cache[0].keys.shape[2] == planned
    while engine.finish_rows(state, lambda row, token: True):
        if engine.can_submit(state):
            engine.submit(state)
    assert len(state.results[0].token_ids) == 300
    assert state.cache[0].keys.shape[2] == planned


@pytest.mark.parametrize("sampler", [GREEDY, CATEGORICAL], ids=["greedy", "categorical"])
def test_compiled_decode_step_matches_eager(model, sampler, monkeypatch):
    eager = tokens_of(generate(model, PROMPTS, sampler, max_tokens=40))
    assert DirectEngine(model, 512).engine.decoder is None  # opt-in
    monkeypatch.setenv("MLXCEL_COMPILE", "1")
    assert DirectEngine(model, 512).engine.decoder is not None
    assert tokens_of(generate(model, PROMPTS, sampler, max_tokens=40)) == eager


def test_compiled_step_crosses_a_cache_growth(model, monkeypatch):
    """The buffer grows (and the step is traced again) mid-generation: tokens still match eager."""
    prompt = [PROMPTS[0] * 6]  # 222 tokens: growth at 256 happens while decoding
    eager = tokens_of(generate(model, prompt, max_tokens=60))
    monkeypatch.setenv("MLXCEL_COMPILE", "1")
    assert tokens_of(generate(model, prompt, max_tokens=60)) == eager


def test_logits_at_one_position_equal_the_full_row(model):
    ids = mx.array([PROMPTS[0]])
    full = model(ids, model.make_cache())
    one = model(ids, model.make_cache(), logits_at=20)
    assert one.shape == (1, 1, full.shape[-1])
    assert np.abs(np.array(one[:, 0]) - np.array(full[:, 20])).max() < 1e-5


@pytest.mark.parametrize("chunk_size", [2048, 16])
def test_after_prefill_runs_once_between_the_evaluated_prefill_and_decode(tiny_llama, monkeypatch, chunk_size):
    """A model that changes its weights in after_prefill (as Phi-4-multimodal unfuses its vision
    LoRA): the first token comes from the prefill's weights, every later one from the new ones,
    and the hook runs after an mx.eval of the whole prefill's cache."""
    plain = load_model(str(tiny_llama), dtype="float32").model
    changed = load_model(str(tiny_llama), dtype="float32").model
    down = changed.model.layers[0].mlp.down_proj
    events = []
    real_eval = mx.eval

    def recording_eval(*args):
        events.append("eval")
        return real_eval(*args)

    def after_prefill():
        events.append("after_prefill")
        down.weight = down.weight * 3.0  # replaced after the prefill's graph was built and evaluated

    changed.after_prefill = after_prefill
    changed.__dict__.pop("_mlxcel_decoders", None)
    monkeypatch.setattr(mx, "eval", recording_eval)
    got = tokens_of(generate(changed, PROMPTS[:1], max_tokens=12, chunk_size=chunk_size))[0]
    monkeypatch.setattr(mx, "eval", real_eval)
    want = tokens_of(generate(plain, PROMPTS[:1], max_tokens=12, chunk_size=chunk_size))[0]
    assert events.count("after_prefill") == 1 and events[events.index("after_prefill") - 1] == "eval"
    assert got[0] == want[0]  # the prefill ran on the weights it started with
    assert got[1:] != want[1:]  # decode saw the changed weights
