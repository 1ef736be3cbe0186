"""runner.batch_invariant: each row's token ids equal that row run alone, whatever shares its batch
and however the job's chunk size is set, on the device MLX runs on (the CPU here and in CI; on a
GPU through the device tool: `python -m pytest tests/test_batch_invariant.py` there, where the
model is the Llama-3.2-1B shape with random weights, the shape the issue measured).

The oracle for a row is the same scheduler with that row alone (max_rows 1, no other row in the
job); schedules vary the rows' order, max_rows (1-64) and the pinned chunk size. Reruns of the
default mode on the same machine repeat their token ids too (every scheduling decision is a
function of the job and config)."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxcel.bench.checkpoints import RANDOM_SHAPES, build_random_checkpoint
from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import GenerationRequest, RowRequest
from mlxcel.engine.scheduler import INVARIANT_PIECE, BatchScheduler
from mlxcel.errors import MlxcelError
from mlxcel.models import invariant
from mlxcel.sampling import Sampler, make_sampler_chain
from tests.helpers import CHAINS, run_cli

pytestmark = pytest.mark.cuda  # (the CPU runs these too; on a GPU they check what only CUDA's kernels do)
ON_GPU = mx.default_device() == mx.gpu
GREEDY = Sampler("greedy")
SEEDED = Sampler("categorical", temperature=1.0, seed=7)
SMALL_SHAPE = {  # the CPU's model: a few layers, every part of a Llama (GQA, tied head)
    **RANDOM_SHAPES["llama-3.2-1b"],
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
}
# the GPU's: the 1B shape's widths (what picks the kernels and their reductions) at 2 of its 16
# layers: each layer runs the same kernels, and at 16 a test took ~150 s in `pytest -m cuda -n 8`
GPU_SHAPE = {**RANDOM_SHAPES["llama-3.2-1b"], "num_hidden_layers": 2}
SHAPE = GPU_SHAPE if ON_GPU else SMALL_SHAPE
DTYPES = ["bfloat16", "float32"]
CONTEXT = 2048


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariant")
    return {name: build_random_checkpoint(root / name, SHAPE, getattr(mx, name), seed=3) for name in DTYPES}


@pytest.fixture(scope="module", params=DTYPES)
def model(request, folders):
    return load_model(str(folders[request.param]), dtype=request.param).model


def make_rows(seed: int, count: int, longest: int = 700) -> tuple[list[list[int]], list[int]]:
    """Ragged prompts (a few past INVARIANT_PIECE, so rows span several pieces) and output lengths."""
    rng = random.Random(seed)
    vocab = SHAPE["vocab_size"]
    lengths = [rng.choice([rng.randint(1, 40), rng.randint(40, 200), rng.randint(400, longest)]) for _ in range(count)]
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    return prompts, [rng.randint(4, 24) for _ in range(count)]


def schedule(model, sampler, prompts, ids, max_tokens, max_rows, chunk=None, invariant_mode=True, cache=None):
    rows = [RowRequest(p, row_id=i, max_tokens=m) for p, i, m in zip(prompts, ids, max_tokens)]
    scheduler = BatchScheduler(
        model, CONTEXT, max_rows, chunk_size=chunk, batch_invariant=invariant_mode, prompt_cache=cache
    )
    state = scheduler.generate(GenerationRequest(rows, sampler, max_tokens=64))
    return {i: r.token_ids for i, r in zip(ids, state.results)}, state


def run_each_alone(model, sampler, prompts, max_tokens) -> dict[int, list[int]]:
    return {
        i: schedule(model, sampler, [p], [i], [m], max_rows=1)[0][i]
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    }


@pytest.mark.parametrize("sampler", [GREEDY, SEEDED, "full"], ids=["greedy", "seeded", "full-chain"])
def test_rows_equal_each_row_alone_in_batches_of_1_to_64(model, sampler):
    """full-chain: every stage of the sampler chain (penalties, DRY, top-k/p, typical, min-p, XTC,
    dynamic temperature), whose reductions run over each row's logits."""
    if sampler == "full":
        sampler = make_sampler_chain({"seed": 7, **CHAINS["full"]}, model.args.vocab_size)
    prompts, max_tokens = make_rows(0, 64 if ON_GPU else 14)
    alone = run_each_alone(model, sampler, prompts, max_tokens)
    n = len(prompts)
    for seed, max_rows in enumerate([n, 7, 2]):
        rng = random.Random(seed)
        order = rng.sample(range(n), n)
        chunk = rng.choice([None, 16, 100, 2048])
        got, _ = schedule(
            model, sampler, [prompts[i] for i in order], order, [max_tokens[i] for i in order], max_rows, chunk
        )
        differ = sorted(i for i in range(n) if got[i] != alone[i])
        assert not differ, f"max_rows {max_rows}, chunk {chunk}: rows {differ} differ from each row alone"


