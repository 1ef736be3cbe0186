"""One forward call an iteration: the decode rows and the prefill pieces packed in one line.

The scheduler's iteration used to make one call for its decode rows and one more for each group
of prefill pieces, and a forward call costs a few ms on a GPU however few its tokens (docs/
benchmarks.md). Here the call's tokens go through the model as one line [1, T]: the decode rows'
tokens first, then each piece's, then (where the CUDA kernels run) padding up to a multiple of
PACKED_ALIGN, so a job meets a bounded set of call shapes (cuBLAS and cuDNN plan each).
Everything but attention (projections, norms, MLP, the vocabulary head at the positions asked
for) is per token, so it runs once over the T tokens with no padding to a longest row. Each
attention layer splits its queries, keys and values into two parts and runs each
as the scheduler's own step would (vLLM's flattened batch, in our two attention paths):
- the decode rows, one token each: the decode step's attention (the paged kernel reading the pool
  in place where it runs, the gathered blocks elsewhere);
- the pieces, laid out as a ragged [rows, width] call, each row's tokens last after `width - size`
  leads (neither cached nor attended to): the ragged prefill's attention.
Then it packs the outputs back in the line's order for the output projection. The padding at the
line's end attends to nothing (zeros); nothing reads it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxcel.models.paged_cache import PagedMask, StepIndices

PACKED_ALIGN = 64  # a packed call's tokens are padded to a multiple of this (few distinct call shapes)


def begin_packed(
    table, decode_slots: np.ndarray, slots: np.ndarray, spans: list[tuple[int, int]], width: int, align: int = 1
):
    """The page table's step for one packed call (PageTable.begin's counterpart; PageTable.end
    ends it): the decode rows' next tokens and the pieces `spans` of the rows in `slots`, the line
    padded to a multiple of `align`."""
    table.step = PackedStep(table, decode_slots, slots, spans, width, align)
    return table.step


class PackedStep(PagedMask):
    """The page table's step for a packed call, and the mask every attention layer gets: it runs
    the layer's attention over its two parts (`run`). `decode_slots`: the decode rows' slots, in
    batch order; `slots`, `spans`, `width`: the pieces (rows' slots, (start, end) of their prompts,
    the ragged line's width); `align`: the line is padded to a multiple of it."""

    packed = True

    def __init__(
        self,
        table,
        decode_slots: np.ndarray,
        slots: np.ndarray,
        spans: list[tuple[int, int]],
        width: int,
        align: int = 1,
    ):
        self.table = table
        self.decode_rows = len(decode_slots)
        sizes = np.array([end - start for start, end in spans], dtype=np.int32)
        leads = width - sizes
        self.parts: list[StepIndices] = []
        if self.decode_rows:
            decode = StepIndices(table, np.asarray(decode_slots, dtype=np.int32), 1)
            decode.decoding = True
            self.parts.append(decode)
        self.prefill = StepIndices(table, np.asarray(slots, dtype=np.int32), width, leads) if len(slots) else None
        if self.prefill is not None:
            self.prefill.decoding = False
            self.parts.append(self.prefill)
        self.tokens = self.decode_rows + int(sizes.sum())
        self.length = -(-self.tokens // align) * align
        # each piece's first token in the line, and the line's index of each slot of the ragged layout
        firsts = self.decode_rows + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int32)
        column = np.arange(width)[None, :]
        self.piece_tokens = None  # [rows * width] line indices (a lead takes its row's first token)
        self.piece_order = None  # [pieces' tokens] their places in the ragged layout, in line order
        self.one_piece = len(sizes) == 1 and width == int(sizes[0])  # a slice of the line: no gathers
        if self.prefill is not None and not self.one_piece:
            self.piece_tokens = mx.array((firsts[:, None] + np.maximum(column - leads[:, None], 0)).reshape(-1))
            own = (column >= leads[:, None]).reshape(-1)
            self.piece_order = mx.array(np.nonzero(own)[0].astype(np.int32))
        self.sizes, self.firsts = sizes, firsts

    def last_positions(self, done: list[int]) -> mx.array:
        """The line's indices whose logits the draw needs: every decode row's, then the last token
        of the pieces `done` (indices into the pieces) that end their prompts."""
        last = [int(self.firsts[i] + self.sizes[i] - 1) for i in done]
        return mx.array(list(range(self.decode_rows)) + last, dtype=mx.int32)

    def attention_mask(self, window):
        return self  # every layer's mask: the layer's attention runs in `run`

    def advance(self) -> None:
        """The call's positions are written: each part's rows grow by their own tokens."""
        for part in self.parts:
            self.table.lengths[part.slots] += part.new_tokens - part.leads

    def run(self, attention, x: mx.array, cache) -> mx.array:
        """One attention layer over the line `x` [1, T, hidden] (llama's Attention: its projections,
        RoPE, attend and output projection; the cache's writes and masks for each part)."""
        q, k, v = attention.project_heads(x)  # [1, heads, T, head_dim]
        table, outs = self.table, []
        for part in self.parts:
            table.step = part
            if part is self.prefill:
                qp, kp, vp = (self.take_pieces(t) for t in (q, k, v))
            else:
                qp, kp, vp = (take_decode(t, self.decode_rows) for t in (q, k, v))
            offset = cache.rope_offset()
            qp, kp = attention.rope(qp, offset), attention.rope(kp, offset)
            kp, vp = cache.update_and_fetch(kp, vp)
            out = attention.attend(qp, kp, vp, cache.attention_mask(qp.shape[2]))
            outs.append(self.put_pieces(out) if part is self.prefill else put_decode(out))
        table.step = self
        if self.length > self.tokens:
            heads, _, dim = outs[0].shape
            outs.append(mx.zeros((heads, self.length - self.tokens, dim), outs[0].dtype))
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)
        return attention.finish(out[None])

    def take_pieces(self, t: mx.array) -> mx.array:
        """[1, heads, T, D] -> the pieces' ragged layout [rows, heads, width, D]."""
        if self.one_piece:
            return t[:, :, self.decode_rows : self.tokens]
        heads, dim, rows = t.shape[1], t.shape[3], len(self.sizes)
        taken = mx.take(t[0], self.piece_tokens, axis=1)
        return taken.reshape(heads, rows, -1, dim).transpose(1, 0, 2, 3)

    def put_pieces(self, out: mx.array) -> mx.array:
        """The ragged layout's output [rows, heads, width, D] -> the pieces' tokens [heads, n, D]."""
        if self.one_piece:
            return out[0]
        rows, heads, width, dim = out.shape
        return mx.take(out.transpose(1, 0, 2, 3).reshape(heads, rows * width, dim), self.piece_order, axis=1)


def take_decode(t: mx.array, rows: int) -> mx.array:
    """[1, heads, T, D] -> the decode rows' tokens as a decode step's [rows, heads, 1, D]."""
    return t[0, :, :rows].transpose(1, 0, 2)[:, :, None]


def put_decode(out: mx.array) -> mx.array:
    """A decode step's output [rows, heads, 1, D] -> [heads, rows, D]."""
    return out[:, :, 0].transpose(1, 0, 2)
