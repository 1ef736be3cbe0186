"""A sliding-window layer's keys and values in the scheduler: each row slot keeps its last `window`
positions in a ring, whatever the row's length.

Why: in the shared paged pool a sliding layer holds every position of a row, as the full layers
must (all layers share one page table), so a 100k-token row kept 100k positions for a 128-token
window. Here position p of the row in slot s lives at s * window + p % window; a row costs
`window` positions a layer from its first token to its last (the scheduler counts it with the
row's fixed-size state, beside the recurrent layers' states: engine/scheduler.py).

Attention does not care about key order (RoPE is applied before caching), so a decode step writes
its token into the ring, then attends to the row's whole ring (positions not yet written masked).
A prefill piece first reads the ring (the window before the piece), attends to it and to its own
keys with a mask that gives each query its window, then writes its last `window` positions.

Plain MLX (CPU, Metal). Where the CUDA kernels write the pool in place and read it in decode,
sliding layers stay in the shared pool (their kernel starts at each row's window), as in
batch-invariant mode, where every row must meet the kernels it meets alone.

Chunk mode (`chunked`: Llama 4's chunked attention, `window` = the chunk size C): a query at
position p sees the keys from its chunk's start, floor(p / C) * C, to itself, never more than C
positions back, so the same ring of C positions holds them; only the mask differs. Chunked layers
take the ring on every path (the kernels have no chunk mode; the ring is plain MLX beside them).
In batch-invariant mode on a GPU a decode step attends each row's ring in a call of its own
(RingRows), whose shape is the row's alone.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxcel.models import invariant
from mlxcel.models.cpu_attention import attention
from mlxcel.models.paged_cache import PagedMask


class PagedWindowCache:
    def __init__(self, table, window: int, chunked: bool = False):
        self.table = table  # paged_cache.PageTable: the step's slots, starts, leads
        self.window = window
        self.chunk = window if chunked else None  # chunk mode: a query sees its chunk only
        self.keys: mx.array | None = None  # [slots * window, kv_heads, head_dim]
        self.values: mx.array | None = None

    def rope_offset(self) -> int | mx.array:
        return self.table.step.rope_offset

    def attention_mask(self, length: int) -> mx.array | PagedMask:
        step = self.table.step
        if step.packed:
            return step  # (its parts come back here, one at a time)
        key = ("ring", self.window, self.chunk)
        if key not in step.masks:
            mask = mx.array(ring_mask(step, self.window, self.chunk is not None))
            # batch-invariant on a GPU: a row's attention must not depend on the batch's shape
            per_row = step.invariant and step.new_tokens == 1 and invariant.pads_matmuls()
            step.masks[key] = RingRows(mask) if per_row else mask
        return step.masks[key]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write the rows' new [B, kv_heads, L, D] keys and values; return what attention_mask's
        columns say: the ring before the call's tokens, then the call's own (a piece), or the ring
        after writing it (a decode step)."""
        step, window = self.table.step, self.window
        B, heads, L, dim = keys.shape
        if self.keys is None:
            size = self.table.table.shape[0] * window
            self.keys = mx.zeros((size, heads, dim), keys.dtype)
            self.values = mx.zeros((size, heads, values.shape[3]), values.dtype)
        rings, write, own = ring_indices(step, window)
        decoding = L == 1 and not step.leads.any()
        if not decoding:  # the window before the piece: read before the piece overwrites it
            old_keys, old_values = (gather_rings(pool, rings) for pool in (self.keys, self.values))
        new_keys = keys.transpose(0, 2, 1, 3).reshape(B * L, heads, -1)[own]
        new_values = values.transpose(0, 2, 1, 3).reshape(B * L, heads, -1)[own]
        self.keys[write] = new_keys
        self.values[write] = new_values
        if decoding:
            return gather_rings(self.keys, rings), gather_rings(self.values, rings)
        return mx.concatenate([old_keys, keys], axis=2), mx.concatenate([old_values, values], axis=2)

    # ---- the prompt cache: a row's ring at a prefix's end is its state there ----
    def row_states(self, slot: int) -> list[mx.array]:
        ring = slice(slot * self.window, (slot + 1) * self.window)
        return [mx.contiguous(self.keys[ring][None]), mx.contiguous(self.values[ring][None])]

    def adopt(self, slot: int, states: list[mx.array]) -> None:
        keys, values = states
        if self.keys is None:
            size = self.table.table.shape[0] * self.window
            self.keys = mx.zeros((size, *keys.shape[2:]), keys.dtype)
            self.values = mx.zeros((size, *values.shape[2:]), values.dtype)
        ring = slice(slot * self.window, (slot + 1) * self.window)
        self.keys[ring] = keys[0]
        self.values[ring] = values[0]

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]