@pytest.mark.skipif(not ON_GPU, reason="the CPU's default mode gives each row's own tokens (test_scheduler.py)")
def test_the_default_mode_on_a_gpu_is_what_the_mode_fixes(model):
    """Not an assertion on the default mode (kernels may happen to agree): the figure that shows
    what batch invariance changes where it matters, printed for the device tool's log."""
    prompts, max_tokens = make_rows(1, 16)
    alone = {
        i: schedule(model, GREEDY, [p], [i], [m], max_rows=1, invariant_mode=False)[0][i]
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    }
    together, _ = schedule(model, GREEDY, prompts, list(range(16)), max_tokens, max_rows=16, invariant_mode=False)
    same = sum(together[i] == alone[i] for i in range(16))
    dtype = model.model.embed_tokens.weight.dtype
    print(f"default mode on {mx.default_device()}, {dtype}: {same}/16 rows alone = in a batch of 16")
    invariant_together, _ = schedule(model, GREEDY, prompts, list(range(16)), max_tokens, max_rows=16)
    assert invariant_together == run_each_alone(model, GREEDY, prompts, max_tokens)


def test_pieces_are_the_rows_own_whatever_the_chunk_size(model):
    prompts, max_tokens = make_rows(2, 6, longest=1300)
    for chunk in (None, 64, 1000):
        _, state = schedule(model, GREEDY, prompts, list(range(6)), max_tokens, max_rows=3, chunk=chunk)
        pieces = state.timings.prefill_pieces
        assert all(p["rows"] == 1 and p["pad"] == 0 for p in pieces)
        for i, prompt in enumerate(prompts):
            ends = [p["end"] for p in pieces if p["row"] == i]
            assert ends == [*range(INVARIANT_PIECE, len(prompt), INVARIANT_PIECE), len(prompt)], (chunk, i)


def test_an_adopted_prefix_gives_the_tokens_the_row_computes_alone(model):
    """Rows sharing a long prefix adopt it from the prompt cache at a piece boundary: the cached
    positions are what the row's own pieces would have computed."""
    from mlxcel.engine.prompt_cache import PromptCache

    rng = random.Random(5)
    shared = [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(INVARIANT_PIECE + 90)]
    prompts = [shared + [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(n)] for n in (5, 40, 300, 1)]
    max_tokens = [9, 5, 12, 7]
    alone = run_each_alone(model, SEEDED, prompts, max_tokens)
    got, state = schedule(model, SEEDED, prompts, list(range(4)), max_tokens, max_rows=2, cache=PromptCache(1 << 30))
    assert got == alone
    assert sorted(r.cached_tokens for r in state.results)[1:] == [INVARIANT_PIECE] * 3


def test_reruns_of_the_default_mode_repeat_their_tokens(model):
    prompts, max_tokens = make_rows(3, 24 if ON_GPU else 10)
    runs = [
        schedule(model, SEEDED, prompts, list(range(len(prompts))), max_tokens, max_rows=8, invariant_mode=False)[0]
        for _ in range(3)
    ]
    assert runs[0] == runs[1] == runs[2]


def test_slices_give_the_layers_values_and_switch_back():
    layer = nn.Linear(24, 40)
    x = mx.random.normal((3, 45, 24), key=mx.random.key(0))
    expected = layer(x)
    got = invariant.run_in_slices(nn.Linear.__call__.__get__(layer), x)
    assert got.shape == expected.shape and mx.allclose(got, expected, atol=1e-5).item()

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))
            self.lm_head = nn.Linear(8, 10)

    toy = Toy()
    invariant.set_batch_invariant(toy, True)
    kinds = [type(m) for m in (toy.model.layers[0], toy.model.layers[1], toy.lm_head)]
    if invariant.pads_matmuls():
        assert kinds == [invariant.InvariantEmbedding, invariant.InvariantLinear, invariant.InvariantLinear]
    else:  # the CPU's BLAS needs no padding: the layers stay as they are
        assert kinds == [nn.Embedding, nn.Linear, nn.Linear]
    invariant.set_batch_invariant(toy, False)
    assert [type(m) for m in (toy.model.layers[0], toy.model.layers[1], toy.lm_head)] == [
        nn.Embedding,
        nn.Linear,
        nn.Linear,
    ]


def test_mixture_of_experts_is_refused_with_the_reason(model):
    from mlxcel.models.switch import SwitchGLU

    model.model.experts_probe = SwitchGLU(8, 16, 2)
    try:
        with pytest.raises(MlxcelError, match="batch_invariant.*mixture-of-experts"):
            BatchScheduler(model, CONTEXT, 2, batch_invariant=True)
    finally:
        del model.model.experts_probe


@pytest.mark.slow
def test_the_run_records_its_mode_and_a_resume_keeps_it(tmp_path, tiny_llama):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"hello {i}"}) + "\n" for i in range(3)))
    common = [f"model.path={tiny_llama}", f"tokenizer.path={tiny_llama}", "prompt=jsonl", f"prompt.file={rows}"]
    common += ["decode.max_tokens=4", "runner.device=cpu", "runner.progress=off"]
    done = run_cli(tmp_path, *common, "runner.batch_invariant=true")
    assert done.returncode == 0, done.stderr
    stats = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert stats["reproducibility"]["batch_invariant"] is True and "alone" in stats["reproducibility"]["holds"]
    resumed = run_cli(tmp_path, *common, "runner.batch_invariant=false", "runner.resume=true")
    assert resumed.returncode == 2 and "runner.batch_invariant" in resumed.stderr


