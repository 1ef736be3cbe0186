"""Sliding-window layers through the scheduler (fp32, CPU): every row's tokens equal that row run
alone through the batch engine, whose RotatingKVCache keeps only the window, for families with
a window on every layer (Mistral), on some layers (Gemma 3) and with logit soft-capping (Gemma 2).
Prompts and outputs run well past the 16-position window, in pieces smaller and larger than it."""

from __future__ import annotations

import random

import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import GenerationRequest, RowRequest
from mlxcel.engine.scheduler import BatchScheduler, layer_windows, supports_scheduling
from mlxcel.sampling import Sampler
from tests.family_fixtures import make_family_checkpoint
from tests.helpers import run_alone

GREEDY = Sampler("greedy")
CATEGORICAL = Sampler("categorical", temperature=1.0, seed=99)

pytestmark = pytest.mark.usefixtures("on_the_cpu")  # (conftest)


@pytest.fixture(scope="module", params=["mistral", "gemma3_text", "gemma2"])
def model(request, tmp_path_factory, on_the_cpu):
    folder = make_family_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return load_model(str(folder), dtype="float32").model


def test_windowed_families_run_through_the_scheduler(model):
    windows = layer_windows(model)
    assert 16 in windows
    assert supports_scheduling(model, GenerationRequest([RowRequest([5, 6]), RowRequest([7])], GREEDY))


@pytest.mark.parametrize("ragged", [False, True], ids=["equal-pieces", "ragged-pieces"])
@pytest.mark.parametrize("sampler", [GREEDY, CATEGORICAL], ids=["greedy", "categorical"])
def test_rows_equal_each_row_alone_under_random_schedules(model, sampler, ragged):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(1, 60))] for _ in range(7)]
    lengths = [rng.randint(1, 30) for _ in range(7)]
    expected = [run_alone(model, sampler, p, i, n).token_ids for i, (p, n) in enumerate(zip(prompts, lengths))]
    for seed in range(3):
        pick = random.Random(seed)
        order = pick.sample(range(7), 7)
        max_rows, chunk = pick.choice([1, 3, 7]), pick.choice([None, 5, 16, 40])
        rows = [RowRequest(prompts[i], row_id=i, max_tokens=lengths[i]) for i in order]
        scheduler = BatchScheduler(model, 512, max_rows, chunk_size=chunk)
        scheduler.ragged_prefill = ragged  # rows' pieces of any lengths in one padded call (the GPU default)
        state = scheduler.generate(GenerationRequest(rows, sampler, max_tokens=64))
        got = {order[k]: r.token_ids for k, r in enumerate(state.results)}
        assert got == dict(enumerate(expected)), (seed, max_rows, chunk)
