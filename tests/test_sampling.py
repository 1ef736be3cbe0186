"""The sampler chain against tests/sampler_reference.py (NumPy, float64, written from docs/sampling.md),
stage by stage and as whole chains, plus edge cases, DRY by hand and statistical checks.

Tolerances: kept sets identical and log-probabilities within 2e-4 + 5e-5 * |logprob| (float32 vs
float64 over a 50k vocabulary; the relative part covers dynamic temperature's entropy). Top-p and
typical-p cut on cumulative mass (typical-p also on the entropy), which float32 sums over thousands
of tokens get only to ~1e-4, as large as the probability of the tokens at the cut; there up to 4
tokens at the cut may differ, holding at most 2e-3 of the mass (log-probabilities then within 2e-3).
Statistical tests use fixed seeds; their bounds are stated where they are checked.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.errors import ConfigError
from mlxcel.sampling import RowKey, cuda_draw, make_sampler_chain
from mlxcel.sampling.chain import KEY_TABLE_STEPS
from mlxcel.sampling.config import PROCESSORS
from mlxcel.sampling.rng import (
    XTC_STREAM,
    make_base_keys,
    make_step_key_words,
    make_uniform,
)
from mlxcel.sampling.selectors import graph_gumbel_max
from tests.sampler_reference import (
    ref_adaptive_p_logits,
    ref_chain,
    ref_mirostat_v1_support,
    ref_mirostat_v2_support,
)

VOCAB = 50_000
BATCH = 3
TOL = 2e-4


def random_logits(seed: int, batch: int = BATCH, vocab: int = VOCAB, scale: float = 2.5) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((batch, vocab)) * scale).astype(np.float32)


def random_histories(seed: int, batch: int = BATCH, vocab: int = VOCAB) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    histories = []
    for b in range(batch):
        pool = rng.integers(0, vocab, size=12)  # few distinct tokens: repeats and repeated runs
        tokens = list(rng.choice(pool, size=20 + 15 * b))
        histories.append(tokens + tokens[3:11] + tokens[:5])
    return histories


def filled(processors: dict) -> dict:
    """Every parameter filled with docs/sampling.md's defaults, as the reference takes them."""
    return {name: PROCESSORS[name].model_validate(params).model_dump() for name, params in processors.items()}


def chain_step(chain, logits: np.ndarray, histories=None, position: int = 0):
    """(tokens, the logits drawn from) for rows 0..B-1 at one position."""
    rows = [RowKey(i) for i in range(len(logits))]
    batch = chain.start(rows, histories)
    tokens, z, _ = chain.run_step(mx.array(logits), make_step_key_words(batch.keys, position)[:, 0], batch.state)
    return np.array(tokens), np.array(z - mx.logsumexp(z, axis=-1, keepdims=True))


def xtc_gates(chain, batch: int, position: int = 0) -> list[float]:
    keys = chain.start([RowKey(i) for i in range(batch)]).keys
    return np.array(make_uniform(keys, position, XTC_STREAM, 1))[:, 0].tolist()


def assert_same_distribution(got: np.ndarray, want: np.ndarray, at_cut: int = 0) -> None:
    """at_cut: how many tokens at a float-sensitive cut may differ (see the module docstring)."""
    differ = np.isfinite(got) != np.isfinite(want)
    assert differ.sum() <= at_cut, (
        f"kept sets differ in {differ.sum()} tokens: {np.isfinite(got).sum()} vs {np.isfinite(want).sum()}"
    )
    mass = np.exp(np.where(np.isfinite(got), got, np.where(np.isfinite(want), want, -np.inf))[differ]).sum()
    assert mass <= 2e-3
    both = np.isfinite(got) & np.isfinite(want)
    assert (np.abs(got[both] - want[both]) - 5e-5 * np.abs(want[both])).max() <= (TOL if not differ.any() else 2e-3)


def char_encode(text: str) -> list[int]:
    return [ord(ch) for ch in text]


