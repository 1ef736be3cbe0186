"""Each layer's cache in the scheduler, by what the layer keeps: keys and values in the shared paged
pool (paged_cache.py, quantized with decode.kv_bits), a window's or a chunk's ring per row
(paged_window.py), or a recurrent layer's state per row (paged_state.py)."""

from __future__ import annotations

from mlxcel.models.paged_cache import PagedKVCache, PageTable, QuantizedPagedKVCache
from mlxcel.models.paged_state import PagedRecurrentCache
from mlxcel.models.paged_window import PagedWindowCache


def make_paged_caches(
    num_layers: int,
    table: PageTable,
    windows: list[int | None] | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    recurrent: list[bool] | None = None,
    rings: bool = False,
    chunks: list[int | None] | None = None,
) -> list:
    """One cache per layer; `windows` gives each layer's sliding window (None: full attention),
    `recurrent` which layers keep a recurrent state instead (paged_state.py); with `rings`, sliding
    layers keep only their window per row (paged_window.py). `chunks`: each layer's attention
    chunk (Llama 4; None: not chunked), whose layers keep a ring of one chunk per row on every
    path. With `kv_bits`, full-attention layers store their pool quantized (windows and chunks stay
    as they are, as in the batch engine: they are already bounded; recurrent states are not keys
    and values)."""
    windows = windows or [None] * num_layers
    chunks = chunks or [None] * len(windows)
    return [
        PagedRecurrentCache(table)
        if is_recurrent
        else PagedWindowCache(table, chunk, chunked=True)
        if chunk is not None
        else PagedWindowCache(table, window)
        if rings and window is not None
        else QuantizedPagedKVCache(table, kv_bits, kv_group_size)
        if kv_bits and window is None
        else PagedKVCache(table, window)
        for window, chunk, is_recurrent in zip(windows, chunks, recurrent or [False] * len(windows))
    ]
