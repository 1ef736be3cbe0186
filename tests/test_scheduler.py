"""BatchScheduler on a tiny random Llama (fp32, CPU): every row's tokens equal that row run alone
through the batch engine (DirectEngine, the independent oracle), whatever the schedule: arrival
order, max_rows, chunk size, pipelining, cancellations and stops mid-row; reruns form the same
batches; rows that cannot run end as error rows while the others complete."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import GenerationRequest, RowRequest
from mlxcel.engine.scheduler import (
    BatchScheduler,
    kv_bytes_per_position,
    pieces_per_iteration,
    supports_scheduling,
)
from mlxcel.models.paged_cache import BLOCK_SIZE
from mlxcel.sampling import Sampler, make_sampler_chain
from tests.helpers import CHAINS, make_token_prompts, run_alone

GREEDY = Sampler("greedy")
CATEGORICAL = Sampler("categorical", temperature=1.0, seed=1234)


pytestmark = pytest.mark.usefixtures("on_the_cpu")  # (conftest)


@pytest.fixture(scope="module")
def model(tiny_llama, on_the_cpu):
    return load_model(str(tiny_llama), dtype="float32").model


def schedule(
    model,
    sampler,
    prompts,
    row_ids,
    max_tokens,
    max_rows=4,
    chunk_size=None,
    pipeline=True,
    on_token=None,
    ragged=None,
    packed=None,
    **kwargs,
):
    rows = [RowRequest(p, row_id=i, max_tokens=m) for p, i, m in zip(prompts, row_ids, max_tokens)]
    request = GenerationRequest(rows, sampler, max_tokens=64, **kwargs)
    scheduler = BatchScheduler(model, 512, max_rows, chunk_size=chunk_size, pipeline=pipeline)
    scheduler.ragged_prefill = ragged  # None: where the CUDA kernels run, so off here unless asked
    if packed is not None:  # (None: the default, on for the tiny Llama)
        scheduler.packed = packed
    return scheduler.generate(request, on_token or (lambda row, token: True))


def test_the_tiny_llama_runs_through_the_scheduler(model):
    rows = [RowRequest([1, 2]), RowRequest([3])]
    assert supports_scheduling(model, GenerationRequest(rows[:1], GREEDY))  # a single prompt too, on every device
    assert supports_scheduling(model, GenerationRequest(rows, GREEDY))
    assert supports_scheduling(model, GenerationRequest(rows, GREEDY, kv_bits=4))


MODES = {"equal-pieces": (False, False), "ragged-pieces": (True, False), "packed": (None, True)}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("sampler", [GREEDY, CATEGORICAL], ids=["greedy", "categorical"])
def test_randomized_schedules_equal_each_row_alone(model, sampler, mode):
    """ragged-pieces: rows' pieces of different lengths and starts share a padded call; packed:
    the decode rows and the pieces share one call an iteration (the default where it runs)."""
    ragged, packed = MODES[mode]
    prompts = make_token_prompts(0, 9)
    lengths = [random.Random(i).randint(1, 24) for i in range(9)]
    expected = [run_alone(model, sampler, p, i, m).token_ids for i, (p, m) in enumerate(zip(prompts, lengths))]
    grouped = padded = 0  # pieces that prefilled several rows in one call; of those, rows with leading padding
    for seed in range(6):
        rng = random.Random(seed)
        order = rng.sample(range(9), 9)
        max_rows, chunk, pipeline = rng.choice([1, 2, 3, 9]), rng.choice([None, 1, 7, 32]), rng.random() < 0.7
        state = schedule(
            model,
            sampler,
            [prompts[i] for i in order],
            order,
            [lengths[i] for i in order],
            max_rows,
            chunk,
            pipeline,
            ragged=ragged,
            packed=packed,
        )
        got = {order[k]: r.token_ids for k, r in enumerate(state.results)}
        assert got == dict(enumerate(expected)), (seed, max_rows, chunk, pipeline)
        assert all(r.finish_reason == "length" for r in state.results)
        grouped += sum(p["rows"] > 1 for p in state.timings.prefill_pieces)
        padded += sum(p["rows"] > 1 and p["pad"] > 0 for p in state.timings.prefill_pieces)
        kinds = {shape[0] for shape in state.call_shapes}
        if packed:  # one call an iteration at most: packed where pieces run, else the decode step
            assert kinds <= {"packed", "decode"} and state.forward_calls <= state.iterations
        else:
            assert "packed" not in kinds
    assert grouped > 0 and (padded > 0) == bool(ragged)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("sampler", [GREEDY, CATEGORICAL], ids=["greedy", "categorical"])
def test_half_precision_schedules_equal_each_row_alone_on_the_cpu(tiny_llama, sampler, dtype):
    """MLX's CPU kernels reduce in one order whatever the row count, so in bf16 and fp16 too a
    row's tokens do not depend on what shares its batch or how its prompt is cut (on a GPU they
    can: docs/jobs.md)."""
    half = load_model(str(tiny_llama), dtype=dtype).model
    prompts = make_token_prompts(0, 9)
    lengths = [random.Random(i).randint(8, 40) for i in range(9)]
    expected = [run_alone(half, sampler, p, i, m).token_ids for i, (p, m) in enumerate(zip(prompts, lengths))]
    for seed in range(4):
        rng = random.Random(seed)
        order = rng.sample(range(9), 9)
        max_rows, chunk = rng.choice([1, 2, 3, 9]), rng.choice([None, 1, 7, 32])
        state = schedule(
            half, sampler, [prompts[i] for i in order], order, [lengths[i] for i in order], max_rows, chunk
        )
        got = {order[k]: r.token_ids for k, r in enumerate(state.results)}
        assert got == dict(enumerate(expected)), (seed, max_rows, chunk)


def test_a_lone_rows_odd_piece_is_padded_and_exact(model):
    """Ragged prefill pads a lone row's piece to a power of two too (a new query length costs
    cuDNN a graph build); the padding is neither cached nor attended to."""
    prompt = make_token_prompts(5, 1)[0][:37]
    expected = run_alone(model, GREEDY, prompt, 0, 9).token_ids
    state = schedule(model, GREEDY, [prompt], [0], [9], max_rows=1, ragged=True, packed=False)
    assert state.results[0].token_ids == expected
    assert [(p["rows"], p["end"] - p["start"], p["pad"]) for p in state.timings.prefill_pieces] == [(1, 37, 64 - 37)]


def test_cancellations_and_stop_ids_mid_row(model):
    prompts = make_token_prompts(1, 6)
    full = [run_alone(model, CATEGORICAL, p, i, 20).token_ids for i, p in enumerate(prompts)]
    stop = full[2][5]  # row 2 stops at its first occurrence of this token
    cancel_after = {1: 3, 4: 1}  # row -> tokens it receives before cancelling
    seen: dict[int, int] = {}

    def on_token(row, token):
        seen[row] = seen.get(row, 0) + 1
        return seen[row] < cancel_after.get(row, 99)

    state = schedule(
        model,
        CATEGORICAL,
        prompts,
        range(6),
        [20] * 6,
        max_rows=3,
        chunk_size=8,
        on_token=on_token,
        stop_token_ids=frozenset([stop]),
    )
    for i, result in enumerate(state.results):
        if i in cancel_after:
            assert result.finish_reason == "cancelled" and result.token_ids == full[i][: cancel_after[i]]
        elif stop in full[i]:
            assert result.finish_reason == "stop" and result.token_ids == full[i][: full[i].index(stop)]
        else:
            assert result.finish_reason == "length" and result.token_ids == full[i]


@pytest.mark.parametrize("name", ["full", "penalties", "mirostat", "adaptive_p"])
def test_stateful_chains_equal_each_row_alone(model, name):
    chain = make_sampler_chain({"seed": 7, **CHAINS[name]}, model.args.vocab_size)
    prompts = make_token_prompts(2, 5)
    expected = [run_alone(model, chain, p, i, 12).token_ids for i, p in enumerate(prompts)]
    state = schedule(model, chain, prompts[::-1], [4, 3, 2, 1, 0], [12] * 5, max_rows=2, chunk_size=16)
    assert [r.token_ids for r in state.results][::-1] == expected


def test_logprobs_equal_each_row_alone(model):
    prompts = make_token_prompts(3, 3)
    expected = [run_alone(model, CATEGORICAL, p, i, 6, logprobs=3).logprobs for i, p in enumerate(prompts)]
    state = schedule(model, CATEGORICAL, prompts, range(3), [6] * 3, max_rows=2, logprobs=3)
    assert [r.logprobs for r in state.results] == expected


@pytest.mark.parametrize("mode", list(MODES))
def test_reruns_form_the_same_batches(model, mode):
    prompts = make_token_prompts(4, 8)
    ragged, packed = MODES[mode]
    runs = [
        schedule(
            model,
            CATEGORICAL,
            prompts,
            range(8),
            [5, 9, 2, 14, 7, 1, 11, 3],
            max_rows=3,
            chunk_size=16,
            ragged=ragged,
            packed=packed,
        )
        for _ in range(3)
    ]
    pieces = [[(p["row"], p["start"], p["end"]) for p in run.timings.prefill_pieces] for run in runs]
    assert pieces[0] == pieces[1] == pieces[2]
    assert len({(run.decode_steps, run.rows_decoding_sum, run.forward_calls) for run in runs}) == 1
    assert len({frozenset(run.call_shapes) for run in runs}) == 1
    assert len({tuple(tuple(r.token_ids) for r in run.results) for run in runs}) == 1


def test_prefill_interleaves_with_decode_in_chunks(model):
    """A long prompt arriving while rows decode is prefilled in pieces of the chunk size, a few
    pieces an iteration, so the decoding rows keep stepping meanwhile."""
    prompts = [[5] * 10, [7] * 10, [(3 * i) % 290 + 3 for i in range(480)]]
    state = schedule(model, GREEDY, prompts, range(3), [40, 40, 4], max_rows=3, chunk_size=32)
    long_pieces = [p for p in state.timings.prefill_pieces if p["row"] == 2]
    assert all(p["end"] - p["start"] <= 32 for p in long_pieces) and long_pieces[-1]["end"] == 480
    pieces_per_step = [sum(p["step"] == step for p in long_pieces) for step in {p["step"] for p in long_pieces}]
    most = pieces_per_iteration(decoding=True)
    assert max(pieces_per_step) <= most and len(pieces_per_step) >= 480 // (most * 32)  # spread over decode steps


def test_rows_that_cannot_run_are_error_rows(model):
    prompts = [[5] * 20, [6] * 600, [], [7] * 30]
    done = []
    state = schedule(model, GREEDY, prompts, range(4), [4] * 4, on_token=None)
    reasons = [r.finish_reason for r in state.results]
    assert reasons == ["length", "error", "error", "length"]
    assert "600 tokens" in state.results[1].error and "empty prompt" in state.results[2].error
    # a KV budget that holds the small row but not the large one
    per_block = kv_bytes_per_position(model) * BLOCK_SIZE
    request = GenerationRequest([RowRequest([5] * 20), RowRequest([6] * 200, row_id=1)], GREEDY, max_tokens=4)
    state = BatchScheduler(model, 512, 4, kv_budget_bytes=2 * per_block).generate(
        request, on_row_done=lambda i, r: done.append(i)
    )
    assert [r.finish_reason for r in state.results] == ["length", "error"]
    assert "runner.kv_budget_gb" in state.results[1].error and sorted(done) == [0, 1]


def test_finished_rows_free_their_blocks_for_waiting_rows(model):
    """max_rows=2 over 6 rows: the pool holds two rows' blocks, and all six run through it."""
    prompts = make_token_prompts(5, 6)
    state = schedule(model, GREEDY, prompts, range(6), [6] * 6, max_rows=2)
    per_block = kv_bytes_per_position(model) * BLOCK_SIZE
    two_largest = sorted((-(-(len(p) + 5) // BLOCK_SIZE) for p in prompts), reverse=True)[:2]
    assert state.kv_peak_bytes <= sum(two_largest) * per_block
    assert all(len(r.token_ids) == 6 for r in state.results)
    assert state.rows_decoding_sum / state.decode_steps <= 2


def test_the_segmented_decode_step_gives_the_eager_tokens(model, monkeypatch):
    """Small decode batches run the batch engine's segmented step where it is the default (GPUs);
    forced here on the CPU, every row's tokens stay those of the eager step."""
    prompts = make_token_prompts(4, 6)
    lengths = [random.Random(i).randint(1, 20) for i in range(6)]
    eager = [
        r.token_ids for r in schedule(model, GREEDY, prompts, range(6), lengths, max_rows=3, chunk_size=16).results
    ]
    from mlxcel.engine import scheduler

    used = []
    get_decoder = scheduler.get_decoder
    monkeypatch.setattr(scheduler, "get_decoder", lambda m, kind: used.append(kind) or get_decoder(m, kind))
    monkeypatch.setenv("MLXCEL_DECODE_STEP", "segmented")
    assert [
        r.token_ids for r in schedule(model, GREEDY, prompts, range(6), lengths, max_rows=3, chunk_size=16).results
    ] == eager
    assert used and set(used) == {"segmented"}  # the segmented step ran the decode steps


@pytest.mark.parametrize("kv_bits", [None, 4])
def test_a_grown_pool_keeps_what_it_held(kv_bits):
    """PageTable.grow adds blocks; each layer pads its pool at its next access, and the positions
    written before read back as they were (plain and quantized pools)."""
    from mlxcel.models.paged_cache import PageTable
    from mlxcel.models.paged_layers import make_paged_caches

    table = PageTable(2, max_rows=2, max_positions=8 * BLOCK_SIZE, max_blocks=8)
    (cache,) = make_paged_caches(1, table, kv_bits=kv_bits, kv_group_size=32)
    first = mx.arange(2 * BLOCK_SIZE, dtype=mx.int32)
    stored = [mx.random.normal((2 * BLOCK_SIZE, 2, 32), key=mx.random.key(i)) for i in range(2)]
    if kv_bits:
        stored = [p for x in stored for p in mx.quantize(x, group_size=32, bits=kv_bits)]
    cache.write_positions(first, stored)
    assert table.grow(5) and table.num_blocks == 8 and table.free_blocks == 8  # 2 -> 4 -> 8 (doubling)
    assert not table.grow(9)  # past max_blocks
    later = mx.arange(6 * BLOCK_SIZE, 8 * BLOCK_SIZE, dtype=mx.int32)
    cache.write_positions(later, stored)  # into the new blocks
    for index in (first, later):
        for got, want in zip(cache.read_positions(index), stored):
            assert mx.array_equal(got, want)