STAGES = {
    "logit_bias": {"bias": {5: 3.0, 17: -2.5, 99: 40.0}, "suppress": [3, 4], "ignore_eos": True},
    "penalties": {"repeat": 1.3, "frequency": 0.2, "presence": 0.4, "last_n": 32},
    "penalties_whole": {"repeat": 0.8, "frequency": 0.5, "presence": -0.3, "last_n": -1},
    "dry": {"multiplier": 0.8, "base": 1.75, "allowed_length": 2, "last_n": 64},
    "dry_whole": {"multiplier": 2.0, "base": 3.0, "allowed_length": 1, "last_n": -1},
    "top_n_sigma": {"n": 1.5},
    "top_k": {"k": 40},
    "typical_p": {"p": 0.7},
    "top_p": {"p": 0.9},
    "min_p": {"p": 0.05},
    "temperature": {"value": 0.7},
    "dynatemp": {"value": 0.8, "dynatemp_range": 0.5, "dynatemp_exponent": 1.5},
}


@pytest.mark.parametrize("case", list(STAGES))
def test_each_stage_matches_the_reference(case):
    name = {"penalties_whole": "penalties", "dry_whole": "dry", "dynatemp": "temperature"}.get(case, case)
    processors = filled({name: STAGES[case]})
    histories = random_histories(1) if name in ("penalties", "dry") else None
    chain = make_sampler_chain(
        {"processors": processors, "selector": {"kind": "categorical"}}, VOCAB, eos_token_ids=[2]
    )
    logits = random_logits(7)
    got = np.array(chain.logprobs(mx.array(logits), histories))
    for row in range(BATCH):
        want = ref_chain(logits[row], processors, history=histories and histories[row], eos=[2])
        assert_same_distribution(got[row], want, at_cut=4 if name in ("typical_p", "top_p") else 0)
    assert np.isfinite(got).sum(axis=-1).min() >= 1


def test_penalties_and_dry_change_the_logits():
    """The history stages are not accidentally no-ops on the reference's data."""
    logits, histories = random_logits(7), random_histories(1)
    for name in ("penalties", "dry"):
        chain = make_sampler_chain({"processors": filled({name: STAGES[name]})}, VOCAB)
        changed = np.abs(np.array(chain.logprobs(mx.array(logits), histories)) - ref_chain(logits[0], {})[None]).max(
            axis=-1
        )
        assert (changed > 1e-2).all()


WHOLE_CHAINS = [
    (
        {
            "penalties": STAGES["penalties"],
            "dry": STAGES["dry"],
            "top_k": {"k": 200},
            "top_p": {"p": 0.95},
            "min_p": {"p": 0.02},
            "temperature": {"value": 0.8},
        },
        0,
    ),
    (
        {
            "logit_bias": STAGES["logit_bias"],
            "top_n_sigma": {"n": 2.0},
            "typical_p": {"p": 0.9},
            "min_p": {"p": 0.01},
            "temperature": STAGES["dynatemp"],
        },
        0,
    ),
    (
        {"top_k": {"k": 3}, "top_p": {"p": 0.5}, "min_p": {"p": 0.9}, "temperature": {"value": 1.5}},
        25,
    ),  # min_keep wins everywhere
    ({"top_k": {"k": 60_000}, "typical_p": {"p": 0.2}, "top_p": {"p": 0.3}, "temperature": {"value": 1.0}}, 4),
]


@pytest.mark.parametrize("processors, min_keep", WHOLE_CHAINS)
def test_whole_chains_match_the_reference(processors, min_keep):
    processors = filled(processors)
    histories = random_histories(3)
    chain = make_sampler_chain(
        {"min_keep": min_keep, "processors": processors, "selector": {"kind": "categorical"}}, VOCAB, eos_token_ids=[2]
    )
    logits = random_logits(11)
    got = np.array(chain.logprobs(mx.array(logits), histories))
    for row in range(BATCH):
        want = ref_chain(logits[row], processors, min_keep, histories[row], eos=[2])
        assert_same_distribution(got[row], want, at_cut=4 if "typical_p" in processors or "top_p" in processors else 0)
    if min_keep:
        assert (np.isfinite(got).sum(axis=-1) >= min_keep).all()


