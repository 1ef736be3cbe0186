"""The prompt cache under the scheduler (fp32, CPU, a tiny random Llama): rows that share a
prefix adopt it and prefill only the rest, and every row's tokens equal the cache-off run's
(greedy and seeded), including rows that adopt mid-batch, rows whose prefix was evicted, and
chat-like follow-ups that start with an earlier row's answer. The radix tree is checked on its
own: longest match, splits, LRU eviction, pins."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import GenerationRequest, RowRequest
from mlxcel.engine.prompt_cache import PromptCache
from mlxcel.engine.prompt_cache_files import describe_layout, load_entries, save_entries
from mlxcel.engine.scheduler import BatchScheduler, kv_bytes_per_position
from mlxcel.sampling import Sampler
from tests.helpers import make_tiny_checkpoint

GREEDY = Sampler("greedy")
CATEGORICAL = Sampler("categorical", temperature=1.0, seed=99)


pytestmark = pytest.mark.usefixtures("on_the_cpu")  # (conftest)


@pytest.fixture(scope="module")
def model(tiny_llama, on_the_cpu):
    return load_model(str(tiny_llama), dtype="float32").model


def run(
    model,
    prompts,
    sampler=GREEDY,
    cache=None,
    max_rows=4,
    chunk_size=None,
    keep_answers=False,
    snapshot_all=False,
    **kwargs,
):
    rows = [RowRequest(p, row_id=i, max_tokens=12) for i, p in enumerate(prompts)]
    request = GenerationRequest(rows, sampler, max_tokens=12, **kwargs)
    scheduler = BatchScheduler(
        model,
        512,
        max_rows,
        chunk_size=chunk_size,
        prompt_cache=cache,
        keep_answers=keep_answers,
        snapshot_all=snapshot_all,
    )
    return scheduler.generate(request)


def shared_prefix_prompts(seed: int, count: int, prefix: int = 150) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 300) for _ in range(prefix)]
    return [system + [rng.randrange(3, 300) for _ in range(rng.randint(3, 25))] for _ in range(count)]


def token_ids(state) -> list[list[int]]:
    return [r.token_ids for r in state.results]


def big_cache() -> PromptCache:
    return PromptCache(1 << 30)


@pytest.mark.parametrize("sampler", [GREEDY, CATEGORICAL], ids=["greedy", "seeded"])
@pytest.mark.parametrize("chunk_size", [None, 64], ids=["default-pieces", "pieces-of-64"])
def test_rows_sharing_a_prefix_adopt_it_and_keep_their_tokens(model, sampler, chunk_size):
    prompts = shared_prefix_prompts(0, 10)
    off = run(model, prompts, sampler, chunk_size=chunk_size)
    cache = big_cache()
    on = run(model, prompts, sampler, cache=cache, chunk_size=chunk_size)
    assert token_ids(on) == token_ids(off)
    adopted = [r.cached_tokens for r in on.results]
    # the first row prefills the system prompt; every other row waits for it, then adopts it
    assert adopted[0] == 0 and all(n >= 150 for n in adopted[1:]), adopted
    computed = sum(p["end"] - p["start"] for p in on.timings.prefill_pieces)
    assert computed == sum(len(p) for p in prompts) - sum(adopted)


def test_a_second_job_adopts_what_the_first_left(model):
    prompts = shared_prefix_prompts(1, 6)
    off = run(model, prompts)
    cache = big_cache()
    run(model, prompts[:2], cache=cache, snapshot_all=True)  # every prompt kept, as with a cache folder
    again = run(model, prompts, cache=cache)
    assert token_ids(again) == token_ids(off)
    # the first two rows adopt all but their last token; the rest the shared prefix at least
    assert [r.cached_tokens for r in again.results][:2] == [len(p) - 1 for p in prompts[:2]]
    assert all(r.cached_tokens >= 150 for r in again.results)


def test_a_job_whose_rows_share_nothing_stores_nothing(model):
    """Only what this job's rows share is snapshotted (unless every prompt is wanted later):
    a ragged job of unrelated rows pays no copies."""
    rng = random.Random(12)
    unrelated = [[rng.randrange(3, 300) for _ in range(rng.randint(40, 90))] for _ in range(6)]
    cache = big_cache()
    run(model, unrelated, cache=cache)
    assert cache.entries == 0
    shared = shared_prefix_prompts(13, 4, 100)
    run(model, shared, cache=cache)
    assert 100 <= cache.cached_tokens < sum(map(len, shared))  # the shared part, not the rows' own ends
    run(model, unrelated, cache=cache, snapshot_all=True)
    assert cache.cached_tokens >= 100 + sum(map(len, unrelated))


def test_rows_adopt_mid_batch_with_random_arrival_and_max_rows(model):
    """Rows of two families of prefixes interleaved with unrelated rows, a few decoding at once:
    rows are admitted while others decode, and adopt what is cached by then."""
    rng = random.Random(5)
    groups = [shared_prefix_prompts(10, 6, 90), shared_prefix_prompts(11, 6, 70)]
    unrelated = [[rng.randrange(3, 300) for _ in range(rng.randint(5, 80))] for _ in range(6)]
    prompts = groups[0] + groups[1] + unrelated
    rng.shuffle(prompts)
    for sampler in (GREEDY, CATEGORICAL):
        off = run(model, prompts, sampler, max_rows=3, chunk_size=32)
        on = run(model, prompts, sampler, cache=big_cache(), max_rows=3, chunk_size=32)
        assert token_ids(on) == token_ids(off)
        assert sum(1 for r in on.results if r.cached_tokens) >= 10


def test_rows_whose_prefix_was_evicted_recompute_it(model):
    """A budget of about one prompt: entries are evicted as rows go, rows adopt what is left,
    and the tokens never change."""
    prompts = shared_prefix_prompts(2, 5, 100) + shared_prefix_prompts(3, 5, 100)
    random.Random(0).shuffle(prompts)
    per_position = kv_bytes_per_position(model)
    cache = PromptCache(130 * per_position)
    off = run(model, prompts, max_rows=2)
    on = run(model, prompts, cache=cache, max_rows=2)
    assert token_ids(on) == token_ids(off)
    assert cache.evicted_tokens > 0 and on.prompt_cache["evicted_tokens"] == cache.evicted_tokens
    assert cache.nbytes <= cache.budget_bytes
    assert any(r.cached_tokens for r in on.results)


def test_a_follow_up_turn_adopts_the_previous_answer(model):
    """keep_answers (the chat): the next turn starts with the previous prompt and its answer, and
    prefills only what follows."""
    cache = big_cache()
    first_prompt = shared_prefix_prompts(4, 1)[0]
    first = run(model, [first_prompt], cache=cache, keep_answers=True).results[0]
    follow_up = first_prompt + first.token_ids + [7, 8, 9, 10]
    off = run(model, [follow_up]).results[0]
    on = run(model, [follow_up], cache=cache, keep_answers=True).results[0]
    assert on.token_ids == off.token_ids
    # every fed position: the prompt and each answer token but the last
    assert on.cached_tokens == len(first_prompt) + len(first.token_ids) - 1


def test_kv_bits_rows_adopt_whole_pieces_only(tmp_path):
    """With kv_bits a later piece attends to the earlier ones' quantized keys, so a row adopts
    whole pieces of its own size only, and its tokens stay the cache-off run's."""
    model = load_model(str(make_tiny_checkpoint(tmp_path, "llama", seed=3, head_dim=32)), dtype="float32").model
    prompts = shared_prefix_prompts(6, 4, 100)
    off = run(model, prompts, kv_bits=8, kv_group_size=32, chunk_size=32)
    on = run(model, prompts, cache=big_cache(), kv_bits=8, kv_group_size=32, chunk_size=32)
    assert token_ids(on) == token_ids(off)
    adopted = [r.cached_tokens for r in on.results]
    assert all(n % 32 == 0 for n in adopted) and max(adopted) >= 96


