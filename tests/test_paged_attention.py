"""The paged decode kernel (MLX's CUDA backend only) against the plain path it replaces: the rows'
positions gathered from the pool, padding masked, MLX's attention; and the scheduler with it
against the scheduler without it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.models import paged_attention
from mlxcel.models.paged_cache import BLOCK_SIZE, count_blocks, flat_positions

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not paged_attention.is_available(64), reason="MLX's CUDA backend only"),
]


def reference(q, keys, values, table, lengths, scale, window=0, sinks=None):
    """Gather + mask + MLX attention (its sinks where given), in float32."""
    span = int(lengths.max())
    positions = np.arange(span)[None, :]
    valid = positions < lengths[:, None]
    seen = valid & (positions >= lengths[:, None] - window) if window else valid
    gather = mx.array(flat_positions(table, np.where(valid, positions, 0)))
    k = keys.astype(mx.float32)[gather].transpose(0, 2, 1, 3)
    v = values.astype(mx.float32)[gather].transpose(0, 2, 1, 3)
    mask = mx.array(seen)[:, None, None, :]
    return mx.fast.scaled_dot_product_attention(q.astype(mx.float32), k, v, scale=scale, mask=mask, sinks=sinks)


def filled_pool(keys: mx.array, values: mx.array) -> paged_attention.PoolLayer:
    """A pool holding `keys` and `values` [positions, KVH, D], written by write_and_gather."""
    positions, kv_heads, head_dim = keys.shape
    pool = paged_attention.PoolLayer(positions, kv_heads, head_dim, keys.dtype, values.shape[2])
    k_out, v_out = paged_attention.write_and_gather(
        pool,
        keys.transpose(1, 0, 2)[None],
        values.transpose(1, 0, 2)[None],
        mx.arange(positions, dtype=mx.int32),
        mx.zeros((1, positions), mx.int32),
        mx.array([0], mx.int32),
        mx.array([0], mx.int32),
    )
    assert mx.array_equal(k_out[0], keys.transpose(1, 0, 2)) and mx.array_equal(v_out[0], values.transpose(1, 0, 2))
    return pool


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "head_dim", "longest", "window", "sinks"),
    [
        (1, 32, 8, 64, 3000, 0, False),
        (3, 14, 2, 64, 700, 0, False),
        (64, 8, 8, 128, 300, 0, False),
        (256, 32, 8, 64, 90, 0, False),
        (5, 8, 2, 256, 900, 200, False),
        (1, 32, 8, 64, 3000, 1000, False),
        (4, 16, 2, 64, 2500, 128, True),  # gpt-oss: sinks, a 128-position window
        (6, 16, 2, 64, 1500, 0, True),
        (3, 8, 1, 512, 1300, 0, False),  # Gemma 4's global layers: 512-wide heads
        (2, 8, 2, 384, 600, 0, False),
    ],
)
@pytest.mark.parametrize("one_split", [False, True], ids=["splits", "one-split"])
def test_kernel_equals_the_plain_path(dtype, rows, heads, kv_heads, head_dim, longest, window, sinks, one_split):
    rng = np.random.default_rng(rows)
    lengths = rng.integers(1, longest + 1, size=rows).astype(np.int32)
    lengths[0] = longest
    width = -(-longest // BLOCK_SIZE)
    blocks = rng.permutation(rows * width).reshape(rows, width).astype(np.int32)  # scattered blocks
    positions = rows * width * BLOCK_SIZE

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    keys, values = normal(positions, kv_heads, head_dim), normal(positions, kv_heads, head_dim)
    pool = filled_pool(keys, values)
    new_keys, new_values = normal(rows, kv_heads, 1, head_dim), normal(rows, kv_heads, 1, head_dim)
    q = normal(rows, heads, 1, head_dim)
    sinks = mx.array(rng.standard_normal(heads).astype(np.float32) * 3) if sinks else None
    scale = head_dim**-0.5
    attended = min(longest, window) if window else longest
    got = paged_attention.paged_decode_attention(
        q,
        new_keys,
        new_values,
        pool,
        mx.array(blocks),
        mx.array(lengths),
        attended,
        scale,
        BLOCK_SIZE,
        window,
        one_split,
        sinks,
    )
    # the reference: each row's new key and value at its last position, then gather + mask
    last = mx.array(flat_positions(blocks, (lengths - 1)[:, None])[:, 0])
    keys[last], values[last] = new_keys[:, :, 0], new_values[:, :, 0]
    want = reference(q, keys, values, blocks, lengths, scale, window, sinks)
    tolerance = 1e-4 if dtype == mx.float32 else 2e-2
    assert got.shape == q.shape and got.dtype == dtype
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want), atol=tolerance, rtol=tolerance)
    mx.eval(pool.done)  # the kernel stored the new positions in the pool, in place
    assert mx.array_equal(pool.keys, keys) and mx.array_equal(pool.values, values)


def test_one_split_gives_each_row_the_bits_it_has_alone():
    """Batch-invariant mode: with every row's positions in one split, a row's output does not
    depend on how many rows share the call (the split a batch of one would take differs)."""
    rng = np.random.default_rng(7)
    rows, heads, kv_heads, head_dim = 64, 32, 8, 64
    lengths = rng.integers(1, 3000, size=rows).astype(np.int32)
    width = -(-int(lengths.max()) // BLOCK_SIZE)
    blocks = rng.permutation(rows * width).reshape(rows, width).astype(np.int32)

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)

    keys = normal(rows * width * BLOCK_SIZE, kv_heads, head_dim)
    pool = filled_pool(keys, keys * 0.5)
    q, new_keys, new_values = (normal(rows, n, 1, head_dim) for n in (heads, kv_heads, kv_heads))

    def attend(picked):
        index = mx.array(picked.astype(np.int32))
        return paged_attention.paged_decode_attention(
            q[index],
            new_keys[index],
            new_values[index],
            pool,
            mx.array(blocks[picked]),
            mx.array(lengths[picked]),
            int(lengths[picked].max()),
            head_dim**-0.5,
            BLOCK_SIZE,
            0,
            True,
        )

    together = attend(np.arange(rows))
    for row in (0, 17, 63):
        assert mx.array_equal(attend(np.array([row]))[0], together[row]), row


@pytest.mark.parametrize("value_dim", [64, 16], ids=["kv", "mla"])  # MLA: a 512-wide latent, a 64-wide RoPE key
@pytest.mark.parametrize("leads", [(0, 0, 0), (2, 0, 4)])
def test_write_and_gather_equals_numpy(leads, value_dim):
    rng = np.random.default_rng(7)
    kv_heads, head_dim, rows, new = 2, 64, 3, 5  # new: the tokens each row sends, its lead's padding first
    leads = np.array(leads, dtype=np.int32)
    starts = np.array([0, 40, 3], dtype=np.int32)
    ends = starts + new - leads
    width = int(count_blocks(ends.max()))
    blocks = rng.permutation(rows * width).reshape(rows, width).astype(np.int32)
    positions = rows * width * BLOCK_SIZE
    keys = rng.standard_normal((positions, kv_heads, head_dim)).astype(np.float32)
    values = rng.standard_normal((positions, kv_heads, value_dim)).astype(np.float32)
    pool = filled_pool(mx.array(keys), mx.array(values))
    new_keys = rng.standard_normal((rows, kv_heads, new, head_dim)).astype(np.float32)
    new_values = rng.standard_normal((rows, kv_heads, new, value_dim)).astype(np.float32)
    span = int(ends.max()) + 3
    key_pos = np.arange(span)[None, :]
    gather = flat_positions(blocks, np.where(key_pos < ends[:, None], key_pos, 0))
    write = flat_positions(blocks, np.maximum(starts[:, None] - leads[:, None] + np.arange(new)[None, :], 0))
    k_out, v_out = paged_attention.write_and_gather(
        pool,
        mx.array(new_keys),
        mx.array(new_values),
        mx.array(write.reshape(-1)),
        mx.array(gather),
        mx.array(starts),
        mx.array(leads),
    )
    own = np.arange(new)[None, :] >= leads[:, None]  # [B, new]: the rows' own tokens, stored; leads are not
    keys[write[own]] = new_keys.transpose(0, 2, 1, 3)[own]
    values[write[own]] = new_values.transpose(0, 2, 1, 3)[own]
    want_k = np.where((key_pos < ends[:, None])[:, None, :, None], keys[gather].transpose(0, 2, 1, 3), 0)
    want_v = np.where((key_pos < ends[:, None])[:, None, :, None], values[gather].transpose(0, 2, 1, 3), 0)
    np.testing.assert_array_equal(np.array(k_out), want_k)
    np.testing.assert_array_equal(np.array(v_out), want_v)
    np.testing.assert_array_equal(np.array(pool.keys), keys)
    np.testing.assert_array_equal(np.array(pool.values), values)


@pytest.fixture(scope="module", params=["llama", "gpt_oss", "gemma4"])
def kernel_family(request, tmp_path_factory):
    """A tiny checkpoint of each family the decode kernel serves in its own way: llama; gpt-oss
    (sinks, sliding layers); Gemma 4 (shared-KV layers attend over their source layer's pool)."""
    if request.param == "llama":
        return request.getfixturevalue("tiny_llama")
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "gpt_oss":
        from tests.test_families_gpt_oss import make_checkpoint

        return make_checkpoint(folder)
    from tests.test_families_gemma4 import make_checkpoint

    return make_checkpoint(folder, "ple")


def test_scheduler_with_the_kernel_equals_it_without(kernel_family, monkeypatch):
    from mlxcel.checkpoints.loader import load_model
    from mlxcel.engine import GenerationRequest, RowRequest
    from mlxcel.engine.scheduler import BatchScheduler, uses_kernels
    from mlxcel.sampling import Sampler

    model = load_model(str(kernel_family), dtype="float32").model
    assert uses_kernels(model) == (True, True)
    rng = np.random.default_rng(0)
    rows = [
        RowRequest(rng.integers(3, 300, size=int(n)).tolist(), row_id=i, max_tokens=24)
        for i, n in enumerate(rng.integers(1, 200, size=8))
    ]

    def run():
        return [
            r.token_ids
            for r in BatchScheduler(model, 512, 4)
            .generate(GenerationRequest(rows, Sampler("greedy"), max_tokens=24))
            .results
        ]

    with_kernel = run()
    monkeypatch.setenv("MLXCEL_PAGED_KERNEL", "0")
    assert run() == with_kernel


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_pool_reads_and_writes_of_the_prompt_cache_round_trip(dtype):
    """write_positions then read_positions gives back what was written, at any flat positions,
    ordered after the kernel writes before them (a prompt cache entry adopted, then snapshotted)."""
    rng = np.random.default_rng(3)
    pool = paged_attention.PoolLayer(256, 2, 64, dtype)
    flat = rng.permutation(256)[:70].astype(np.int32)
    keys = mx.array(rng.standard_normal((70, 2, 64)).astype(np.float32)).astype(dtype)
    values = keys * 2
    paged_attention.write_positions(pool, keys, values, mx.array(flat))
    read_keys, read_values = paged_attention.read_positions(pool, mx.array(flat[::-1].copy()))
    np.testing.assert_array_equal(np.array(read_keys.astype(mx.float32)), np.array(keys[::-1].astype(mx.float32)))
    np.testing.assert_array_equal(np.array(read_values.astype(mx.float32)), np.array(values[::-1].astype(mx.float32)))


def test_the_prompt_cache_keeps_tokens_with_the_kernels(tiny_llama):
    """Rows adopting a shared prefix through the in-place kernels (fp32): the same tokens as with
    the cache off."""
    from mlxcel.checkpoints.loader import load_model
    from mlxcel.engine import GenerationRequest, RowRequest
    from mlxcel.engine.prompt_cache import PromptCache
    from mlxcel.engine.scheduler import BatchScheduler
    from mlxcel.sampling import Sampler

    model = load_model(str(tiny_llama), dtype="float32").model
    rng = np.random.default_rng(1)
    shared = rng.integers(3, 300, size=150).tolist()
    rows = [
        RowRequest(shared + rng.integers(3, 300, size=int(n)).tolist(), row_id=i, max_tokens=16)
        for i, n in enumerate(rng.integers(3, 30, size=8))
    ]

    def run(cache):
        state = BatchScheduler(model, 512, 4, prompt_cache=cache).generate(
            GenerationRequest(rows, Sampler("greedy"), max_tokens=16)
        )
        return [r.token_ids for r in state.results], [r.cached_tokens for r in state.results]

    off, _ = run(None)
    on, adopted = run(PromptCache(1 << 30))
    assert min(adopted[1:]) >= 150
    agree = sum(a == b for a, b in zip(on, off))
    assert agree >= 7, (agree, on, off)  # fp32; a kernel's reduction order may still flip a near-tie


def test_mla_pools_are_written_in_place(tmp_path, monkeypatch):
    """DeepSeek's latent and RoPE key (512 and 64 wide in the real models) go through the
    write-and-gather kernel (no decode kernel: its absorbed attention reads the gathered rows), the
    prompt cache's reads and writes too: the tokens the plain path gives."""
    from mlxcel.checkpoints.loader import load_model
    from mlxcel.engine import GenerationRequest, RowRequest
    from mlxcel.engine.prompt_cache import PromptCache
    from mlxcel.engine.scheduler import BatchScheduler, uses_kernels
    from mlxcel.sampling import Sampler
    from tests.test_families_deepseek import make_checkpoint

    monkeypatch.setenv("MLXCEL_MLA_IN_PLACE", "1")
    model = load_model(str(make_checkpoint(tmp_path, "deepseek_v3")), dtype="float32").model
    assert uses_kernels(model) == (True, False)
    rng = np.random.default_rng(2)
    shared = rng.integers(3, 300, size=40).tolist()
    rows = [
        RowRequest(shared + rng.integers(3, 300, size=int(n)).tolist(), row_id=i, max_tokens=20)
        for i, n in enumerate(rng.integers(1, 120, size=6))
    ]

    def run():
        cache = PromptCache(1 << 28)
        scheduler = BatchScheduler(model, 512, 3, prompt_cache=cache)
        first = scheduler.generate(GenerationRequest(rows, Sampler("greedy"), max_tokens=20))
        again = scheduler.generate(GenerationRequest(rows[:2], Sampler("greedy"), max_tokens=20))
        results = first.results + again.results
        return [r.token_ids for r in results], [r.cached_tokens for r in results]

    in_place, adopted = run()
    assert min(adopted[1:]) >= 40  # (the shared prefix read back from the pool: 40 on the CPU's plain path)
    monkeypatch.setenv("MLXCEL_PAGED_KERNEL", "0")
    assert uses_kernels(model) == (False, False)
    plain, _ = run()
    agree = sum(a == b for a, b in zip(in_place, plain))
    assert agree >= len(plain) - 1, (agree, in_place, plain)  # fp32; masked spans of other lengths may flip a near-tie
