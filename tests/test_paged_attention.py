"""The paged decode kernel (MLX's CUDA backend only) against the plain path it replaces: the rows'
positions gathered from the pool, padding masked, MLX's attention; and the scheduler with it
against the scheduler without it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.models import paged_attention
from mlxcel.models.paged_cache import BLOCK_SIZE, flat_positions

pytestmark = pytest.mark.skipif(not paged_attention.is_available(64), reason="MLX's CUDA backend only")


def reference(q, keys, values, table, lengths, scale):
    """Gather + mask + MLX attention, in float32."""
    span = int(lengths.max())
    positions = np.arange(span)[None, :]
    valid = positions < lengths[:, None]
    gather = mx.array(flat_positions(table, np.where(valid, positions, 0)))
    k = keys.astype(mx.float32)[gather].transpose(0, 2, 1, 3)
    v = values.astype(mx.float32)[gather].transpose(0, 2, 1, 3)
    mask = mx.array(valid)[:, None, None, :]
    return mx.fast.scaled_dot_product_attention(q.astype(mx.float32), k, v, scale=scale, mask=mask)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(("rows", "heads", "kv_heads", "head_dim", "longest"), [(1, 32, 8, 64, 3000), (3, 14, 2, 64, 700), (64, 8, 8, 128, 300), (256, 32, 8, 64, 90)])
def test_kernel_equals_the_plain_path(dtype, rows, heads, kv_heads, head_dim, longest):
    rng = np.random.default_rng(rows)
    lengths = rng.integers(1, longest + 1, size=rows).astype(np.int32)
    lengths[0] = longest
    width = -(-longest // BLOCK_SIZE)
    blocks = rng.permutation(rows * width).reshape(rows, width).astype(np.int32)  # scattered blocks
    pool = rows * width * BLOCK_SIZE
    keys = mx.array(rng.standard_normal((pool, kv_heads, head_dim)).astype(np.float32)).astype(dtype)
    values = mx.array(rng.standard_normal((pool, kv_heads, head_dim)).astype(np.float32)).astype(dtype)
    q = mx.array(rng.standard_normal((rows, heads, 1, head_dim)).astype(np.float32)).astype(dtype)
    scale = head_dim**-0.5
    got = paged_attention.paged_decode_attention(q, keys, values, mx.array(blocks), mx.array(lengths), longest, scale, BLOCK_SIZE)
    want = reference(q, keys, values, blocks, lengths, scale)
    tolerance = 1e-4 if dtype == mx.float32 else 2e-2
    assert got.shape == q.shape and got.dtype == dtype
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want), atol=tolerance, rtol=tolerance)


def test_scheduler_with_the_kernel_equals_it_without(tiny_llama, monkeypatch):
    from mlxcel.engine import GenerationRequest, RowRequest
    from mlxcel.engine.scheduler import BatchScheduler
    from mlxcel.models.loader import load_model
    from mlxcel.sampling import Sampler

    model = load_model(str(tiny_llama), dtype="float32").model
    rng = np.random.default_rng(0)
    rows = [RowRequest(rng.integers(3, 300, size=int(n)).tolist(), row_id=i, max_tokens=24) for i, n in enumerate(rng.integers(1, 200, size=8))]

    def run():
        return [r.token_ids for r in BatchScheduler(model, 512, 4).generate(GenerationRequest(rows, Sampler("greedy"), max_tokens=24)).results]

    with_kernel = run()
    monkeypatch.setenv("MLXCEL_PAGED_KERNEL", "0")
    assert run() == with_kernel
