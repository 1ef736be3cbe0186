"""A compiled decode step: one token per row over fixed-capacity KV buffers.

Eager decoding rebuilds and dispatches ~20 small ops per layer per token; on a GPU that dispatch,
not memory bandwidth, bounds a small model's decode. `mx.compile` fuses the elementwise chains
and replays one graph per step, but only while every input keeps its shape: so the step reads
and writes the cache's whole preallocated buffer (attention masks the unused slots) and takes
the position as an array. The graph is traced again only when the cache grows (every
`GROW_STEP` tokens).

Opt-in (decode.step=compiled; $MLXCEL_DECODE_STEP=compiled or the older MLXCEL_COMPILE=1): on the
H200 it gained at batch 8 but lost at batch 1 and 32 (docs/benchmarks.md). Why, from MLX's CUDA
source: the array mask this step needs disqualifies both fused attention kernels (sdpa_vector and cuDNN take
no array mask), so attention falls back to separate matmul/softmax/matmul ops over the whole
buffer. The segmented step (segmented.py, the GPU default) compiles everything but the attention
instead, and keeps the fused kernel.
"""

from __future__ import annotations

import mlx.core as mx

from mlxcel.models.cache import KVCache


class BufferView:
    """The KVCache interface over whole buffers, for use inside the compiled step."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, left_pad: mx.array):
        self.keys, self.values = keys, values
        self.offset_array = offset
        self.left_pad = left_pad
        self.offset = None  # unknown to the trace: masks are built by the step itself

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys = mx.slice_update(self.keys, keys, self.offset_array, axes=(2,))
        self.values = mx.slice_update(self.values, values, self.offset_array, axes=(2,))
        return self.keys, self.values

    def rope_offset(self) -> mx.array:
        return self.offset_array - self.left_pad


class CompiledDecoder:
    def __init__(self, model):
        self.model = model
        self._step = mx.compile(self._decode)

    def _decode(
        self, tokens: mx.array, offset: mx.array, left_pad: mx.array, keys: list[mx.array], values: list[mx.array]
    ):
        views = [BufferView(k, v, offset, left_pad) for k, v in zip(keys, values)]
        key_pos = mx.arange(keys[0].shape[2])
        visible = (key_pos <= offset) & (key_pos[None, :] >= left_pad[:, None])  # [B, capacity]
        logits = self.model(tokens[:, None], views, mask=visible[:, None, None, :])
        return logits[:, -1, :], [v.keys for v in views], [v.values for v in views]

    @staticmethod
    def can_drive(cache: list) -> bool:
        """It writes plain buffers in place: not quantized or rotating caches (eager for those), and
        it derives positions from the offset alone (no per-row position shift)."""
        return all(type(c) is KVCache and c.position_shift is None for c in cache)

    def __call__(self, tokens: mx.array, cache: list[KVCache]) -> mx.array:
        """Logits [B, V] for the next position; the caches advance by one."""
        first = cache[0]
        for layer_cache in cache:
            layer_cache.reserve(first.offset + 1)
        left_pad = first.left_pad if first.left_pad is not None else mx.zeros((tokens.shape[0],), mx.int32)
        offset = mx.array([first.offset], mx.int32)
        logits, keys, values = self._step(tokens, offset, left_pad, [c.keys for c in cache], [c.values for c in cache])
        for layer_cache, k, v in zip(cache, keys, values):
            layer_cache.keys, layer_cache.values = k, v
            layer_cache.offset += 1
        return logits