# ---- the radix tree alone ----
def stored_for(tokens: list[int]) -> list[list[mx.array]]:
    """One layer whose 'keys' are the token ids themselves: what a node holds is checkable."""
    values = mx.array(np.array(tokens, dtype=np.float32)[:, None, None])
    return [[values, values * 2]]


def test_the_tree_matches_the_longest_prefix_and_splits_nodes():
    cache = big_cache()
    cache.insert([1, 2, 3, 4, 5], 0, stored_for([1, 2, 3, 4, 5]))
    cache.insert([1, 2, 3, 9], 0, stored_for([1, 2, 3, 9]))  # splits [1..5] after 3
    assert cache.match([1, 2, 3, 4, 7]).length == 4
    assert cache.match([1, 2, 3, 9, 9]).length == 4
    assert cache.match([2]).length == 0
    assert cache.entries == 3 and cache.cached_tokens == 6
    found = cache.match([1, 2, 3, 4, 5, 6])
    assert found.stored()[0][0].reshape(-1).tolist() == [1, 2, 3, 4, 5]
    assert found.stored()[0][1].reshape(-1).tolist() == [2, 4, 6, 8, 10]
    # a snapshot of [3, 6) given only where the tree holds [0, 3): only the new part is added
    cache.insert([1, 2, 3, 9, 8, 7], 3, stored_for([9, 8, 7]))
    assert cache.match([1, 2, 3, 9, 8, 7]).stored()[0][0].reshape(-1).tolist() == [1, 2, 3, 9, 8, 7]
    # a snapshot that starts past what the tree holds leaves a gap: nothing is added
    assert cache.insert([5, 6, 7, 8], 2, stored_for([7, 8])).length == 0
    assert cache.match([5, 6]).length == 0