def test_xtc_in_a_chain_matches_the_reference_with_each_rows_gate():
    processors = filled(
        {"min_p": {"p": 0.001}, "xtc": {"probability": 0.5, "threshold": 0.05}, "temperature": {"value": 1.0}}
    )
    chain = make_sampler_chain({"processors": processors}, 400)
    logits = random_logits(5, batch=16, vocab=400, scale=3.0)
    _, got = chain_step(chain, logits)
    gates = xtc_gates(chain, 16)
    fired = 0
    for row in range(16):
        want = ref_chain(logits[row], processors, u_xtc=gates[row])
        assert_same_distribution(got[row], want)
        fired += np.isfinite(want).sum() < np.isfinite(ref_chain(logits[row], processors, u_xtc=1.0)).sum()
    assert 0 < fired < 16  # both branches exercised


@pytest.mark.parametrize(
    "logits, min_keep",
    [
        ([4.0, 1.0, 0.9, 0.8, 0.7], 0),  # one token above the threshold: nothing to remove
        ([3.0, 2.9, -9.0, -9.0, -9.0], 0),  # two above: the more probable goes
        ([3.0, 2.9, 1.5, -9.0, -9.0], 3),  # three above: removing two leaves 3 >= min_keep, so they go
        ([3.0, 2.9, 1.5, -9.0, -9.0], 4),  # ... but 3 < min_keep 4: nothing goes
        ([3.0, 2.9, 1.5, 1.4, -9.0], 3),  # 1.5 falls below 0.1 now: two above, the first goes
        ([2.0, 1.9, 1.8, 1.7, 1.6], 2),  # all five above: removing four would leave 1 < 2
    ],
)
def test_xtc_edge_cases_match_the_reference(logits, min_keep):
    processors = filled({"xtc": {"probability": 1.0, "threshold": 0.1}})
    chain = make_sampler_chain({"min_keep": min_keep, "processors": processors}, 5)
    _, got = chain_step(chain, np.array([logits], np.float32))
    want = ref_chain(np.array(logits, np.float32), processors, min_keep=min_keep, u_xtc=0.0)
    assert np.isfinite(got[0]).tolist() == np.isfinite(want).tolist()


def test_top_k_keeps_ties_at_the_boundary_and_top_k_above_vocab_is_a_no_op():
    logits = np.array([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0]], np.float32)
    lp = np.array(make_sampler_chain({"processors": {"top_k": {"k": 2}}}, 6).logprobs(mx.array(logits)))
    assert np.isfinite(lp[0]).tolist() == [True, True, True, True, False, False]
    lp = np.array(make_sampler_chain({"processors": {"top_k": {"k": 6}}}, 6).logprobs(mx.array(logits)))
    assert np.isfinite(lp).all()
    np.testing.assert_allclose(lp[0], logits[0] - np.log(np.exp(logits[0]).sum()), atol=1e-6)


def test_all_but_one_removed_keeps_that_one_through_every_stage():
    logits = np.full((2, 300), -np.inf, np.float32)
    logits[0, 17], logits[1, 250] = 1.5, -3.0
    names = ("top_n_sigma", "top_k", "typical_p", "top_p", "min_p")
    processors = filled(
        {name: STAGES[name] for name in names}
        | {"xtc": {"probability": 1.0, "threshold": 0.1}, "temperature": STAGES["dynatemp"]}
    )
    chain = make_sampler_chain({"min_keep": 3, "processors": processors}, 300)
    tokens, lp = chain_step(chain, logits)
    assert tokens.tolist() == [17, 250]
    assert np.isfinite(lp).sum(axis=-1).tolist() == [1, 1]


def test_temperature_at_or_below_zero_is_greedy_after_the_filters():
    logits = random_logits(2, batch=4, vocab=1000)
    chain = make_sampler_chain(
        {"processors": {"typical_p": {"p": 0.5}, "temperature": {"value": 0.0}}, "selector": {"kind": "categorical"}},
        1000,
    )
    assert chain.draw == {"stage": "draw", "kind": "greedy"}
    tokens, lp = chain_step(chain, logits)
    assert tokens.tolist() == np.argmax(lp, axis=-1).tolist()


