"""Sampler chains inside the engine on a tiny random Llama (CPU, fp32): a row's tokens do not depend
on its batch (size, order, neighbours), on prefill chunking or on pipelining; decode.logprobs."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.config import validate_config
from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
from mlxcel.runner import run
from mlxcel.sampling import make_sampler_chain
from tests.helpers import CHAINS

PROMPTS = [
    [(5 * i + 11) % 300 + 3 for i in range(37)],
    [(3 * i + 7) % 300 + 3 for i in range(9)],
    [(11 * i + 1) % 300 + 3 for i in range(23)],
]


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load_model(str(tiny_llama), dtype="float32").model


def make_chain(model, name, seed=1234, compile=None):
    return make_sampler_chain({"seed": seed, **CHAINS[name]}, model.args.vocab_size, compile=compile)


def generate(model, chain, prompts, row_ids, max_tokens=16, pipeline=True, chunk_size=2048, logprobs=0):
    rows = [RowRequest(list(p), row_id=i) for p, i in zip(prompts, row_ids)]
    request = GenerationRequest(rows, chain, max_tokens=max_tokens, chunk_size=chunk_size, logprobs=logprobs)
    return DirectEngine(model, max_context=512, pipeline=pipeline).generate(request)


def tokens_of(state):
    return [r.token_ids for r in state.results]


@pytest.mark.parametrize("name", list(CHAINS))
def test_a_rows_tokens_do_not_depend_on_its_batch_chunking_or_pipelining(model, name):
    chain = make_chain(model, name)
    batched = tokens_of(generate(model, chain, PROMPTS, [0, 1, 2]))
    alone = [tokens_of(generate(model, chain, [p], [i]))[0] for i, p in enumerate(PROMPTS)]
    assert batched == alone
    assert tokens_of(generate(model, chain, PROMPTS[::-1], [2, 1, 0])) == alone[::-1]
    assert tokens_of(generate(model, chain, PROMPTS[:2], [0, 1], chunk_size=5)) == alone[:2]
    assert tokens_of(generate(model, chain, PROMPTS, [0, 1, 2], pipeline=False)) == batched
    assert (
        tokens_of(generate(model, make_chain(model, name), PROMPTS, [0, 1, 2])) == batched
    )  # a fresh chain, same seed
    assert tokens_of(generate(model, make_chain(model, name, seed=7), PROMPTS, [0, 1, 2])) != batched


def test_compiled_step_gives_the_eager_tokens(model):
    """mx.compile is used on a GPU only; forced here, the tokens and the carried state match eager."""
    eager = generate(model, make_chain(model, "penalties", compile=False), PROMPTS, [0, 1, 2])
    compiled = generate(model, make_chain(model, "penalties", compile=True), PROMPTS, [0, 1, 2])
    assert compiled.sampling.compiled and not eager.sampling.compiled
    assert tokens_of(compiled) == tokens_of(eager)
    assert np.array_equal(np.array(compiled.sampling.state["suffix"]), np.array(eager.sampling.state["suffix"]))


def test_penalties_see_the_prompt_and_the_generated_tokens(model):
    """A strong repetition penalty over the whole history never lets greedy repeat a token."""
    chain = make_sampler_chain(
        {"processors": {"penalties": {"repeat": 1e6, "presence": 1e3, "last_n": -1}}, "selector": {"kind": "greedy"}},
        model.args.vocab_size,
    )
    tokens = tokens_of(generate(model, chain, PROMPTS[:1], [0], max_tokens=20))[0]
    assert len(set(tokens)) == len(tokens) and not set(tokens) & set(PROMPTS[0])


def test_logprobs_of_each_token_and_its_alternatives(model):
    greedy = make_sampler_chain({"selector": {"kind": "greedy"}}, model.args.vocab_size)
    state = generate(model, greedy, PROMPTS[:2], [0, 1], max_tokens=6, logprobs=3)
    for result in state.results:
        assert [entry["token"] for entry in result.logprobs] == result.token_ids
        for entry in result.logprobs:
            assert len(entry["top"]) == 3 and entry["top"][0][0] == entry["token"]
            assert entry["logprob"] == entry["top"][0][1] and [v for _, v in entry["top"]] == sorted(
                (v for _, v in entry["top"]), reverse=True
            )
    logits = model(mx.array([PROMPTS[0]]), model.make_cache())[:, -1, :]
    expected = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0]
    first = state.results[0].logprobs[0]
    assert abs(first["logprob"] - expected[first["token"]]) < 1e-4
    sampled = generate(model, make_chain(model, "full"), PROMPTS[:1], [0], max_tokens=6, logprobs=2)
    assert all(
        entry["logprob"] <= entry["top"][0][1] + 1e-6 and np.isfinite(entry["logprob"])
        for entry in sampled.results[0].logprobs
    )
    assert tokens_of(sampled) == tokens_of(generate(model, make_chain(model, "full"), PROMPTS[:1], [0], max_tokens=6))


def test_decode_logprobs_are_written_to_generations_jsonl(tiny_llama, tmp_path):
    cfg = validate_config(
        {
            "model": {"path": str(tiny_llama), "max_context": 128},
            "template": {"kind": "none"},
            "prompt": {"text": "Hello there"},
            "decode": {"max_tokens": 4, "ignore_eos": True, "logprobs": 2},
            "sampler": {
                "processors": {"min_p": {}, "temperature": {"value": 0.9}},
                "selector": {"kind": "categorical"},
            },
        }
    )
    run(cfg, tmp_path / "run", stream=None, log=None)
    row = json.loads((tmp_path / "run" / "generations.jsonl").read_text().splitlines()[0])
    assert [entry["token"] for entry in row["logprobs"]] == row["token_ids"] and len(row["token_ids"]) == 4
    assert all(len(entry["top"]) == 2 for entry in row["logprobs"])
    resolved = json.loads((tmp_path / "run" / "config.resolved.json").read_text())
    assert [stage["stage"] for stage in resolved["sampler"]["chain"]] == ["min_p", "temperature", "draw"]
    stats = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert stats["sampler_chain"] == resolved["sampler"]["chain"]
