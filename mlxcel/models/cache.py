"""KV caches with a batch dimension.

Rows of a batch are left-padded to a common length, so one `offset` serves every row;
`left_pad[b]` says how many leading slots of row b are padding (masked out, and RoPE
positions shifted so each row sees the positions it would see alone).
Storage is sized for the request up front (`plan_capacity`: the prompt plus the tokens it may
generate, up to PLAN_LIMIT of them), so a decode step writes into spare capacity and never
copies. Past the plan it grows in steps of `GROW_STEP` slots: one copy per step, not per token.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

GROW_STEP = 256
PLAN_LIMIT = 4096  # generated tokens preallocated for; a longer generation grows past it


class KVCache:
    def __init__(self, batch_size: int = 1, left_pad: mx.array | None = None):
        self.batch_size = batch_size
        self.left_pad = left_pad  # int32 [B], shared by all layers of one batch; None = no padding
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0
        self.planned = 0  # positions the request may reach: the first allocation makes room for them
        # int32 [B] added to every row's RoPE position after a prefill whose positions were given
        # explicitly (Qwen2-VL's M-RoPE: an image takes fewer positions than tokens); None = 0.
        self.position_shift: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append [B, n_kv, L, D] keys/values; return everything cached so far."""
        prev, length = self.offset, keys.shape[2]
        if self.keys is None:
            B, n_kv, _, k_dim = keys.shape
            self.keys = mx.zeros((B, n_kv, 0, k_dim), keys.dtype)
            self.values = mx.zeros((B, n_kv, 0, values.shape[3]), values.dtype)
        self.reserve(prev + length)
        self.offset = prev + length
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        if prev == 0:
            # The first piece attends to exactly what it brought: hand attention those contiguous
            # arrays rather than a strided view of the larger buffer, which a kernel may copy.
            return keys, values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def reserve(self, needed: int) -> None:
        """Room for `needed` positions, grown in GROW_STEP slots (the compiled step writes in place)."""
        if self.keys is None or needed <= self.keys.shape[2]:
            return
        capacity = self.capacity_for(needed)
        self.keys = grow_storage(self.keys, self.offset, capacity)
        self.values = grow_storage(self.values, self.offset, capacity)

    def capacity_for(self, needed: int) -> int:
        """Slots to allocate for `needed` positions: the request's plan, in GROW_STEP units."""
        return ((max(needed, self.planned) + GROW_STEP - 1) // GROW_STEP) * GROW_STEP

    def trim(self, n: int) -> None:
        """Forget the last n positions (used after a tile-padded prefill piece)."""
        self.offset = max(0, self.offset - n)

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]

    def rope_offset(self) -> int | mx.array:
        """Position of the next token, per row when rows are left-padded or shifted."""
        position = self.offset if self.left_pad is None else self.offset - self.left_pad
        return position if self.position_shift is None else position + self.position_shift


def grow_storage(x: mx.array, used: int, capacity: int) -> mx.array:
    """[B, heads, slots, width] storage with `capacity` slots, the first `used` kept."""
    B, heads, _, width = x.shape
    return mx.concatenate([x[..., :used, :], mx.zeros((B, heads, capacity - used, width), x.dtype)], axis=2)


def plan_capacity(cache: list[KVCache], prompt_length: int, max_new_tokens: int, max_context: int) -> None:
    """Size every layer's storage for a request once, at its first write."""
    planned = min(prompt_length + min(max_new_tokens, PLAN_LIMIT), max_context)
    for layer_cache in cache:
        layer_cache.planned = planned


def make_kv_caches(num_layers: int, batch_size: int = 1, left_pad: list[int] | None = None) -> list[KVCache]:
    pad = None
    if left_pad is not None and any(left_pad):
        pad = mx.array(left_pad, dtype=mx.int32)
    return [KVCache(batch_size, pad) for _ in range(num_layers)]