# ---- DRY on hand-built histories (one character = one token) ----
def dry_penalty(history: str, follower: str, breakers=("\n", ":"), **params) -> float:
    """How much DRY lowers `follower`'s logit after `history`."""
    params = {"multiplier": 1.0, "base": 2.0, "allowed_length": 2, "last_n": -1, "breakers": list(breakers)} | params
    chain = make_sampler_chain({"processors": {"dry": params}}, 256, encode=char_encode)
    lp = np.array(chain.logprobs(mx.zeros((1, 256)), [char_encode(history)]))[0]
    return float(lp.max() - lp[ord(follower)])


def test_dry_penalizes_the_token_that_extends_a_repeat():
    assert dry_penalty("abcdXabc", "d") == pytest.approx(2.0, abs=1e-5)  # "abc" repeats (L=3): 1 * 2^(3-2)
    assert dry_penalty("abczdabczd", "a") == pytest.approx(8.0, abs=1e-5)  # L=5: 2^3
    assert dry_penalty("abczdabczd", "b") == 0.0
    assert dry_penalty("abcdXabc", "d", base=1.5, multiplier=0.5) == pytest.approx(0.75, abs=1e-5)
    assert dry_penalty("abcdXabc", "d", last_n=5) == 0.0  # the first "abc" lies outside the window
    assert dry_penalty("abcdXabc", "d", multiplier=0.0) == 0.0


def test_dry_breakers_cap_the_repeat_and_are_never_penalized():
    assert dry_penalty("abc\ndabc\nd", "a") == 0.0  # the breaker 1 token back: rep_limit 1 < allowed 2
    assert dry_penalty("abcd\nabc", "d") == pytest.approx(2.0, abs=1e-5)  # the breaker before "abc" does not cut it
    assert dry_penalty("xab:xab", ":", breakers=(":",)) == 0.0  # a single-token breaker follows: never penalized
    assert dry_penalty("xab:xab", ":", breakers=()) == pytest.approx(2.0, abs=1e-5)
    # a two-token breaker "zq": head z, tail q; the match before it is capped at 2 tokens
    assert dry_penalty("abzqab", "z", breakers=("zq",)) == pytest.approx(1.0, abs=1e-5)
    assert dry_penalty("abzqab", "z", breakers=()) == pytest.approx(1.0, abs=1e-5)
    assert dry_penalty("zqabzqab", "z", breakers=("zq",)) == pytest.approx(1.0, abs=1e-5)  # L=4 capped at 3 - 1 = 2
    assert dry_penalty("zqabzqab", "z", breakers=()) == pytest.approx(4.0, abs=1e-5)  # uncapped L=4: 2^2


def test_dry_state_updated_on_the_device_matches_a_fresh_scan():
    """The suffix lengths carried from step to step equal a rebuild from the full history."""
    processors = filled({"dry": STAGES["dry"]})
    chain = make_sampler_chain({"processors": processors, "selector": {"kind": "greedy"}}, 64, encode=char_encode)
    rng = np.random.default_rng(0)
    histories = [list(rng.integers(0, 6, size=n)) for n in (3, 30, 70)]
    batch = chain.start([RowKey(i) for i in range(3)], histories)
    for _ in range(12):
        logits = rng.standard_normal((3, 64)).astype(np.float32)
        got = np.array(chain.apply_stages(mx.array(logits), make_step_key_words(batch.keys, 0)[:, 0], batch.state))
        for row in range(3):
            want = ref_chain(logits[row], processors, history=histories[row])
            np.testing.assert_allclose(got[row] - np.log(np.exp(got[row]).sum()), want, atol=TOL)
        tokens = batch.sample(mx.array(logits)).tokens.tolist()
        for row in range(3):
            histories[row].append(tokens[row])


