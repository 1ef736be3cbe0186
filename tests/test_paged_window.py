"""Sliding layers keep only their window per row in the scheduler (models/paged_window.py): a row
far longer than the window holds `window` positions in those layers, its tokens stay the ones it
draws alone (tests/test_scheduler_windows.py runs every schedule with rings on the CPU), the prompt
cache adopts a prefix's ring, and the rings stay off where they cannot serve. Chunked layers
(Llama 4) keep a ring of one chunk a row, on every path."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
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
    assert all(c.keys.shape[1] >= len(LONG) for c in pools)  # the full layers hold every position (heads first)
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


# ---- chunk mode (Llama 4's chunked attention): a ring of one chunk a row, on every path ----


@pytest.fixture(scope="module")
def llama4(tmp_path_factory, on_the_cpu):
    """A tiny Llama 4: layers 0-2 chunked (16 positions), layer 3 a NoPE full-attention layer."""
    from tests.test_families_llama4 import write_llama4

    folder = write_llama4(tmp_path_factory.mktemp("llama4"))
    return folder, load_model(str(folder), dtype="float32").model


@pytest.mark.parametrize(
    "options",
    [{"chunk_size": 32}, {"chunk_size": 7, "max_rows": 2}, {"chunk_size": 13, "window_rings": False}],
    ids=["pieces32", "two-slots-pieces7", "rings-off"],
)
def test_chunked_layers_hold_one_chunk_a_row(llama4, options):
    """Rows of 240, 9 and 37 positions, in pieces that straddle chunk boundaries (7, 13, 32
    against 16): each row draws transformers' tokens and its own alone; the chunked layers keep
    one chunk a row slot (also where sliding rings are off: the kernels' path, a cache folder),
    counted per row in the budget, the full layer per position."""
    from tests.family_fixtures import reference_greedy
    from tests.helpers import load_reference

    folder, model = llama4
    prompts = [LONG, PROMPT[:9], PROMPT[3:40]]
    got, state, caches = run(model, prompts, **options)
    reference = load_reference(folder)
    assert got == [reference_greedy(reference, p, 8) for p in prompts]
    assert got == [run_alone(model, GREEDY, p, i, 8).token_ids for i, p in enumerate(prompts)]
    slots = options.get("max_rows", 4)
    rings = [c for c in caches if isinstance(c, PagedWindowCache)]
    pools = [c for c in caches if type(c) is PagedKVCache]
    assert len(rings) == 3 and len(pools) == 1
    assert all(c.chunk == 16 and c.keys.shape[0] == slots * 16 for c in rings)
    assert pools[0].keys.shape[1] >= len(LONG)  # (heads first)
    per_position = kv_bytes_per_position(model)  # the NoPE layer's keys and values only
    assert per_position == kv_bytes_per_position(model, rings=True)
    assert ring_bytes_per_row(model) == 3 * 16 * per_position
    assert ring_bytes_per_row(model, rings=False) == ring_bytes_per_row(model)
    assert state.state_bytes == slots * ring_bytes_per_row(model)


def test_chunked_rows_sharing_a_prefix_adopt_their_rings(llama4):
    _, model = llama4
    shared = PROMPT * 2  # 80 positions: the prefix ends mid-chunk
    prompts = [shared + PROMPT[3:20], shared + PROMPT[11:19], shared + PROMPT[:30]]
    alone = [run_alone(model, GREEDY, p, i, 8).token_ids for i, p in enumerate(prompts)]
    got, state, _ = run(model, prompts, prompt_cache=PromptCache(10**8), chunk_size=32)
    assert got == alone
    assert [r.cached_tokens for r in state.results] == [0, len(shared), len(shared)]


def test_ring_rows_attend_each_row_alone_as_the_batch_does():
    """Batch-invariant decode on a GPU (RingRows): each row's query over its ring in a call of its
    own gives what the batched call gives."""
    from mlxcel.models.paged_window import RingRows

    q, k, v = (mx.random.normal((3, 4, n, 8), key=mx.random.key(i)) for i, n in enumerate((1, 16, 16)))
    mask = mx.array(np.arange(16)[None, None, None, :] < np.array([3, 16, 9])[:, None, None, None])
    batched = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
    assert mx.allclose(RingRows(mask).attend(q, k, v, 0.3), batched, atol=1e-6)


def test_tile_padding_never_reaches_a_ring(gemma2):
    """prefill.tile_size pads a row's last piece: written to a ring, the padding would overwrite
    positions the row's next queries still see (a 37-token row's piece 16..37 padded to 48 took
    positions 22..31's slots: its second token's logprob moved by 0.02). Rings' pieces are not
    padded, so each token's logprob is the unpadded run's."""

    def logprobs(tile):
        rows = [RowRequest(PROMPT[3:40], row_id=0)]
        request = GenerationRequest(rows, GREEDY, max_tokens=4, tile_size=tile, logprobs=1)
        result = BatchScheduler(gemma2, 512, 4, chunk_size=24).generate(request).results[0]
        return [token["logprob"] for token in result.logprobs]

    assert logprobs(16) == pytest.approx(logprobs(None), abs=1e-5)