def gather_rings(pool: mx.array, rings: mx.array) -> mx.array:
    """[B, kv_heads, window, D]: each row's ring (slot order, not position order)."""
    return pool[rings].transpose(0, 2, 1, 3)


def ring_indices(step, window: int) -> tuple[mx.array, mx.array, mx.array]:
    """The call's device indices for rings of `window`, built once a step for every such layer
    (as the step's masks are): (each row's ring [B, W]; the ring positions to write; those
    tokens' indices into the call's flattened [B * L] tokens). The tokens written are each row's
    own (not its leads), the last `window` of them (earlier ones would be overwritten)."""
    key = ("ring-indices", window)
    if key not in step.masks:
        L, slots, leads = step.new_tokens, step.slots[:, None], step.leads[:, None]
        token = np.arange(L)[None, :]  # [1, L]
        written = (token >= leads) & (token >= L - window)  # [B, L]
        positions = step.starts[:, None] + token - leads
        rows, tokens = np.nonzero(written)
        step.masks[key] = (
            mx.array((slots * window + np.arange(window)[None, :]).astype(np.int32)),
            mx.array((slots * window + positions % window)[rows, tokens].astype(np.int32)),
            mx.array((rows * L + tokens).astype(np.int32)),
        )
    return step.masks[key]


def ring_mask(step, window: int, chunked: bool = False) -> np.ndarray:
    """[B, 1, L, S] which keys each query sees. A decode step's keys are the row's ring (S =
    window): slot j holds the latest position below the row's end that is j modulo the window,
    seen if the row has reached it. A piece's keys are the ring before it (S = window + L), then
    its own tokens; a query sees positions in (its own - window, its own]; a lead sees what the
    row's first token sees (its output is dropped; an empty row of the softmax would be NaN).
    `chunked`: a query sees its chunk's positions only (window = the chunk: floor(p / window)
    * window up to p, never more than `window` back)."""
    L, starts, leads = step.new_tokens, step.starts, step.leads
    ring = np.arange(window)[None, :]
    if L == 1 and not leads.any():
        ends = starts + 1
        held = ends[:, None] - 1 - ((ends[:, None] - 1 - ring) % window)  # [B, W]
        seen = held >= 0
        if chunked:  # (the row's newest position, its query, is ends - 1)
            seen &= held // window == (ends[:, None] - 1) // window
        return seen[:, None, None, :]
    query = starts[:, None] + np.maximum(np.arange(L)[None, :] - leads[:, None], 0)  # [B, L] positions
    before = starts[:, None] - 1 - ((starts[:, None] - 1 - ring) % window)  # [B, W]: the ring's positions
    before = np.where(starts[:, None] > 0, before, -1)
    own = starts[:, None] + np.arange(L)[None, :] - leads[:, None]  # [B, L]: the piece's positions
    own = np.where(np.arange(L)[None, :] >= leads[:, None], own, -1)
    keys = np.concatenate([before, own], axis=1)[:, None, :]  # [B, 1, S]
    q = query[:, :, None]
    seen = (keys >= 0) & (keys <= q) & (keys > q - window)
    if chunked:
        seen &= keys // window == q // window
    return seen[:, None]  # [B, 1, L, S]


class RingRows(PagedMask):
    """Batch-invariant decode attention over the rings: each row's query attends to its own ring
    (all `window` slots, its mask hiding the ones it does not see) in a call of its own, as
    paged_cache.PagedRows does for the shared pool."""

    def __init__(self, mask: mx.array):
        self.mask = mask  # [B, 1, 1, window]

    def attend(
        self, q: mx.array, k: mx.array, v: mx.array, scale: float, dense=None, sinks: mx.array | None = None
    ) -> mx.array:
        outs = []
        for b in range(q.shape[0]):
            qb, kb, vb, mask = q[b : b + 1], k[b : b + 1], v[b : b + 1], self.mask[b : b + 1]
            if dense is not None:
                outs.append(dense(qb, kb, vb, mask))
            else:
                outs.append(attention(qb, kb, vb, scale, mask=mask, sinks=sinks))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs)