# ---- draws ----
def test_mirostat_and_adaptive_p_draw_from_the_reference_distribution():
    logits = random_logits(4, batch=2, vocab=2000)
    for kind, ref in (("mirostat_v2", ref_mirostat_v2_support), ("mirostat_v1", ref_mirostat_v1_support)):
        chain = make_sampler_chain({"selector": {"kind": kind, "tau": 3.0}}, 2000)
        _, lp = chain_step(chain, logits)
        for row in range(2):
            assert_same_distribution(lp[row], ref(logits[row], 6.0))  # mu starts at 2 tau
    chain = make_sampler_chain({"selector": {"kind": "adaptive_p", "target": 0.3, "decay": 0.9}}, 2000)
    _, lp = chain_step(chain, logits)
    for row in range(2):
        assert_same_distribution(lp[row], ref_adaptive_p_logits(logits[row], 0.3 / 0.1, 1 / 0.1, 0.3))


def test_categorical_frequencies_follow_the_softmax():
    """Chi-square over 20k draws (rows and positions): below the 0.1% critical value for 9 dof (27.88)."""
    logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 1.2, -2.0], np.float32)
    chain = make_sampler_chain({"seed": 3, "processors": {"temperature": {"value": 0.7}}}, 10)
    rows = [RowKey(i) for i in range(2000)]
    counts = np.zeros(10)
    for position in range(10):
        tokens = chain(mx.broadcast_to(mx.array(logits), (2000, 10)), rows, [position] * 2000)
        counts += np.bincount(np.array(tokens), minlength=10)
    p = np.exp(logits / 0.7 - np.log(np.exp(logits / 0.7).sum()))
    expected = p * counts.sum()
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 27.88


def test_xtc_gate_fires_with_its_probability():
    """4000 rows: the top token is removed in 30% of them (4 sigma = 0.029)."""
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.06, 0.04], np.float32))
    chain = make_sampler_chain(
        {"processors": {"xtc": {"probability": 0.3, "threshold": 0.1}}, "selector": {"kind": "greedy"}}, 5
    )
    tokens = np.array(chain(mx.broadcast_to(mx.array(logits), (4000, 5)), [RowKey(i) for i in range(4000)], [0] * 4000))
    assert set(tokens.tolist()) == {0, 2}  # fired: 0.4 and 0.3 removed, 0.2 (the least above 0.1) kept
    assert abs((tokens == 2).mean() - 0.3) < 0.029


def run_feedback(chain, steps: int, batch: int, vocab: int, seed: int):
    """Feed fresh Zipf-like logits each step; returns (per-step logprob of the drawn token under
    the distribution drawn from, its probability among the candidates before the draw)."""
    rng = np.random.default_rng(seed)
    sampler = chain.start([RowKey(i) for i in range(batch)], logprobs=1)
    drawn_lp, original_p = [], []
    for _ in range(steps):
        ranks = np.argsort(rng.random((batch, vocab)), axis=-1) + 1
        logits = (-1.1 * np.log(ranks) + rng.standard_normal((batch, vocab)) * 0.3).astype(np.float32)
        draw = sampler.sample(mx.array(logits))
        tokens = np.array(draw.tokens)
        drawn_lp.append(np.array(draw.logprobs))
        before_draw = np.array(chain.logprobs(mx.array(logits)))  # the candidates' probabilities
        original_p.append(np.exp(before_draw[np.arange(batch), tokens]))
    return np.array(drawn_lp), np.array(original_p)


@pytest.mark.parametrize("kind", ["mirostat_v2", "mirostat_v1"])
def test_mirostat_mean_surprise_approaches_tau(kind):
    """Over steps 80-250 of 16 rows, the mean observed surprise is tau = 4 bits within 0.25
    (a plain draw from these distributions averages ~6.3 bits)."""
    chain = make_sampler_chain({"selector": {"kind": kind, "tau": 4.0, "eta": 0.1}}, 500)
    lp, _ = run_feedback(chain, 250, 16, 500, seed=1)
    surprise = -lp[80:] / math.log(2)
    assert abs(surprise.mean() - 4.0) < 0.25


