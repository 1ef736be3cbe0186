"""The scheduler as a server runs it: rows arrive while others run (a RowFeed), each may bring its
own sampler chain and logprobs, and a cancelled row frees its slot wherever it is (waiting,
prefilling or decoding). Every row's tokens equal that row run alone through the batch engine
(DirectEngine, the independent oracle)."""

from __future__ import annotations

import random

import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import GenerationRequest, RowRequest
from mlxcel.engine.prompt_cache import PromptCache
from mlxcel.engine.scheduler import BatchScheduler
from mlxcel.sampling import Sampler, make_sampler_chain
from tests.helpers import CHAINS, ScriptedFeed, make_token_prompts, run_alone

GREEDY = Sampler("greedy")

pytestmark = pytest.mark.usefixtures("on_the_cpu")  # (conftest)


@pytest.fixture(scope="module")
def model(tiny_llama, on_the_cpu):
    return load_model(str(tiny_llama), dtype="float32").model


def run_feed(model, feed, max_rows=3, chunk_size=None, prompt_cache=None):
    results, tokens = {}, {}
    scheduler = BatchScheduler(
        model,
        512,
        max_rows,
        kv_budget_bytes=50_000_000,
        chunk_size=chunk_size,
        prompt_cache=prompt_cache,
        keep_answers=prompt_cache is not None,
    )
    request = GenerationRequest([], GREEDY, max_tokens=64)

    def on_token(row, token):
        tokens.setdefault(row, []).append(token)
        return True

    def on_row_done(row, result):
        assert row not in results, f"row {row} reported twice"
        results[row] = result

    state = None
    for state in scheduler.steps(request, on_token, on_row_done, feed=feed):  # noqa: B007 (the last state)
        pass
    assert state.rows == [] and state.results == []  # a feed's rows are kept nowhere
    assert scheduler.reuse is None or not scheduler.reuse.arrays
    return results, tokens


@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "prompt-cache"])
@pytest.mark.parametrize("chunk_size", [None, 8])
def test_rows_arriving_mid_run_equal_each_row_alone(model, chunk_size, cached):
    """With the prompt cache (as the server runs): later rows share earlier rows' prefixes and
    adopt them."""
    prompts = make_token_prompts(10, 8)
    prompts[5] = prompts[0] + prompts[5]
    prompts[6] = prompts[1][:40] + prompts[6]
    lengths = [random.Random(i).randint(1, 20) for i in range(8)]
    expected = [run_alone(model, GREEDY, p, 100 + i, m).token_ids for i, (p, m) in enumerate(zip(prompts, lengths))]
    rows = [(100 + i, RowRequest(p, row_id=100 + i, max_tokens=m)) for i, (p, m) in enumerate(zip(prompts, lengths))]
    # two at once, then one every few iterations, then a gap with nothing running, then the rest
    feed = ScriptedFeed({0: rows[:2], 3: rows[2:3], 5: rows[3:4], 60: rows[4:]})
    cache = PromptCache(20_000_000) if cached else None
    results, _ = run_feed(model, feed, chunk_size=chunk_size, prompt_cache=cache)
    assert {i: r.token_ids for i, r in results.items()} == {100 + i: e for i, e in enumerate(expected)}
    assert (results[105].cached_tokens >= len(prompts[0])) == cached
    assert feed.idle_polls >= 1  # the loop waited on the feed with nothing to run


def test_rows_with_their_own_chains_and_logprobs_share_a_batch(model):
    """Greedy, seeded categorical, a stateful chain and the job's chain in one batch: each row's
    tokens (and logprobs where asked) equal its own chain's run alone."""
    vocab = model.args.vocab_size
    chains = [
        None,  # the request's (greedy)
        Sampler("categorical", temperature=1.0, seed=5),
        make_sampler_chain({"seed": 3, **CHAINS["penalties"]}, vocab),
        make_sampler_chain({"seed": 9, **CHAINS["mirostat"]}, vocab),
    ]
    prompts = make_token_prompts(11, 8)
    rows, expected = [], {}
    for i, prompt in enumerate(prompts):
        chain, logprobs = chains[i % 4], 2 if i % 3 == 0 else 0
        rows.append((i, RowRequest(prompt, row_id=i, max_tokens=10, sampler=chain, logprobs=logprobs)))
        expected[i] = run_alone(model, chain or GREEDY, prompt, i, 10, logprobs=logprobs)
    results, _ = run_feed(model, ScriptedFeed({0: rows[:5], 2: rows[5:]}), max_rows=8)
    for i, result in results.items():
        assert result.token_ids == expected[i].token_ids, i
        assert_same_logprobs(result.logprobs, expected[i].logprobs)


def assert_same_logprobs(got: list[dict] | None, want: list[dict] | None) -> None:
    """The same tokens and top ids, their logprobs within float32 rounding: a batch's attention may
    take another form than a row's alone (models/cpu_attention.py picks one by the scores' size)."""
    assert (got is None) == (want is None)
    for g, w in zip(got or [], want or [], strict=True):
        assert g["token"] == w["token"] and [t for t, _ in g["top"]] == [t for t, _ in w["top"]]
        assert g["logprob"] == pytest.approx(w["logprob"], abs=1e-5)
        assert [p for _, p in g["top"]] == pytest.approx([p for _, p in w["top"]], abs=1e-5)


