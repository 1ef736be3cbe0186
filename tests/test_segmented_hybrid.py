"""The segmented decode step (engine/segmented.py) on the families whose layers are not all alike:
recurrent layers (Qwen 3.5 dense and MoE, Qwen3-Next: Gated DeltaNet; Nemotron-H: Mamba-2 beside
MLP and MoE blocks) run inside the compiled segments with their states as inputs and outputs, and
Gemma 4's per-layer inputs, layer scalars and shared-KV layers run there too. One segmented step
gives the eager step's logits, and greedy tokens are the eager ones through the batch engine and
through the scheduler (rows of different lengths, rows joining and leaving the decode batch).
fp32 on the CPU, tiny random checkpoints written by transformers."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
from mlxcel.engine.engine import get_decoder
from mlxcel.engine.scheduler import BatchScheduler
from mlxcel.engine.segmented import SegmentedDecoder
from mlxcel.sampling import Sampler
from tests.family_fixtures import PROMPT

pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("on_the_cpu")  # (conftest) exactness is promised in fp32 on the CPU

STEPS = 12  # past Gemma 4's 8-token window: its rings wrap
TOKENS = 16
BATCH = [PROMPT, PROMPT[5:28], PROMPT[:9]]
# the scheduler's rows: different lengths, prefilled in pieces; more rows than slots in one run
ROWS = [PROMPT * 2, PROMPT[5:28], PROMPT[:9], PROMPT[3:34]]

HYBRIDS = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "nemotron_h"]
GEMMA4 = ["gemma4-ple", "gemma4-k_eq_v", "gemma4-moe"]  # (test_families_gemma4's variants)


def write_checkpoint(folder, name: str):
    if name == "nemotron_h":
        from tests.test_families_nemotron_h import write_nemotron_h

        return write_nemotron_h(folder)
    if name.startswith("gemma4-"):
        from tests.test_families_gemma4 import make_checkpoint

        return make_checkpoint(folder, name.split("-", 1)[1])
    from tests.test_families_qwen3_5 import make_checkpoint

    return make_checkpoint(folder, name)


@pytest.fixture(scope="module", params=HYBRIDS + GEMMA4)
def model(request, tmp_path_factory, on_the_cpu):
    folder = write_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return load_model(str(folder), dtype="float32").model


def prefill(model, prompts: list[list[int]]) -> tuple[mx.array, list]:
    length = max(map(len, prompts))
    left_pad = [length - len(p) for p in prompts]
    cache = model.make_cache(len(prompts), left_pad)
    tokens = mx.array([[0] * pad + p for pad, p in zip(left_pad, prompts)])
    return model(tokens, cache, logits_at=length - 1)[:, -1, :], cache


def test_a_segment_runs_between_each_pair_of_attention_calls(model):
    """One compiled segment per attention call plus one: recurrent and MLP layers inside them."""
    decoder = SegmentedDecoder(model)
    layers = model.model.layers
    attending = [i for i, layer in enumerate(layers) if "self_attn" in layer]
    assert decoder.attending == attending and len(decoder._segments) == len(attending) + 1
    assert sorted(i for run in decoder.runs for i in run) == [i for i in range(len(layers)) if i not in attending]


def test_a_model_without_recurrent_layers_keeps_its_segments(tiny_llama):
    """Every layer attends: one segment between each pair of layers, none runs a layer or a state."""
    model = load_model(str(tiny_llama), dtype="float32").model
    decoder = SegmentedDecoder(model)
    assert len(decoder._segments) == len(model.model.layers) + 1
    assert decoder.runs == [[]] * len(decoder._segments) and decoder.stateful == decoder.runs


@pytest.mark.parametrize("prompts", [BATCH[:1], BATCH], ids=["batch1", "left_padded"])
def test_segmented_steps_give_the_eager_logits_and_tokens(model, prompts):
    """From the same prefill, each step's logits within 1e-5 of the eager step's (both fed the
    eager tokens), the same greedy tokens; the recurrent states advance in the caches."""
    decoder = SegmentedDecoder(model)
    first, eager_cache = prefill(model, prompts)
    _, segmented_cache = prefill(model, prompts)
    token = mx.argmax(first, axis=-1)
    for _ in range(STEPS):
        eager = model(token[:, None], eager_cache)[:, -1, :]
        segmented = decoder(token, segmented_cache)
        assert float(mx.abs(eager - segmented).max()) <= 1e-5
        assert mx.argmax(segmented, axis=-1).tolist() == mx.argmax(eager, axis=-1).tolist()
        token = mx.argmax(eager, axis=-1)
    # the caches stand where the eager ones stand: one more eager step from each gives the same logits
    after_eager = model(token[:, None], eager_cache)[:, -1, :]
    after_segmented = model(token[:, None], segmented_cache)[:, -1, :]
    assert float(mx.abs(after_eager - after_segmented).max()) <= 1e-5


def count_calls(decoder, monkeypatch) -> list[int]:
    calls = [0]
    call = type(decoder).__call__

    def counted(self, tokens, cache):
        calls[0] += 1
        return call(self, tokens, cache)

    monkeypatch.setattr(SegmentedDecoder, "__call__", counted)
    return calls


def generate_direct(model, prompts: list[list[int]]) -> list[list[int]]:
    rows = [RowRequest(p, row_id=i) for i, p in enumerate(prompts)]
    state = DirectEngine(model, 512).generate(GenerationRequest(rows, Sampler("greedy"), max_tokens=TOKENS))
    return [r.token_ids for r in state.results]


def test_the_batch_engine_decodes_with_the_segmented_step(model, monkeypatch):
    eager = generate_direct(model, BATCH)
    monkeypatch.setenv("MLXCEL_DECODE_STEP", "segmented")
    engine = DirectEngine(model, 512).engine
    assert isinstance(engine.decoder, SegmentedDecoder)
    calls = count_calls(engine.decoder, monkeypatch)
    assert generate_direct(model, BATCH) == eager
    assert calls[0] >= TOKENS - 1


def schedule(model, max_rows: int) -> list[list[int]]:
    scheduler = BatchScheduler(model, 512, max_rows, chunk_size=16)
    rows = [RowRequest(p, row_id=i) for i, p in enumerate(ROWS)]
    state = scheduler.generate(GenerationRequest(rows, Sampler("greedy"), max_tokens=TOKENS))
    return [r.token_ids for r in state.results]


@pytest.mark.parametrize("max_rows", [4, 2], ids=["all-rows", "two-slots"])
def test_the_scheduler_decodes_with_the_segmented_step(model, monkeypatch, max_rows):
    """Rows of 80, 23, 9 and 31 tokens in pieces of 16: each row's tokens as the eager step draws
    them (two slots: rows join and leave the decode batch, the states gathered per row)."""
    eager = schedule(model, max_rows)
    monkeypatch.setenv("MLXCEL_DECODE_STEP", "segmented")
    calls = count_calls(get_decoder(model, "segmented"), monkeypatch)
    assert schedule(model, max_rows) == eager
    assert calls[0] >= TOKENS - 1
    assert eager == [generate_direct(model, [p])[0] for p in ROWS]