def run_adaptive_p(target: float | None, steps: int = 250, batch: int = 32, width: int = 10) -> float:
    """Mean probability of the drawn token over steps 100.. when each step offers `width`
    candidates with Dirichlet(0.5) probabilities; target None: a plain categorical draw."""
    selector = {"kind": "categorical"} if target is None else {"kind": "adaptive_p", "target": target, "decay": 0.9}
    sampler = make_sampler_chain({"selector": selector}, width).start([RowKey(i) for i in range(batch)])
    rng = np.random.default_rng(3)
    chosen = []
    for _ in range(steps):
        probs = rng.dirichlet(np.full(width, 0.5), size=batch)
        tokens = np.array(sampler.sample(mx.array(np.log(probs).astype(np.float32))).tokens)
        chosen.append(probs[np.arange(batch), tokens])
    return float(np.mean(chosen[100:]))


def test_adaptive_p_average_selected_probability_approaches_target():
    """Target 0.1: the mean selected probability lands within 0.03 of it (a plain draw averages ~0.25).
    The rule steers (a = 2*target - average) without an integral term, so it settles near, not at,
    the target (0.2 -> ~0.17, 0.3 -> ~0.27 here); higher targets must give higher averages."""
    assert abs(run_adaptive_p(0.1) - 0.1) < 0.03
    assert abs(run_adaptive_p(None) - 0.1) > 0.1
    averages = [run_adaptive_p(t, steps=180) for t in (0.1, 0.2, 0.3)]
    assert averages == sorted(averages) and averages[-1] - averages[0] > 0.1


# ---- keys and API ----
def test_row_streams_depend_on_row_position_and_seed_only():
    logits = mx.zeros((3, 5000))
    chain = make_sampler_chain({"seed": 1, "processors": {"temperature": {"value": 1.0}}}, 5000)
    rows = [RowKey("a"), RowKey("b"), RowKey("a", sample_index=1)]
    together = np.array(chain(logits, rows, [4, 4, 4])).tolist()
    alone = [np.array(chain(logits[:1], [r], [4])).tolist()[0] for r in rows]
    assert together == alone and len(set(together)) == 3
    assert np.array(chain(logits, rows, [5, 5, 5])).tolist() != together
    seeded = [np.array(chain(logits[:1], [RowKey("a", seed=9)], [4])).tolist()[0]]
    assert seeded != together[:1]