def test_cancelled_rows_end_where_they_are_and_free_their_slots(model):
    """Cancelled while waiting (max_rows=1 keeps it queued), while prefilling (a long prompt in
    pieces of 4) and while decoding: each ends 'cancelled' exactly once with what it had, and the
    rows after them complete exactly."""
    rng = random.Random(3)
    long_prompt = [rng.randrange(3, 300) for _ in range(300)]  # >= 10 iterations of at most 8 pieces of 4
    prompts = [[10, 11, 12], long_prompt, [5, 6, 7], [8, 9]]
    rows = [(i, RowRequest(p, row_id=i, max_tokens=30)) for i, p in enumerate(prompts)]
    # iteration 0: rows 0..3 arrive; row 0 decodes, 1 prefills, 2 and 3 wait (2 slots)
    feed = ScriptedFeed({0: rows}, cancels={5: [0, 1, 2]})
    results, tokens = run_feed(model, feed, max_rows=2, chunk_size=4)
    assert [results[i].finish_reason for i in range(3)] == ["cancelled"] * 3
    assert results[2].token_ids == [] and results[1].token_ids == []
    expected_0 = run_alone(model, GREEDY, prompts[0], 0, 30).token_ids
    assert 0 < len(results[0].token_ids) < 30 and results[0].token_ids == expected_0[: len(results[0].token_ids)]
    assert tokens.get(0, []) == results[0].token_ids
    assert results[3].token_ids == run_alone(model, GREEDY, prompts[3], 3, 30).token_ids


@pytest.mark.parametrize("cached", [False, True], ids=["no-cache", "prompt-cache"])
def test_an_open_loops_pool_starts_small_and_grows_as_rows_need(model, monkeypatch, cached):
    """From one block, the pool doubles as rows are admitted (a later row adopting a cached
    prefix writes into blocks added after the prefix was cached); tokens are each row's alone."""
    from mlxcel.engine import scheduler
    from mlxcel.models.paged_cache import PageTable

    monkeypatch.setattr(scheduler, "OPEN_POOL_POSITIONS", 1)
    sizes = []
    grow = PageTable.grow

    def record_growth(table, needed):
        sizes.append(table.num_blocks)
        return grow(table, needed)

    monkeypatch.setattr(PageTable, "grow", record_growth)
    prompts = make_token_prompts(6, 9)
    prompts[4] = prompts[0] + prompts[4]
    lengths = [12, 30, 5, 25, 18, 9]
    expected = [run_alone(model, GREEDY, p, 100 + i, m).token_ids for i, (p, m) in enumerate(zip(prompts, lengths))]
    rows = [(100 + i, RowRequest(p, row_id=100 + i, max_tokens=m)) for i, (p, m) in enumerate(zip(prompts, lengths))]
    feed = ScriptedFeed({0: rows[:1], 2: rows[1:3], 9: rows[3:]})
    results, _ = run_feed(model, feed, prompt_cache=PromptCache(20_000_000) if cached else None)
    assert {i: r.token_ids for i, r in results.items()} == {100 + i: e for i, e in enumerate(expected)}
    assert sizes[0] == 1 and len(set(sizes)) > 2  # one block at first, then it grew more than once
    assert max(sizes) <= 3 * 512 // 32  # never past max_rows rows of the whole context


def test_an_idle_wait_for_rows_counts_as_waiting_not_host_work(model):
    """A worker or server blocked on its feed is not doing host work nor busy: host ms per step
    and busy time stay what the steps cost; the wait before the first row and the one after the
    last (before the feed closes) are outside the loop's clock."""
    import time

    class SlowFeed(ScriptedFeed):
        def poll(self, idle: bool):
            if idle:
                time.sleep(0.5)  # (a server waiting for its next request)
            return super().poll(idle)

    prompts = make_token_prompts(2, 8)
    rows = [(100 + i, RowRequest(p, row_id=100 + i, max_tokens=4)) for i, p in enumerate(prompts[:2])]
    feed = SlowFeed({0: rows[:1], 40: rows[1:]})  # idle polls before each row, none after the last
    scheduler = BatchScheduler(model, 512, 2, kv_budget_bytes=50_000_000)
    began = time.perf_counter()
    for state in scheduler.steps(GenerationRequest([], GREEDY, max_tokens=64), lambda row, token: True, feed=feed):  # noqa: B007 (the last state)
        pass
    elapsed = time.perf_counter() - began
    assert feed.idle_polls == 2 and elapsed >= 1.0
    # the wait before the first row is before the loop's clock starts (a Ray worker waiting for
    # the others to load); the one between rows is waiting and idle, not host work
    loop = state.timings.end - state.timings.start
    assert loop < elapsed - 0.5
    assert 0.5 <= state.idle_seconds <= state.wait_seconds < loop
    # busy: the steps alone (the wait counted once, as idle: host work and idle time fit in the loop)
    assert 0 < state.host_seconds and state.host_seconds + state.idle_seconds <= loop