@pytest.fixture(scope="module")
def gemma2_folder(tmp_path_factory):
    if ON_GPU:
        pytest.skip("the GPU's own path runs there (test_rows_equal_each_row_alone_in_batches_of_1_to_64)")
    from tests.family_fixtures import make_family_checkpoint

    return make_family_checkpoint(tmp_path_factory.mktemp("gemma2"), "gemma2")


@pytest.mark.parametrize("case", ["llama", "llama-kv4", "llama-q4", "gemma2"])
def test_the_gpus_path_on_the_cpu_gives_each_rows_own_tokens(case, folders, gemma2_folder, monkeypatch):
    """The GPU's strategy forced on the CPU (64-row matmul slices, decode attention row by row,
    Gemma 2's soft-capped attention and sliding windows through it, a quantized KV pool, 4-bit
    weights with a quantized tied head): each
    row's tokens in batches equal the default mode's row alone, so the padding and slicing
    change no value (the CPU's BLAS gives every row count the same bits)."""
    folder = gemma2_folder if case == "gemma2" else folders["float32"]
    model = load_model(str(folder), dtype="float32").model
    if case == "llama-q4":
        nn.quantize(model, group_size=32, bits=4)
    kv_bits = 4 if case == "llama-kv4" else None
    vocab = 300 if case == "gemma2" else SHAPE["vocab_size"]
    rng = random.Random(9)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.choice([3, 30, 90, 600]))] for _ in range(8)]
    max_tokens = [rng.randint(3, 20) for _ in range(8)]

    def run(rows, max_rows, invariant_mode):
        requests = [RowRequest(prompts[i], row_id=i, max_tokens=max_tokens[i]) for i in rows]
        scheduler = BatchScheduler(model, CONTEXT, max_rows, batch_invariant=invariant_mode)
        state = scheduler.generate(
            GenerationRequest(requests, SEEDED, max_tokens=64, kv_bits=kv_bits, kv_group_size=32)
        )
        return {i: r.token_ids for i, r in zip(rows, state.results)}

    alone = {i: run([i], 1, False)[i] for i in range(8)}
    monkeypatch.setattr(invariant, "pads_matmuls", lambda: True)
    for max_rows in (8, 3):
        assert run(list(range(8)), max_rows, True) == alone
    switched = (invariant.InvariantQuantizedLinear, invariant.InvariantQuantizedEmbedding)
    if case != "llama-q4":
        switched = (invariant.InvariantLinear, invariant.InvariantEmbedding)
    assert type(model.model.layers[0].mlp.down_proj) is switched[0]
    if case != "gemma2":  # (a tied head: the embedding is the vocabulary's matmul)
        assert type(model.model.embed_tokens) is switched[1]


def test_rows_fed_while_the_loop_runs_get_their_own_tokens(folders, monkeypatch):
    """A server's or Ray worker's open loop: rows arrive at different iterations, so what shares
    their steps is timing; in batch-invariant mode (the GPU's path forced on the CPU) each row's
    tokens are still the row's alone."""
    from tests.helpers import ScriptedFeed

    if ON_GPU:
        pytest.skip("the forced path is the CPU's stand-in for a GPU")
    model = load_model(str(folders["bfloat16"]), dtype="bfloat16").model
    prompts, max_tokens = make_rows(4, 7)
    alone = run_each_alone(model, SEEDED, prompts, max_tokens)
    monkeypatch.setattr(invariant, "pads_matmuls", lambda: True)
    rows = [(i, RowRequest(p, row_id=i, max_tokens=m)) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    results = {}
    scheduler = BatchScheduler(model, CONTEXT, 3, batch_invariant=True)
    feed = ScriptedFeed({0: rows[:2], 2: rows[2:4], 7: rows[4:6], 40: rows[6:]})
    on_done = results.__setitem__
    for _ in scheduler.steps(GenerationRequest([], SEEDED, max_tokens=64), lambda r, t: True, on_done, feed=feed):
        pass
    assert {i: r.token_ids for i, r in results.items()} == alone


def test_stats_promise_what_each_mode_and_backend_holds():
    from mlxcel.config import RunnerConfig
    from mlxcel.stats import describe_reproducibility

    def holds(**runner):
        return describe_reproducibility(RunnerConfig.model_validate(runner))

    assert "alone" in holds(batch_invariant=True)["holds"]
    ray_gpu = holds(backend="ray", ray={"gpus_per_worker": 1})
    assert ray_gpu["gpu"] is True and "reruns can differ" in ray_gpu["holds"]  # timing decides a worker's batch
    assert "alone" in holds(backend="ray", ray={"gpus_per_worker": 1}, batch_invariant=True)["holds"]
    local = holds()
    assert local["gpu"] is ON_GPU and ("can change" in local["holds"]) is ON_GPU