def test_eviction_is_least_recently_used_and_spares_pinned_nodes():
    per_token = sum(a.nbytes for a in stored_for([1])[0])
    cache = PromptCache(10 * per_token)
    cache.insert([1, 1, 1, 1], 0, stored_for([1, 1, 1, 1]))
    cache.insert([2, 2, 2, 2], 0, stored_for([2, 2, 2, 2]))
    cache.touch(cache.match([1, 1, 1, 1]))  # [1...] is now the more recent
    cache.insert([3, 3, 3, 3], 0, stored_for([3, 3, 3, 3]))  # 12 > 10: the least recent goes
    assert cache.match([2, 2, 2, 2]).length == 0
    assert cache.match([1, 1, 1, 1]).length == 4 and cache.match([3, 3, 3, 3]).length == 4
    pinned = cache.match([1, 1, 1, 1])
    cache.pin(pinned)
    cache.touch(cache.match([3, 3, 3, 3]))
    cache.insert([4, 4, 4, 4], 0, stored_for([4, 4, 4, 4]))  # [1...] is older but pinned
    assert cache.match([1, 1, 1, 1]).length == 4 and cache.match([3, 3, 3, 3]).length == 0
    assert cache.nbytes <= cache.budget_bytes
    # an entry larger than the whole budget is not stored
    assert cache.insert(list(range(20)), 0, stored_for(list(range(20)))).length == 0
    assert cache.nbytes <= cache.budget_bytes


# ---- on disk ----
def test_entries_saved_by_one_job_are_adopted_by_the_next(model, tmp_path):
    prompts = shared_prefix_prompts(7, 4)
    off = run(model, prompts)
    first = big_cache()
    run(model, prompts[:1], cache=first, snapshot_all=True)
    assert save_entries(first, tmp_path, "key") == first.entries > 0
    assert save_entries(first, tmp_path, "key") == 0  # nothing new
    second = big_cache()
    layout = describe_layout(model, "float32", None, 64)
    assert load_entries(second, tmp_path, "key", layout) == first.entries
    again = run(model, prompts, cache=second)
    assert token_ids(again) == token_ids(off)
    assert again.results[0].cached_tokens == len(prompts[0]) - 1
    assert all(r.cached_tokens >= 150 for r in again.results)


def test_corrupt_foreign_and_old_files_are_ignored_with_a_warning(model, tmp_path):
    import io
    import json as jsonlib

    first = big_cache()
    run(model, [shared_prefix_prompts(8, 1)[0]], cache=first, snapshot_all=True)
    save_entries(first, tmp_path, "key")
    files = sorted((tmp_path / "key").glob("*.safetensors"))
    good, *rest = files
    # a truncated file
    bad = tmp_path / "key" / good.name.replace("-", "-9", 1)
    bad.write_bytes(good.read_bytes()[:100])
    # another model's file, copied into this model's folder
    arrays, metadata = mx.load(str(good), return_metadata=True)
    foreign = tmp_path / "key" / ("f" * 32 + "-0.safetensors")
    mx.save_safetensors(str(foreign), arrays, metadata={**metadata, "model_key": "other"})
    # an older format
    old = tmp_path / "key" / ("0" * 32 + "-0.safetensors")
    mx.save_safetensors(str(old), arrays, metadata={**metadata, "format": "0"})
    # token ids edited after writing (the name no longer matches them)
    edited = tmp_path / "key" / ("e" * 32 + "-0.safetensors")
    tokens = jsonlib.loads(metadata["token_ids"])
    mx.save_safetensors(str(edited), arrays, metadata={**metadata, "token_ids": jsonlib.dumps(tokens[::-1])})
    log = io.StringIO()
    second = big_cache()
    used = load_entries(second, tmp_path, "key", describe_layout(model, "float32", None, 64), log)
    lines = log.getvalue().splitlines()
    assert used == len(files)
    assert len(lines) == 4 and all(line.startswith("mlxcel: prompt cache: ignoring ") for line in lines), lines
    assert "not a readable safetensors file" in log.getvalue()
    assert "written for another model" in log.getvalue()
    assert "format version '0'" in log.getvalue()
    assert "do not match its name" in log.getvalue()


def test_a_file_with_the_wrong_layer_count_is_ignored(model, tmp_path):
    import io

    first = big_cache()
    run(model, [shared_prefix_prompts(9, 1)[0]], cache=first, snapshot_all=True)
    save_entries(first, tmp_path, "key")
    log = io.StringIO()
    layout = describe_layout(model, "float32", None, 64)
    assert load_entries(big_cache(), tmp_path, "key", [*layout, layout[0]], log) == 0
    assert "do not match its token ids or this model's layers" in log.getvalue()


def test_kv_bits_entries_match_the_layout_the_disk_expects(tmp_path):
    """describe_layout (what a file must hold) is what the quantized pool's snapshots are."""
    model = load_model(str(make_tiny_checkpoint(tmp_path, "llama", seed=3, head_dim=32)), dtype="float32").model
    first = big_cache()
    run(model, shared_prefix_prompts(14, 2, 64), cache=first, kv_bits=8, kv_group_size=32, chunk_size=32)
    assert save_entries(first, tmp_path / "cache", "key") == first.entries > 0
    layout = describe_layout(model, "float32", 8, 32)
    assert load_entries(big_cache(), tmp_path / "cache", "key", layout) == first.entries
    assert load_entries(big_cache(), tmp_path / "cache", "key", describe_layout(model, "float32", 4, 32)) == 0
