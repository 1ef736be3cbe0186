"""A paged KV cache: rows of any length share one pool of fixed-size blocks per layer.

Why paged (vLLM's PagedAttention idea) rather than one left-padded array per batch: a batch whose
rows have different lengths then needs no padding to its longest row, a finished row hands its
blocks back the moment it ends, and a new row takes whatever blocks are free. Memory follows the
sum of the rows' lengths, not rows x the longest (a ragged job's rows run 48-1536 positions).

Layout: each layer keeps keys and values as [kv_heads, num_blocks * BLOCK_SIZE, head_dim], flat
positions per head; a row's position p lives at block_table[row, p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE.
Heads first, so a row's gathered keys are [span, head_dim] matrices attention reads as they are
(positions first, each step copied them once more to a [B, heads, S, D] layout: on the CPU that
copy cost more than the attention; quantized pools keep positions first).
The page table (host) is shared by every layer, and each forward call's indices are built once
(`PageTable.begin`), not per layer.

Attention here is plain MLX, correct on every backend: a step gathers its rows' positions into a
[B, kv_heads, S, head_dim] view and masks the positions past each row's length. The gather copies
the rows' cache once per layer and step. Where our tests ran them (CUDA), kernels replace
both halves (paged_attention.py): writes go into the pool in place (MLX would copy the whole pool
for each), and decode attention reads the blocks in place.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxcel.models import invariant
from mlxcel.models.cpu_attention import attention

BLOCK_SIZE = 32  # positions per block: small enough to waste < 1 block per row, large enough to index cheaply
# On CUDA, MLX runs prefill attention in cuDNN, which builds a graph (tens of ms on an H200) for every
# new query and key length; a ragged job's pieces would build one each. There a piece's queries are
# padded to a power of two inside attention (PagedPrefill: the padding costs attention only, not the
# model's matmuls). A piece that starts on a multiple of ALIGNED_START (the scheduler's pieces do)
# attends over exactly its row's positions and then the queries' padding, in cuDNN's causal mode,
# its cheapest (no array mask to read). Other pieces attend over key spans rounded up to
# KEY_BUCKET, with an additive mask. Either way a job meets a few dozen shapes.
KEY_BUCKET = 512
ALIGNED_START = 128


def count_blocks(positions):
    """Blocks that hold `positions` positions (an int or an array of them)."""
    return -(-positions // BLOCK_SIZE)


class PageTable:
    """The host side: which blocks each row slot owns and how many positions it holds."""

    def __init__(
        self,
        num_blocks: int,
        max_rows: int,
        max_positions: int,
        in_place: bool = False,
        decode_kernel: bool = False,
        max_blocks: int | None = None,
        invariant: bool = False,
    ):
        self.num_blocks = num_blocks
        # batch-invariant mode: each row's attention is computed as it would be alone (StepIndices)
        self.invariant = invariant
        # up to this many as rows need them (grow); the in-place kernels' pools keep their size
        self.max_blocks = num_blocks if in_place or max_blocks is None else max(num_blocks, max_blocks)
        self.in_place = in_place  # the pools are written in place by paged_attention's kernels
        # the model's attention takes PagedMask objects: decode reads the blocks in place, prefill
        # pieces run at bucketed shapes
        self.decode_kernel = decode_kernel and in_place
        self.blocks_per_row = -(-max_positions // BLOCK_SIZE)
        self.table = np.zeros((max_rows, self.blocks_per_row), dtype=np.int32)
        self.owned = np.zeros(max_rows, dtype=np.int32)  # blocks each slot holds
        self.lengths = np.zeros(max_rows, dtype=np.int32)  # positions written
        self.shifts = np.zeros(max_rows, dtype=np.int32)  # added to a row's RoPE position (M-RoPE rows after images)
        self.adapted = np.zeros(
            max_rows, dtype=bool
        )  # rows that take the model's per-row adapter (Phi-4-multimodal's vision LoRA)
        self.free = list(range(num_blocks))  # lowest first: allocation is a function of the schedule alone
        self.step: StepIndices | None = None

    @property
    def free_blocks(self) -> int:
        return len(self.free)

    def grow(self, needed: int) -> bool:
        """Make `needed` blocks free by growing the pool (doubling, up to max_blocks); False if
        it cannot. The layers pad their pools to the new size at their next access (fit). An open
        feed's rows are unknown in advance: a pool sized for max_rows rows of the whole context
        costs seconds of page faults on the CPU before the first token (3 GB for SmolLM2)."""
        short = needed - len(self.free)
        if short <= 0:
            return True
        size = self.num_blocks
        while size - self.num_blocks < short and size < self.max_blocks:
            size = min(self.max_blocks, size * 2)
        if size - self.num_blocks < short:
            return False
        self.free += list(range(self.num_blocks, size))  # (higher than every block: still lowest first)
        self.num_blocks = size
        return True

    def reserve(self, slot: int, positions: int) -> None:
        """Give `slot` blocks for `positions` positions in all (the caller checked free_blocks)."""
        needed = count_blocks(positions) - self.owned[slot]
        if needed > len(self.free):
            raise MemoryError(f"the KV pool has {len(self.free)} free blocks, {needed} needed")
        if needed > 0:
            taken, self.free = self.free[:needed], self.free[needed:]
            self.table[slot, self.owned[slot] : self.owned[slot] + needed] = taken
            self.owned[slot] += needed

    def release(self, slot: int) -> None:
        """The slot's blocks go back to the pool (kept sorted: lowest first again)."""
        owned = self.table[slot, : self.owned[slot]].tolist()
        self.free = sorted(self.free + owned)
        self.owned[slot] = 0
        self.lengths[slot] = 0
        self.shifts[slot] = 0
        self.adapted[slot] = False

    def begin(
        self,
        slots: np.ndarray,
        new_tokens: int,
        leads: np.ndarray | None = None,
        decoding: bool = False,
        offsets: np.ndarray | None = None,
    ) -> StepIndices:
        """Indices for one forward call: `new_tokens` positions for each of `slots` (in batch order).
        `leads`: padding tokens before each row's own (neither cached nor attended to), so rows
        of different lengths end together (a ragged prefill piece). Not for quantized pools.
        `decoding`: the call is the decode batch's step (a one-token prefill piece is not).
        `offsets`: one-token rows this far past their slots' lengths (StepIndices); end() leaves
        such a call's lengths to the caller."""
        self.step = StepIndices(self, np.asarray(slots, dtype=np.int32), new_tokens, leads, offsets)
        self.step.decoding = decoding
        return self.step

    def end(self, padding: int = 0) -> None:
        """The call's positions are written: the rows grow by its tokens, less the `padding` at
        their end (a tile-padded prefill piece), which later writes overwrite, and their leads."""
        step = self.step
        if step.packed:
            step.advance()
        elif not step.shares_slots:
            self.lengths[step.slots] += step.new_tokens - padding - step.leads
        self.step = None


