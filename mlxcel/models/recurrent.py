"""The second kind of layer state: a recurrent layer's fixed-size state per row.

A linear-attention layer (Gated DeltaNet) or a state-space layer (Mamba-2) keeps, per row, the last
`kernel - 1` inputs of its causal convolution and a recurrent matrix; both have the same size at
position 100 and at position 100,000. What a layer keeps is the list of those arrays, [rows, ...]
each, and the layer sees its cache through two calls:

    states, leads = cache.read(initial)   # the call's rows' states; initial(rows) makes fresh ones
    ...
    cache.write(new_states)               # after the call's tokens

`leads` (host ints per row, or None) counts the positions at the start of each row's line that are
not its own tokens: a left-padded batch's padding (the batch engine) or a ragged prefill call's
padding before each row's piece (the scheduler). A layer masks them out (token_mask) and keeps its
convolution's window across them (causal_conv).

Two caches implement it: RecurrentCache here, for a left-padded batch (the batch engine, direct
calls, tests); PagedRecurrentCache (paged_state.py), each scheduler row's state in a slot.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import mlx.core as mx
import numpy as np

InitialStates = Callable[[int], list[mx.array]]  # rows -> fresh (zero) states for that many rows


class RecurrentCache:
    """One recurrent layer's state for a left-padded batch: `left_pad[b]` leading positions of row b
    are padding (the batch engine pads rows to one length at their first piece)."""

    # not a KV cache: nothing to trim, no positions to attend to
    window = None

    def __init__(self, batch_size: int = 1, left_pad: mx.array | None = None):
        self.batch_size = batch_size
        self.left_pad = None if left_pad is None else np.array(left_pad, dtype=np.int32)
        self.states: list[mx.array] | None = None
        self.offset = 0  # positions seen
        self.planned = 0  # (plan_capacity sets it on every layer's cache; nothing to size here)

    def read(self, initial: InitialStates) -> tuple[list[mx.array], np.ndarray | None]:
        states = self.states if self.states is not None else initial(self.batch_size)
        leads = None
        if self.left_pad is not None and self.offset < self.left_pad.max():
            leads = np.maximum(self.left_pad - self.offset, 0)
        return states, leads

    def write(self, states: list[mx.array], length: int) -> None:
        self.states = states
        self.offset += length

    def trim(self, n: int) -> None:
        if n:
            raise ValueError("a recurrent layer's state cannot forget positions (padded prefill is off for it)")

    @property
    def state(self) -> list[mx.array]:
        return list(self.states or [])


def token_mask(leads: np.ndarray | None, length: int) -> mx.array | None:
    """[B, L] True at each row's own tokens (past its leads); None when every position is one."""
    if leads is None or not leads.any():
        return None
    return mx.array(np.arange(length)[None, :] >= leads[:, None])


def causal_conv(
    x: mx.array, conv_state: mx.array, weight: mx.array, leads: np.ndarray | None, bias: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """A depthwise causal convolution continuing from `conv_state`: x [B, L, C] (zero at leads),
    conv_state [B, K-1, C] (the inputs before it), weight [C, K, 1] (MLX's Conv1d layout).
    Returns (the output before any activation [B, L, C], the next conv_state).

    A row's leads sit between its conv_state and its own tokens in x; they are moved in front of the
    state, so each own token's window holds the state and the tokens before it, as if the row ran
    alone (its leads' outputs are garbage, masked by the caller)."""
    keep = conv_state.shape[1]
    joined = mx.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, K-1+L, C]
    if leads is not None and leads.any():
        # row b's order: its leads (at keep..keep+lead), the state (0..keep), then its own tokens
        j, lead = np.arange(keep + x.shape[1])[None, :], leads[:, None]
        order = np.where(j < lead, keep + j, np.where(j < lead + keep, j - lead, j)).astype(np.int32)
        joined = mx.take_along_axis(joined, mx.array(order)[:, :, None], axis=1)
    if x.shape[1] == 1 and mx.default_device() == mx.gpu:  # a decode step: one compiled kernel chain
        out = compiled_window_sum(joined, weight) if bias is None else compiled_window_sum_bias(joined, weight, bias)
    else:
        out = window_sum(joined, weight, bias)
    return out, joined[:, joined.shape[1] - keep :]


def window_sum(joined: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """The depthwise conv over `joined` [B, K-1+L, C] as K shifted multiply-adds (MLX's grouped
    conv1d is slow for C groups of one channel)."""
    kernel, length = weight.shape[1], joined.shape[1] - weight.shape[1] + 1
    out = joined[:, 0:length] * weight[:, 0, 0]
    for k in range(1, kernel):
        out = out + joined[:, k : length + k] * weight[:, k, 0]
    return out if bias is None else out + bias


compiled_window_sum = mx.compile(window_sum)
compiled_window_sum_bias = mx.compile(window_sum)


def compiles_pieces() -> bool:
    """Whether prefill pieces take the chunked forms compiled (gated_delta.py, ssd.py): on a GPU with
    $MLXCEL_COMPILED_PIECES=1 only. A piece's chunks are ~20 ops each and ~40 around them, per layer,
    each costing the host its graph building and launch; compiled, a piece shape is traced once and
    its elementwise chains fused. But a ragged job meets hundreds of piece shapes, each traced: on
    the H100 the Qwen 3.5 0.8B job of 256 rows ran at 2,921 tok/s compiled (TTFT p50 13.3 s) against
    4,276 eager (5.6 s), so eager is the default. The CPU would compile with the system's C++
    compiler, for no gain."""
    return mx.default_device() == mx.gpu and os.environ.get("MLXCEL_COMPILED_PIECES", "0") == "1"
