"""Sliding layers keep only their window per row in the scheduler (models/paged_window.py): a row
far longer than the window holds `window` positions in those layers, its tokens stay the ones it
draws alone (tests/test_scheduler_windows.py runs every schedule with rings on the CPU), the prompt
cache adopts a prefix's ring, and the rings stay off where they cannot serve."""

from __future__ import annotations

import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import GenerationRequest, RowRequest
from mlxcel.engine.prompt_cache import PromptCache
from mlxcel.engine.scheduler import BatchScheduler, kv_bytes_per_position, ring_bytes_per_row
from mlxcel.models.paged_cache import PagedKVCache
from mlxcel.models.paged_window import PagedWindowCache
from mlxcel.sampling import Sampler
from tests.family_fixtures import PROMPT, make_family_checkpoint
from tests.helpers import run_alone

GREEDY = Sampler("greedy")
LONG = PROMPT * 6  # 240 positions against a 16-position window

pytestmark = pytest.mark.usefixtures("on_the_cpu")  # (conftest)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory, on_the_cpu):
    """Gemma 2's tiny checkpoint: sliding (16) and full layers alternate."""
    folder = make_family_checkpoint(tmp_path_factory.mktemp("gemma2"), "gemma2")
    return load_model(str(folder), dtype="float32").model


def run(model, prompts, max_tokens=8, **options):
    """(each row's tokens, the run's state, its caches) through the scheduler."""
    scheduler = BatchScheduler(model, 512, options.pop("max_rows", 4), **options)
    caches = []
    original = scheduler.run_rows

    def record(state, waiting, table, layer_caches, *rest):
        caches.extend(layer_caches)
        return original(state, waiting, table, layer_caches, *rest)

    scheduler.run_rows = record
    rows = [RowRequest(p, row_id=i) for i, p in enumerate(prompts)]
    state = scheduler.generate(GenerationRequest(rows, GREEDY, max_tokens=max_tokens))
    return [r.token_ids for r in state.results], state, caches


def test_a_long_row_holds_its_window_in_sliding_layers(gemma2):
    got, state, caches = run(gemma2, [LONG, PROMPT[:9]], max_rows=2, chunk_size=32)
    assert got == [run_alone(gemma2, GREEDY, p, i, 8).token_ids for i, p in enumerate([LONG, PROMPT[:9]])]
    rings = [c for c in caches if isinstance(c, PagedWindowCache)]
    pools = [c for c in caches if type(c) is PagedKVCache]
    assert len(rings) == len(pools) == 2
    assert all(c.keys.shape[0] == 2 * 16 for c in rings)  # two slots of 16 positions, whatever the row's length
    assert all(c.keys.shape[0] >= len(LONG) for c in pools)  # the full layers hold every position
    # the budget counts the full layers per position and the rings per row
    full, sliding = kv_bytes_per_position(gemma2), kv_bytes_per_position(gemma2, rings=True)
    assert sliding == full // 2 and ring_bytes_per_row(gemma2) == 16 * full // 2
    assert state.state_bytes == 2 * ring_bytes_per_row(gemma2)


def test_rows_sharing_a_prefix_adopt_its_rings(gemma2):
    shared = PROMPT * 2
    prompts = [shared + PROMPT[3:20], shared + PROMPT[11:19], shared + PROMPT[:30]]
    alone = [run_alone(gemma2, GREEDY, p, i, 8).token_ids for i, p in enumerate(prompts)]
    got, state, _ = run(gemma2, prompts, prompt_cache=PromptCache(10**8), chunk_size=32)
    assert got == alone
    assert [r.cached_tokens for r in state.results] == [0, len(shared), len(shared)]


@pytest.mark.parametrize(
    "options", [{"batch_invariant": True}, {"window_rings": False}], ids=["batch-invariant", "cache-folder"]
)
def test_rings_stay_off_where_they_cannot_serve(gemma2, options):
    got, state, caches = run(gemma2, [LONG], **options)
    assert not any(isinstance(c, PagedWindowCache) for c in caches)
    assert got == [run_alone(gemma2, GREEDY, LONG, 0, 8).token_ids] and state.state_bytes == 0