def make_attention_mask(length: int, cache: KVCache | None) -> mx.array | str | None:
    """Mask for `length` new queries at the cache's offset: causal within the new tokens,
    and left-padding slots hidden. Returns None or "causal" when no explicit mask is needed."""
    if hasattr(cache, "attention_mask"):  # a paged cache knows its rows' lengths
        return cache.attention_mask(length)
    offset = 0 if cache is None else cache.offset
    left_pad = None if cache is None else cache.left_pad
    if left_pad is None:
        # "causal" is aligned to the last key when there are more keys than queries, so a
        # later prefill piece needs no array mask either; an array would send attention to the
        # unfused path (several times slower on the H200: docs/benchmarks.md).
        return None if length == 1 else "causal"
    total = offset + length
    key_pos = mx.arange(total)
    query_pos = mx.arange(offset, total)
    mask = key_pos[None, :] <= query_pos[:, None]  # [L, S]
    if left_pad is not None:
        # Padding slots are hidden from real queries; a padding query still sees itself so its
        # softmax row is not empty (an all-masked row gives NaN, which would leak through V).
        visible = (key_pos[None, :] >= left_pad[:, None])[:, None, None, :]  # [B, 1, 1, S]
        is_self = (key_pos[None, :] == query_pos[:, None])[None, None]  # [1, 1, L, S]
        mask = mask[None, None] & (visible | is_self)  # [B, 1, L, S]
    return mask


class ChunkedKVCache(KVCache):
    """A chunked-attention layer's cache (Llama 4): a query at position p sees the keys from its
    chunk's start, floor(p / chunk) * chunk, to itself. Every position is kept, as in KVCache (the
    scheduler's paged path keeps one chunk a row: models/paged_window.py); a call reads from the
    earliest chunk start of its rows' first queries on, so a decode step attends to at most one
    chunk of keys and needs no mask when its rows are not padded (make_chunk_mask)."""

    def __init__(self, chunk: int, batch_size: int = 1, left_pad: mx.array | None = None):
        super().__init__(batch_size, left_pad)
        self.chunk = chunk
        # each row's padding on the host: where its chunks start, without reading the device
        self.pads = [0] if left_pad is None else np.array(left_pad).tolist()

    def first_key(self) -> int:
        """Slot of the first key the next call attends to (its rows' earliest chunk start)."""
        return max(0, min(pad + (self.offset - pad) // self.chunk * self.chunk for pad in self.pads))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        first = self.first_key()
        keys, values = super().update_and_fetch(keys, values)
        return (keys, values) if first == 0 else (keys[..., first:, :], values[..., first:, :])


def make_chunk_mask(length: int, cache: ChunkedKVCache) -> mx.array | str | None:
    """Mask for `length` new queries against what `cache.update_and_fetch` will return: causal,
    each query's chunk only (chunks counted from each row's first real token, as transformers'
    chunked mask counts them past left padding), padding hidden as in make_attention_mask."""
    chunk, offset, first = cache.chunk, cache.offset, cache.first_key()
    end = offset + length
    if cache.left_pad is None:
        if length == 1 or end <= first + chunk:  # every query in the chunk of the first key
            return None if length == 1 else "causal"
        key_pos = mx.arange(first, end)
        query_pos = mx.arange(offset, end)[:, None]
        return (key_pos[None, :] <= query_pos) & (key_pos[None, :] // chunk == query_pos // chunk)  # [L, S]
    pad = cache.left_pad[:, None, None]
    slots = mx.arange(first, end)[None, None, :]  # [1, 1, S]
    queries = mx.arange(offset, end)[None, :, None]  # [1, L, 1]
    same_chunk = (slots - pad) // chunk == (queries - pad) // chunk  # [B, L, S]
    # As make_attention_mask: padding keys hidden, a padding query still sees itself (no empty row).
    mask = ((slots <= queries) & same_chunk & (slots >= pad)) | (slots == queries)
    return mask[:, None]  # [B, 1, L, S]