class StepIndices:
    """One forward call's device indices, shared by every layer."""

    packed = False  # (a packed call's step is paged_packed.PackedStep)

    def __init__(
        self,
        table: PageTable,
        slots: np.ndarray,
        new_tokens: int,
        leads: np.ndarray | None = None,
        offsets: np.ndarray | None = None,
    ):
        self.slots, self.new_tokens = slots, new_tokens
        self.leads = np.zeros(len(slots), dtype=np.int32) if leads is None else np.asarray(leads, dtype=np.int32)
        starts = table.lengths[slots]  # [B] positions already cached
        # offsets: each row's token sits this far past its slot's length; a slot may come several
        # times (a verify call's drafted positions, each a decode row of its own: write_in_place)
        self.shares_slots = offsets is not None
        if offsets is not None:
            starts = starts + np.asarray(offsets, dtype=starts.dtype)
        self.starts = starts
        self.device_starts = mx.array(starts) if table.in_place else None
        ends = starts + new_tokens - self.leads
        if (count_blocks(ends) > table.owned[slots]).any():
            raise RuntimeError("a row would write past its reserved blocks")
        blocks = table.table[slots, : int(count_blocks(ends.max()))]  # the columns any row reaches
        positions = starts - self.leads + table.shifts[slots]  # a lead's padding sits just before the row's tokens
        # (batch-invariant: the array form even for one row, so a row alone takes the kernel it takes in a batch)
        one = len(slots) == 1 and not table.invariant
        self.rope_offset: int | mx.array = int(positions[0]) if one else mx.array(positions)
        self.ends, self.blocks = ends, blocks
        self.masks: dict = {}  # window (None: full attention) -> that kind of layer's mask
        self.decode_kernel = new_tokens == 1 and table.decode_kernel
        self.invariant = table.invariant
        # batch-invariant decode on a GPU without the decode kernel: each row attends in a call of its
        # own over exactly its positions (a GPU's attention splits the keys by the batch's shape)
        self.per_row = table.invariant and new_tokens == 1 and not self.decode_kernel and invariant.pads_matmuls()
        if self.decode_kernel:
            if self.shares_slots:  # the rows' new positions, stored before the kernel reads them
                self.write = mx.array(flat_positions(blocks, (ends - 1)[:, None]).reshape(-1))
            return  # the kernel finds each row's new position itself
        new_pos = np.maximum(
            starts[:, None] - self.leads[:, None] + np.arange(new_tokens)[None, :], 0
        )  # [B, L]; leads are never written
        self.write = mx.array(flat_positions(blocks, new_pos).reshape(-1))
        self.device_leads = mx.array(self.leads) if table.in_place else None
        self.own = None  # the plain path stores only the rows' own tokens (the kernel skips leads itself)
        if self.leads.any() and not table.in_place:
            own = (np.arange(new_tokens)[None, :] >= self.leads[:, None]).reshape(-1)
            self.own = mx.array(np.nonzero(own)[0].astype(np.int32))
        # Keys to attend over: each row's positions up to its end. Rows that all end together
        # (one row, a uniform batch) gather exactly those, so they need no array mask (MLX's fused
        # attention takes none: "causal" aligns the new queries to the last keys). Otherwise rows
        # are padded to the longest in whole blocks (fewer distinct shapes for the kernels'
        # caches); padding reads a valid slot and is masked out. On the in-place path pieces use
        # padded query spans (ALIGNED_START) or bucketed spans (KEY_BUCKET), as said at the top.
        self.exact = not table.in_place and bool((ends == ends[0]).all()) and not self.leads.any()
        # queries padded to a power of two where the model's attention pads them (PagedPrefill);
        # a padded query sees what the last real one sees
        self.pad_queries = table.decode_kernel and new_tokens > 1
        self.queries = 1 << (new_tokens - 1).bit_length() if self.pad_queries else new_tokens
        self.aligned = (
            self.pad_queries
            and bool((starts == starts[0]).all())
            and starts[0] % ALIGNED_START == 0
            and not self.leads.any()
        )
        bucket = KEY_BUCKET if table.in_place and new_tokens > 1 else BLOCK_SIZE
        if self.aligned:
            span = int(starts[0]) + self.queries  # the rows' positions, then the queries' padding
        else:
            span = int(ends.max()) if self.exact else int(-(-ends.max() // bucket) * bucket)
        self.key_pos = np.arange(span)[None, :]
        self.valid = self.key_pos < ends[:, None]
        self.span = span
        if table.in_place:  # the kernels gather positions
            self.gather = mx.array(flat_positions(blocks, np.where(self.valid, self.key_pos, 0)))  # [B, S]
        else:  # plain MLX gathers whole blocks: a few large copies, not one per position
            self.gather_blocks = mx.array(blocks[:, : int(count_blocks(span))])  # [B, blocks]
        # a one-row piece's image block per new token (-1 outside images): tokens of one block
        # see each other both ways (Gemma 3); set by the scheduler before the forward call
        self.image_blocks: np.ndarray | None = None

    def attention_mask(self, window: int | None) -> PagedMask | mx.array | None:
        """The mask of layers that see `window` positions back (None: all), built once a step;
        None where the keys are exactly the row's positions and no window cuts them."""
        if window not in self.masks:
            self.masks[window] = self.make_mask(window)
        return self.masks[window]

    def make_mask(self, window: int | None) -> PagedMask | mx.array | None:
        ends, new_tokens = self.ends, self.new_tokens
        if self.decode_kernel:
            longest = int(ends.max()) if window is None else min(int(ends.max()), window)
            return PagedDecode(
                mx.array(self.blocks), mx.array(ends.astype(np.int32)), longest, window or 0, self.invariant
            )
        if self.per_row and self.image_blocks is None:
            return PagedRows(ends.tolist(), window)
        if self.exact and (window is None or ends[0] <= window) and self.image_blocks is None:
            return None
        if self.aligned and (window is None or ends.max() <= window) and self.image_blocks is None:
            return PagedPrefill(None, self.queries)  # causal: the last query (a padded one) meets the last key
        key_pos, valid = self.key_pos, self.valid
        if new_tokens == 1:
            seen = valid if window is None else valid & (key_pos >= ends[:, None] - window)
            return mx.array(seen)[:, None, None, :]  # [B, 1, 1, S]
        queries = self.queries
        # a lead's padding sees what the row's first token sees, a padded query what its last one sees
        own = np.clip(np.arange(queries)[None, :] - self.leads[:, None], 0, (ends - self.starts - 1)[:, None])
        query_pos = (self.starts[:, None] + own)[:, :, None]  # [B, Lq, 1]
        seen = key_pos[:, None, :] <= query_pos
        if self.image_blocks is not None:  # one row: its new tokens' blocks, -1 elsewhere
            query_blocks = np.full(queries, -1)
            query_blocks[:new_tokens] = self.image_blocks
            key_blocks = np.full(key_pos.shape[1], -1)
            key_blocks[self.starts[0] : ends[0]] = self.image_blocks
            seen = seen | ((query_blocks[:, None] == key_blocks[None, :]) & (query_blocks[:, None] >= 0))[None]
        seen &= valid[:, None, :]
        if window is not None:
            seen &= key_pos[:, None, :] > query_pos - window
        mask = mx.array(seen)[:, None]  # [B, 1, Lq, S]
        return PagedPrefill(mask, queries) if self.pad_queries else mask


class PagedMask:
    """A mask argument the model's attention hands its queries, keys and values to (llama's
    Attention.attend): the paged cache decides how they attend. `sinks` [heads]: a learned logit
    per head in every query's softmax (gpt-oss), where the family has them. `packed`: the mask
    runs the layer's whole attention (paged_packed.PackedStep.run), not only its attend."""

    packed = False

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        raise NotImplementedError


class PagedPrefill(PagedMask):
    """A piece's attention at few distinct shapes: its queries are padded to `queries` (zeros,
    whose outputs are dropped) so cuDNN meets few shapes; `mask` None is causal (the keys are the
    rows' positions then one per padded query)."""

    def __init__(self, mask: mx.array | None, queries: int):
        self.mask, self.queries = mask, queries

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        length, padded = q.shape[2], self.queries
        if padded > length:
            q = mx.pad(q, [(0, 0), (0, 0), (0, padded - length), (0, 0)])
        if self.mask is not None and self.mask.dtype == mx.bool_:
            # additive, once for every layer: cuDNN took a boolean mask at ~2-4x the cost (docs/benchmarks.md)
            self.mask = mx.where(self.mask, mx.array(0, q.dtype), mx.array(-float("inf"), q.dtype))
        mask = "causal" if self.mask is None else self.mask
        out = attention(q, k, v, scale, mask=mask, sinks=sinks)
        return out[:, :, :length] if padded > length else out


class PagedDecode(PagedMask):
    """The mask argument of a decode step whose attention reads the blocks in place: the model's
    attention gets the step's new keys and values back from update_and_fetch, which also names
    its layer's pool here (`layer`), gets this from attention_mask, and calls attend."""

    def __init__(self, block_table: mx.array, lengths: mx.array, longest: int, window: int = 0, one_split=False):
        self.block_table, self.lengths, self.longest, self.window = block_table, lengths, longest, window
        self.one_split = one_split  # batch-invariant: every row's positions in one split, whatever the batch
        self.layer = None  # the PoolLayer of the layer whose attention runs now

    def attend(
        self, q: mx.array, new_keys: mx.array, new_values: mx.array, scale: float, sinks: mx.array | None = None
    ) -> mx.array:
        from mlxcel.models.paged_attention import paged_decode_attention

        return paged_decode_attention(
            q,
            new_keys,
            new_values,
            self.layer,
            self.block_table,
            self.lengths,
            self.longest,
            scale,
            BLOCK_SIZE,
            self.window,
            self.one_split,
            sinks,
        )


class PagedRows(PagedMask):
    """Batch-invariant decode attention on the plain path: each row's one query attends over
    exactly its own positions (the last `window` of them in a sliding-window layer), in a call of
    its own, so the keys' split is the row's alone. `dense(q, k, v, mask)`: the family's own
    attention where it has one (Gemma 2's soft-capped scores)."""

    def __init__(self, ends: list[int], window: int | None):
        self.ends, self.window = ends, window

    def attend(
        self, q: mx.array, k: mx.array, v: mx.array, scale: float, dense=None, sinks: mx.array | None = None
    ) -> mx.array:
        outs = []
        for b, end in enumerate(self.ends):
            first = max(0, end - self.window) if self.window else 0
            qb, kb, vb = q[b : b + 1], k[b : b + 1, :, first:end], v[b : b + 1, :, first:end]
            if dense is not None:
                outs.append(dense(qb, kb, vb, None))
            else:
                outs.append(attention(qb, kb, vb, scale, sinks=sinks))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs)


def flat_positions(blocks: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Flat pool indices of row positions; blocks [B, blocks_per_row], positions [B, N]."""
    block = np.take_along_axis(blocks, positions // BLOCK_SIZE, axis=1)
    return (block * BLOCK_SIZE + positions % BLOCK_SIZE).astype(np.int32)


class PagedKVCache:
    """One layer's pool, behind the KVCache interface the model families call."""

    # no one offset for all rows: each row's position comes from rope_offset (Phi-3's longrope reads this)
    offset = None

    def __init__(self, table: PageTable, window: int | None = None):
        self.table = table
        self.window = window  # attends to this many positions back (a sliding-window layer); None: all
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.pool = None  # paged_attention.PoolLayer on the in-place path

    def rope_offset(self) -> int | mx.array:
        return self.table.step.rope_offset

    def attention_mask(self, length: int) -> PagedMask | mx.array | str | None:
        mask = self.table.step.attention_mask(self.window)
        if mask is not None:
            return mask
        return None if length == 1 else "causal"

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write [B, kv_heads, L, D] at the rows' next positions; return their cached positions
        as [B, kv_heads, S, D] (the new ones included)."""
        step = self.table.step
        B, heads, L, _ = keys.shape
        if self.table.in_place:
            return self.write_in_place(step, keys, values)
        size = self.table.num_blocks * BLOCK_SIZE
        if self.keys is None:
            self.keys = mx.zeros((heads, size, keys.shape[3]), keys.dtype)
            self.values = mx.zeros((heads, size, values.shape[3]), values.dtype)
        self.keys, self.values = fit(self.keys, size, axis=1), fit(self.values, size, axis=1)
        new_keys = keys.transpose(1, 0, 2, 3).reshape(heads, B * L, -1)
        new_values = values.transpose(1, 0, 2, 3).reshape(heads, B * L, -1)
        write = step.write
        if step.own is not None:  # rows with leading padding
            new_keys, new_values, write = new_keys[:, step.own], new_values[:, step.own], write[step.own]
        self.keys[:, write] = new_keys
        self.values[:, write] = new_values
        if not step.starts.any() and step.exact:  # first pieces, all of one length
            return keys, values  # a first piece attends to exactly what it brought
        return gather_heads_first(self.keys, step), gather_heads_first(self.values, step)

    def write_in_place(self, step: StepIndices, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        from mlxcel.models import paged_attention

        if self.pool is None:
            self.pool = paged_attention.PoolLayer(
                self.table.num_blocks * BLOCK_SIZE, keys.shape[1], keys.shape[3], keys.dtype, values.shape[3]
            )
        if step.decode_kernel:
            if step.shares_slots:
                # rows of one slot read each other's new positions: all stored first (the kernel's
                # own stores then write the same values again)
                paged_attention.write_positions(self.pool, keys[:, :, 0], values[:, :, 0], step.write)
            step.attention_mask(self.window).layer = self.pool  # its kernel stores them and reads the pool
            return keys, values
        return paged_attention.write_and_gather(
            self.pool, keys, values, step.write, step.gather, step.device_starts, step.device_leads
        )

    def read_positions(self, index: mx.array) -> list[mx.array]:
        """What the pool holds at flat positions `index` [n] (int32, one array for every layer):
        keys and values, [n, kv_heads, D] each (the prompt cache's snapshots). On the in-place
        path a kernel reads them, ordered after the kernels that wrote them."""
        if self.pool is not None:
            from mlxcel.models import paged_attention

            return list(paged_attention.read_positions(self.pool, index))
        return [self.keys[:, index].swapaxes(0, 1), self.values[:, index].swapaxes(0, 1)]

    def write_positions(self, index: mx.array, stored: list[mx.array]) -> None:
        """Store what read_positions returned at flat positions `index` (a row adopting a cached prefix)."""
        keys, values = stored
        if self.table.in_place:
            from mlxcel.models import paged_attention

            if self.pool is None:
                self.pool = paged_attention.PoolLayer(
                    self.table.num_blocks * BLOCK_SIZE, keys.shape[1], keys.shape[2], keys.dtype, values.shape[2]
                )
            paged_attention.write_positions(self.pool, keys, values, index)
            return
        size = self.table.num_blocks * BLOCK_SIZE
        if self.keys is None:
            self.keys = mx.zeros((keys.shape[1], size, keys.shape[2]), keys.dtype)
            self.values = mx.zeros((values.shape[1], size, values.shape[2]), values.dtype)
        self.keys, self.values = fit(self.keys, size, axis=1), fit(self.values, size, axis=1)
        self.keys[:, index] = keys.swapaxes(0, 1)
        self.values[:, index] = values.swapaxes(0, 1)

    @property
    def state(self) -> list[mx.array]:
        """What evaluating the cache means: the pool, or on the in-place path the last write."""
        if self.pool is not None:
            return [self.pool.done]
        return [] if self.keys is None else [self.keys, self.values]


def fit(pool: mx.array, positions: int, axis: int = 0) -> mx.array:
    """`pool` with zero positions (along `axis`) added up to `positions` (after PageTable.grow)."""
    extra = positions - pool.shape[axis]
    if extra <= 0:
        return pool
    shape = list(pool.shape)
    shape[axis] = extra
    return mx.concatenate([pool, mx.zeros(shape, pool.dtype)], axis=axis)


def gather_heads_first(pool: mx.array, step: StepIndices) -> mx.array:
    """The step's rows' keys or values as [B, kv_heads, S, D] from a pool [kv_heads, positions, D]:
    whole blocks gathered; each (row, head) is a contiguous [S, D] matrix (no further copy)."""
    heads, _, dim = pool.shape
    B, blocks = step.gather_blocks.shape
    rows = pool.reshape(heads, -1, BLOCK_SIZE, dim)[:, step.gather_blocks]  # [heads, B, blocks, BLOCK_SIZE, D]
    return rows.reshape(heads, B, blocks * BLOCK_SIZE, dim)[:, :, : step.span].swapaxes(0, 1)


def gather_blocks(pool: mx.array, step: StepIndices) -> mx.array:
    """The step's rows' parts as [B, kv_heads, S, *] from a positions-first pool [positions, kv_heads, *]
    (a quantized pool's packed values, scales or biases, dequantized after: whole blocks gathered)."""
    _, heads, dim = pool.shape
    B, blocks = step.gather_blocks.shape
    rows = pool.reshape(-1, BLOCK_SIZE, heads, dim)[step.gather_blocks]  # [B, blocks, BLOCK_SIZE, heads, *]
    return rows.reshape(B, blocks * BLOCK_SIZE, heads, dim)[:, : step.span].transpose(0, 2, 1, 3)


class QuantizedPagedKVCache(PagedKVCache):
    """A full-attention layer's pool stored quantized (`decode.kv_bits`), as QuantizedKVCache:
    keys and values are quantized as they are written and dequantized as a step gathers them; a
    row's first piece attends to its own full-precision keys. Plain MLX only (the CUDA kernels
    read unquantized pools)."""

    def __init__(self, table: PageTable, bits: int, group_size: int):
        super().__init__(table)
        self.bits, self.group_size = bits, group_size
        self.parts: tuple | None = None  # keys' and values' (packed, scales, biases), [positions, kv_heads, *]
        self.dtype = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        from mlxcel.models.quantized_cache import check_head_dim

        step = self.table.step
        B, heads, L, D = keys.shape
        if self.parts is None:
            for width in (D, values.shape[-1]):  # (an MLA layer's values, its RoPE key, are narrower)
                check_head_dim(width, self.group_size)
        new = [
            mx.quantize(x.transpose(0, 2, 1, 3).reshape(B * L, heads, -1), group_size=self.group_size, bits=self.bits)
            for x in (keys, values)
        ]
        size = self.table.num_blocks * BLOCK_SIZE
        if self.parts is None:
            self.dtype = keys.dtype
            self.parts = tuple(tuple(mx.zeros((size, *p.shape[1:]), p.dtype) for p in parts) for parts in new)
        self.parts = tuple(tuple(fit(p, size) for p in parts) for parts in self.parts)
        for stored, written in zip(self.parts, new):
            for part, new_part in zip(stored, written):
                part[step.write] = new_part
        if not step.starts.any() and step.exact:  # first pieces, all of one length
            return keys, values
        return self.read(self.parts[0], step), self.read(self.parts[1], step)

    def read(self, parts: tuple, step: StepIndices) -> mx.array:
        """[B, kv_heads, S, D] in the model's dtype: the step's rows' blocks, dequantized."""
        packed, scales, biases = (gather_blocks(p, step) for p in parts)
        return mx.dequantize(packed, scales, biases, group_size=self.group_size, bits=self.bits).astype(self.dtype)

    def read_positions(self, index: mx.array) -> list[mx.array]:
        """The packed keys' and values' parts (packed, scales, biases each) at flat positions."""
        return [p[index] for parts in self.parts for p in parts]

    def write_positions(self, index: mx.array, stored: list[mx.array]) -> None:
        size = self.table.num_blocks * BLOCK_SIZE
        if self.parts is None:
            grouped = (stored[:3], stored[3:])
            self.parts = tuple(tuple(mx.zeros((size, *a.shape[1:]), a.dtype) for a in parts) for parts in grouped)
            self.dtype = stored[1].dtype  # the scales are in the model's dtype
        self.parts = tuple(tuple(fit(p, size) for p in parts) for parts in self.parts)
        for part, value in zip([p for parts in self.parts for p in parts], stored):
            part[index] = value

    @property
    def state(self) -> list[mx.array]:
        return [] if self.parts is None else [p for parts in self.parts for p in parts]
