"""A sliding-window KV cache: a layer that attends to the last `window` positions keeps only those.

Two layouts. A multi-token piece (prefill) is written linearly after the last `window - 1`
positions kept from before, so every query of the piece sees its full window and a tile-padded
piece can still be trimmed. A one-token step (decode) writes into a ring of at most `window`
slots (position p in slot p % window, grown in GROW_STEP slots up to the window), in place.
Attention does not care about key order (RoPE is applied before caching), so the ring is never
reordered for a step; the masks below say which slots hold which positions.

Rows are left-padded as in KVCache: one `offset` for the batch, `left_pad[b]` slots of row b hidden.
"""

from __future__ import annotations

import mlx.core as mx

from mlxcel.errors import MlxcelError
from mlxcel.models.cache import GROW_STEP, KVCache, make_attention_mask


class RotatingKVCache(KVCache):
    """KVCache's batch/left-pad bookkeeping (state, rope_offset) with the window's own storage."""

    def __init__(self, window: int, batch_size: int = 1, left_pad: mx.array | None = None):
        if window < 1:
            raise MlxcelError(f"sliding_window must be >= 1, got {window}")
        super().__init__(batch_size, left_pad)  # offset: positions seen (the next token's position)
        self.window = window
        self.start = 0  # linear layout: position of slot 0
        self.ring = False

    def first_kept(self) -> int:
        """Position of the oldest key still stored."""
        return max(0, self.offset - self.window) if self.ring else self.start

    def piece_start(self) -> int:
        """Position of the first key a multi-token piece attends to (window - 1 kept before it)."""
        return max(self.first_kept(), self.offset - (self.window - 1))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[2] == 1:
            return self._append_to_ring(keys, values)
        return self._append_linear(keys, values)

    def _append_linear(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.ring:
            self._unroll()
        start = self.piece_start()
        if self.keys is not None:
            keys = mx.concatenate([self.keys[..., start - self.start : self.offset - self.start, :], keys], axis=2)
            values = mx.concatenate(
                [self.values[..., start - self.start : self.offset - self.start, :], values], axis=2
            )
        self.keys, self.values, self.start = keys, values, start
        self.offset = start + keys.shape[2]
        return keys, values

    def _unroll(self) -> None:
        """Ring -> linear, oldest position first."""
        if self.offset >= self.window:
            self.keys = mx.roll(self.keys, -(self.offset % self.window), axis=2)
            self.values = mx.roll(self.values, -(self.offset % self.window), axis=2)
        self.start, self.ring = self.first_kept(), False

    def _roll_up(self) -> None:
        """Linear -> ring: keep the last window - 1 positions, each in slot position % window."""
        start = self.piece_start()
        keys = self.keys[..., start - self.start : self.offset - self.start, :]
        values = self.values[..., start - self.start : self.offset - self.start, :]
        if self.offset >= self.window:  # pad to a full ring; the spare slot is where the new token goes
            keys = mx.roll(self._pad(keys, self.window - keys.shape[2]), start % self.window, axis=2)
            values = mx.roll(self._pad(values, self.window - values.shape[2]), start % self.window, axis=2)
        self.keys, self.values, self.start, self.ring = keys, values, 0, True

    @staticmethod
    def _pad(x: mx.array, n: int) -> mx.array:
        B, heads, _, dim = x.shape
        return mx.concatenate([x, mx.zeros((B, heads, n, dim), x.dtype)], axis=2)

    def _append_to_ring(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if self.keys is None:
            B, heads, _, dim = keys.shape
            self.keys = mx.zeros((B, heads, 0, dim), keys.dtype)
            self.values = mx.zeros((B, heads, 0, values.shape[3]), values.dtype)
            self.ring = True
        elif not self.ring:
            self._roll_up()
        slot = self.offset % self.window
        if slot >= self.keys.shape[2]:  # still filling the first window: grow toward it
            capacity = min(self.window, max(self.keys.shape[2] + GROW_STEP, self.planned))
            self.keys = self._pad(self.keys, capacity - self.keys.shape[2])
            self.values = self._pad(self.values, capacity - self.values.shape[2])
        self.keys[..., slot : slot + 1, :] = keys
        self.values[..., slot : slot + 1, :] = values
        self.offset += 1
        size = min(self.offset, self.window)
        return self.keys[..., :size, :], self.values[..., :size, :]

    def reserve(self, needed: int) -> None:
        # Only the compiled decode step calls this: it writes whole linear buffers at the offset.
        raise MlxcelError(
            "the whole-step compiled decode (MLXCEL_DECODE_STEP=compiled) does not support sliding-window layers: use "
            "segmented or eager"
        )

    def trim(self, n: int) -> None:
        """Forget the last n positions: only after a multi-token piece (the ring overwrote older ones)."""
        if n <= 0:
            return
        if self.ring:
            raise MlxcelError(
                "a sliding-window cache cannot trim after a one-token step (the ring overwrote the window)"
            )
        self.offset = max(self.start, self.offset - n)


def make_window_mask(length: int, cache: RotatingKVCache) -> mx.array | str | None:
    """Mask for `length` new queries against what `cache.update_and_fetch` will return: causal,
    at most `window` keys back (key > query - window, as transformers), left padding hidden."""
    window, offset, left_pad = cache.window, cache.offset, cache.left_pad
    if length == 1:
        size = min(offset + 1, window)
        if left_pad is None:
            return None  # every slot holds a position inside the window
        slots = mx.arange(size)
        positions = offset - (offset - slots) % window  # the position each ring slot holds
        return (positions[None, :] >= left_pad[:, None])[:, None, None, :]
    start = cache.piece_start()
    if left_pad is None and offset == 0 and length <= window:
        return "causal"
    key_pos = mx.arange(start, offset + length)
    query_pos = mx.arange(offset, offset + length)
    mask = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] > query_pos[:, None] - window)
    if left_pad is not None:
        # As make_attention_mask: padding keys hidden, a padding query still sees itself (no empty row).
        visible = (key_pos[None, :] >= left_pad[:, None])[:, None, None, :]
        is_self = (key_pos[None, :] == query_pos[:, None])[None, None]
        mask = mask[None, None] & (visible | is_self)
    return mask