def test_a_batch_steps_through_its_key_table_as_the_per_position_keys():
    """The batch derives KEY_TABLE_STEPS steps' keys at once; every step, across refills, has the
    keys of its own position, so the draws equal a direct call at that position."""
    chain = make_sampler_chain({"seed": 3, "processors": {"temperature": {"value": 1.0}}}, 4000)
    rows = [RowKey(i) for i in range(3)]
    batch = chain.start(rows)
    logits = mx.array(random_logits(2, batch=3, vocab=4000))
    for position in range(KEY_TABLE_STEPS + 2):
        want_keys = make_step_key_words(batch.keys, position)[:, 0]
        assert np.array_equal(np.array(batch.step_keys()), np.array(want_keys))
        assert batch.sample(logits).tokens.tolist() == chain(logits, rows, [position] * 3).tolist()


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_draw.is_available(), reason="MLX's CUDA backend only")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_cuda_gumbel_max_draws_the_graph_tokens(dtype):
    base = make_base_keys([11 * i + 5 for i in range(6)])
    for position in range(10):
        x = mx.array(random_logits(position, batch=6, vocab=VOCAB, scale=0.5 + position % 3)).astype(dtype)
        if position % 2:
            x[:, : VOCAB // 2] = -math.inf
        step_keys = make_step_key_words(base, position)[:, 0]
        assert cuda_draw.gumbel_max(x, step_keys).tolist() == graph_gumbel_max(x, step_keys).tolist()
    ends = mx.full((2, 300), -math.inf)  # all removed: index 0 as mx.argmax; one left: that one
    ends[1, 299] = 0.0
    assert cuda_draw.gumbel_max(ends, make_step_key_words(base[:2], 0)[:, 0]).tolist() == [0, 299]


def test_make_sampler_chain_errors_name_the_key_and_range():
    with pytest.raises(ConfigError) as info:
        make_sampler_chain({"processors": {"min_p": {"p": 2.0}}}, 100)
    assert (
        info.value.issues[0].format()
        == "sampler.processors.min_p.p: must be in [0.0, 1.0]; 0.0 turns min-p off (got 2.0)"
    )
    with pytest.raises(ConfigError) as info:
        make_sampler_chain({"processors": {"logit_bias": {"bias": {150: 1.0}, "suppress": [7]}}}, 100)
    assert (
        info.value.issues[0].format()
        == "sampler.processors.logit_bias.bias.150: token id must be in [0, 100) for this model (got 150)"
    )


def test_effective_chain_order_and_special_cases():
    chain = make_sampler_chain(
        {"processors": {"temperature": {}, "min_p": {}, "logit_bias": {"suppress": [1]}, "top_p": {"p": 1.0}}}, 10
    )
    assert [s["stage"] for s in chain.chain] == [
        "logit_bias",
        "min_p",
        "temperature",
        "draw",
    ]  # code order; top_p 1.0 is off
    miro = make_sampler_chain(
        {"processors": {"penalties": {"repeat": 1.1}, "temperature": {}}, "selector": {"kind": "mirostat_v2"}}, 10
    )
    assert [s["stage"] for s in miro.chain] == ["penalties", "temperature", "draw"] and miro.draw["tau"] == 5.0
    off = make_sampler_chain({"selector": {"kind": "adaptive_p"}}, 10)  # target -1: a plain draw
    assert off.draw == {"stage": "draw", "kind": "categorical"}


def test_breakers_are_encoded_as_they_appear_mid_text():
    """A SentencePiece dummy-prefix token in front of a breaker is dropped; real leading pieces stay."""

    pieces = {1: "", 2: " ", 13: "\n", 5: "a", 6: "b"}

    class Tokenizer:
        def encode(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return {"\n": [1, 13], " \n": [2, 13], "ab": [5, 6]}[text]

        def decode(self, ids):
            return "".join(pieces[i] for i in ids)

    from mlxcel.sampling.history import make_piece_encoder

    encode = make_piece_encoder(Tokenizer())
    assert (encode("\n"), encode(" \n"), encode("ab")) == ([13], [2, 13], [5, 6])


def test_cpu_compile_needs_a_cpu_compiler(monkeypatch):
    """Without a C++ compiler MLX cannot compile CPU kernels: the big-batch chain runs eagerly."""
    from mlxcel.sampling import chain

    if mx.default_device() == mx.gpu:
        pytest.skip("the CPU rule")
    assert chain.should_compile(None, 32, 151936) == chain.has_cpu_jit_compiler()
    monkeypatch.setattr(chain, "has_cpu_jit_compiler", lambda: False)
    assert chain.should_compile(None, 32, 151936) is False and chain.should_compile(True, 32, 151936) is True


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize(
    "processors",
    [
        {
            "top_k": {"k": 300},
            "top_p": {"p": 0.9},
            "min_p": {"p": 0.02},
            "xtc": {"probability": 1.0, "threshold": 0.01},
            "temperature": {"value": 0.8},
        },
        {"top_n_sigma": {"n": 1.5}, "typical_p": {"p": 0.8}, "temperature": STAGES["dynatemp"]},
        {
            "logit_bias": {"bias": {5: 3.0, 17: -2.5}, "suppress": [3, 4]},
            "top_p": {"p": 0.5},
        },  # bias first: everything after runs in float32
    ],
    ids=["truncations", "sigma+typical+dynatemp", "bias-then-top-p"],
)
def test_half_precision_logits_sample_as_their_float32_values(processors, dtype):
    """The truncations run on the model's own dtype: the same candidates, log-probabilities and
    draws as the float32 copy of the same values (exact: they only compare and select values)."""
    half = mx.array(random_logits(5, batch=4)).astype(dtype)
    full = half.astype(mx.float32)
    chain = make_sampler_chain(
        {"processors": processors, "selector": {"kind": "categorical"}}, VOCAB, eos_token_ids=[2]
    )
    got, want = np.array(chain.logprobs(half)), np.array(chain.logprobs(full))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], atol=1e-6)
    assert 1 < np.isfinite(got).sum(axis=-1).min() < VOCAB  # the chain really cut something
    for position in range(4):
        assert (
            chain_step(chain, half, position=position)[0].tolist()
            == chain_step(chain, full, position=position)[0].tolist()
        )