def make_layer_caches(windows: list[int | None], batch_size: int = 1, left_pad: list[int] | None = None) -> list:
    """One cache per layer: a RotatingKVCache where the layer has a window, else a KVCache."""
    pad = mx.array(left_pad, dtype=mx.int32) if left_pad is not None and any(left_pad) else None
    return [KVCache(batch_size, pad) if w is None else RotatingKVCache(w, batch_size, pad) for w in windows]


def make_layer_masks(length: int, caches: list) -> list:
    """One mask per layer, built once per kind of layer (full attention, or each window size)."""
    built: dict = {}
    masks = []
    for cache in caches:
        window = getattr(cache, "window", None)
        if window not in built:
            paged = hasattr(cache, "attention_mask")  # a paged cache masks its own windows
            built[window] = (
                make_attention_mask(length, cache) if window is None or paged else make_window_mask(length, cache)
            )
        masks.append(built[window])
    return masks


class SlidingWindowLayers:
    """Mixin for a family Model whose layers may attend to a window only: `layer_windows` holds
    each layer's window (None: full attention); caches and masks follow it."""

    layer_windows: list[int | None]

    def make_cache(self, batch_size: int = 1, left_pad: list[int] | None = None) -> list:
        return make_layer_caches(self.layer_windows, batch_size, left_pad)

    def make_masks(self, length: int, cache: list) -> list:
        return make_layer_masks(length, cache)


def read_layer_windows(config: dict, window: int | None, default_types: list[str]) -> list[int | None]:
    """Each layer's window from config.json's `layer_types` (transformers writes it), else the
    family's default pattern; None where the layer attends to everything."""
    types = config.get("layer_types") or default_types
    if len(types) != config["num_hidden_layers"]:
        raise MlxcelError(
            f"config.json: layer_types has {len(types)} entries for num_hidden_layers={config['num_hidden_layers']}"
        )
    return [window if kind == "sliding_attention" and window else None for kind in types]
