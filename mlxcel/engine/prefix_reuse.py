"""How the scheduler uses the prompt cache in one job: rows adopt cached prefixes when admitted,
their pieces are snapshotted as they are prefilled, and a row waits while another row in flight
is prefilling the prefix it would adopt (so 256 rows sharing a system prompt prefill it once, not
256 times in the first iterations).

A hybrid's recurrent layers keep no state per position: a prefix is adoptable only where a node of
the cache keeps their states, which a row records at the end of a prefill piece (the scheduler ends
a piece where a row's shared prefix or its history ends, so the states are there). A finished
row's answer is recorded without them (its state then is gone with the decode batch's next step).

A row's cacheable prefix stops at its first image (placeholders look alike for different
images, and M-RoPE positions shift after them), and is empty for rows whose KV differs from a
text row's over the same tokens: Phi-4-multimodal's image rows (the vision LoRA applies to the
whole row) and rows past longrope's switch (the long factors apply to every position).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxcel.engine.prompt_cache import Match, PromptCache, count_common
from mlxcel.models.paged_cache import BLOCK_SIZE, PageTable, flat_positions


class PrefixReuse:
    """`snapshot_all`: every row's prompt goes into the cache (a chat, a server, a cache folder:
    later jobs may want it); otherwise only the part a row shares with another row of this job,
    so a job whose rows share nothing pays nothing (a snapshot is a copy and a few kernels)."""

    def __init__(
        self,
        cache: PromptCache,
        table: PageTable,
        caches: list,
        model,
        rows: list,
        align: int = 1,
        snapshot_all: bool = False,
    ):
        self.cache, self.table, self.caches, self.model = cache, table, caches, model
        self.align = align  # adopted prefixes are a multiple of this (a kv_bits row's own piece size)
        self.snapshot_all = snapshot_all
        self.shared = {} if snapshot_all else count_shared_prefixes(rows, self.limit)
        self.pinned: dict[int, Match] = {}  # row index -> the path it relies on while it prefills
        self.inflight: dict[int, int] = {}  # block hash -> prefilling rows whose prefixes have that block
        self.prefilling: dict[int, object] = {}  # row index -> an admitted row still prefilling
        self.row_blocks: dict[int, list[int]] = {}
        self.arrays: dict[int, np.ndarray] = {}  # row index -> its prompt as int32 (matched often)
        # a hybrid's recurrent layers' caches (PagedRecurrentCache): their rows' states, not positions
        self.recurrent = [hasattr(c, "row_states") for c in caches]
        self.hybrid = any(self.recurrent)

    # ---- which positions a row may share ----
    def limit(self, row) -> int:
        """Positions of the row's prompt whose KV depends on its tokens alone (not a row with an
        adapter of model.adapters: its KV is its adapter's)."""
        if row.request.adapter >= 0:
            return 0
        images = row.request.images
        if images is not None and hasattr(self.model, "lora_control"):
            return 0
        longrope = getattr(self.model, "longrope_limit", None)
        if longrope is not None and len(row.prompt) > longrope:
            return 0
        if images is not None:
            return row.prompt.index(self.model.image_token_id) if self.model.image_token_id in row.prompt else 0
        return len(row.prompt)

    def snapshot_limit(self, row) -> int:
        """Positions of the row worth a snapshot."""
        return self.limit(row) if self.snapshot_all else self.shared.get(row.index, 0)

    def blocks(self, row) -> list[int]:
        """Hashes of the row's whole BLOCK_SIZE-token blocks that another row may want, each over
        every token before it."""
        if row.index not in self.row_blocks:
            prompt, hashes, previous = row.prompt[: self.snapshot_limit(row)], [], 0
            for start in range(0, len(prompt) - BLOCK_SIZE + 1, BLOCK_SIZE):
                previous = hash((previous, tuple(prompt[start : start + BLOCK_SIZE])))
                hashes.append(previous)
            self.row_blocks[row.index] = hashes
        return self.row_blocks[row.index]

    # ---- admission ----
    def should_wait(self, row) -> bool:
        """Whether a prefilling row is computing more of this row's prefix than the cache holds:
        whole blocks of it, or, once those are cached, the rest of its shared prefix that a
        prefilling row has still to reach (a prefix of 80 tokens is 2 blocks and 16 more: a row
        admitted at 64 would compute the 16 again, and a hybrid's state exists only at 80)."""
        if not self.inflight:
            return False
        blocks, shared = self.blocks(row), 0
        for block in blocks:
            if block not in self.inflight:
                break
            shared += BLOCK_SIZE
        if shared == 0:
            return False
        have = self.match(row, self.limit(row)).length
        if shared > have:
            return True
        if shared < len(blocks) * BLOCK_SIZE:
            return False
        prompt, most = self.prompt_array(row), min(self.limit(row), len(row.prompt) - 1)
        for other in self.prefilling.values():
            common = min(count_common(prompt, self.prompt_array(other)), most, self.snapshot_limit(other))
            if common > have and other.prefilled < common:
                return True
        return False

    def adopt(self, row) -> int:
        """Write the longest cached prefix of the admitted row's prompt (all but its last token,
        whose logits the row needs) into its blocks; returns the positions adopted."""
        self.prefilling[row.index] = row
        for block in self.blocks(row):
            self.inflight[block] = self.inflight.get(block, 0) + 1
        found = self.match(row, min(self.limit(row), len(row.prompt) - 1))
        while found.length % self.align:  # (a hybrid's match ends at a node: cut back to one aligned)
            found = self.match(row, found.length // self.align * self.align)
        length = found.length
        if length == 0:
            return 0
        stored, states = found.stored(), found.states() if self.hybrid else None
        index = self.index(row.slot, 0, length)
        for layer, (cache, arrays) in enumerate(zip(self.caches, stored)):
            if self.recurrent[layer]:
                cache.adopt(row.slot, states[layer])
            else:
                cache.write_positions(index, arrays)
        self.table.lengths[row.slot] = length
        self.cache.touch(found)
        self.hold(row, found)
        return length

    # ---- snapshots ----
    def record(self, row, end: int) -> list:
        """Snapshot the row's positions up to `end` (a piece's end, or a finished row's last
        fed token) into the cache; the pool holds all of them, so a prefix evicted meanwhile is
        stored again. Returns the new arrays: the caller queues them with the call's work (an
        unevaluated read would keep the whole pool's old version alive on the plain path)."""
        tokens = self.row_tokens(row, end)
        if not len(tokens):
            return []
        states = self.row_states(row, len(tokens))
        have = self.cache.match(tokens).length
        stored = []
        if have < len(tokens):
            index = self.index(row.slot, have, len(tokens))
            stored = [[] if kind else cache.read_positions(index) for cache, kind in zip(self.caches, self.recurrent)]
            found = self.cache.insert(tokens, have, stored, states)
        else:
            found = self.cache.match(tokens)
            if states is not None:
                self.cache.attach_states(found, states)
            self.cache.touch(found)
        if row.index in self.pinned:
            self.hold(row, found)
        # the states go with the call's work only where the cache kept them (a ring's are copies)
        kept = states if states is not None and found.length == len(tokens) and found.states() is states else []
        return [a for layer in [*stored, *kept] for a in layer]

    def row_states(self, row, end: int) -> list | None:
        """A hybrid's recurrent states of the row after `end` positions, where the caches hold
        them (a prefill piece that ended there); None otherwise, or for a model without them."""
        if not self.hybrid or int(self.table.lengths[row.slot]) != end:
            return None
        states = [cache.row_states(row.slot) if kind else [] for cache, kind in zip(self.caches, self.recurrent)]
        return None if any(s is None for s in states) else states

    def match(self, row, limit: int):
        """The longest cached prefix of the row's prompt it can adopt (a hybrid's: with states)."""
        return self.cache.match(self.prompt_array(row), limit, with_states=self.hybrid)

    def row_tokens(self, row, end: int) -> np.ndarray:
        """The tokens fed at positions [0, end), within what is worth a snapshot."""
        limit, prompt = self.snapshot_limit(row), self.prompt_array(row)
        longrope = getattr(self.model, "longrope_limit", None)
        if longrope is not None and end > longrope:
            return prompt[:0]  # past the switch its whole sequence ran again with the long factors
        if end <= len(prompt):
            return prompt[: min(end, limit)]
        if limit < len(prompt):
            return prompt[:limit]
        answer = np.asarray(row.result.token_ids[: end - len(prompt)], dtype=np.int32)
        return np.concatenate([prompt, answer])

    def finish_prefill(self, row) -> None:
        """The row's prompt is in the cache (or was refused by its budget): rows waiting for its
        prefix may go, and its path may be evicted again."""
        self.prefilling.pop(row.index, None)
        for block in self.blocks(row):
            left = self.inflight.get(block, 0) - 1
            if left > 0:
                self.inflight[block] = left
            else:
                self.inflight.pop(block, None)
        if row.index in self.pinned:
            self.cache.pin(self.pinned.pop(row.index), -1)

    def forget(self, row) -> None:
        """A row that left: drop what was kept for it (a server's loop sees rows without end)."""
        self.row_blocks.pop(row.index, None)
        self.arrays.pop(row.index, None)

    def release_all(self) -> None:
        for found in self.pinned.values():
            self.cache.pin(found, -1)
        self.pinned.clear()
        self.inflight.clear()
        self.prefilling.clear()

    def hold(self, row, found: Match) -> None:
        if row.index in self.pinned:
            self.cache.pin(self.pinned[row.index], -1)
        self.cache.pin(found)
        self.pinned[row.index] = found

    def index(self, slot: int, start: int, end: int) -> mx.array:
        """The slot's positions [start, end) as flat pool positions, one device array for every layer."""
        return mx.array(flat_positions(self.table.table[slot : slot + 1], np.arange(start, end)[None])[0])

    def prompt_array(self, row) -> np.ndarray:
        if row.index not in self.arrays:
            self.arrays[row.index] = np.asarray(row.prompt, dtype=np.int32)
        return self.arrays[row.index]

    def summary(self) -> dict:
        cache = self.cache
        return {
            "entries": cache.entries,
            "cached_tokens": cache.cached_tokens,
            "bytes": cache.nbytes,
            "budget_bytes": cache.budget_bytes,
            "evicted_tokens": cache.evicted_tokens,
        }


def count_shared_prefixes(rows: list, limit) -> dict[int, int]:
    """Row index -> the longest prefix (within `limit(row)`) it shares with another row: sorted,
    each row's longest common prefix with any other is with a neighbour."""
    prompts = {row.index: np.asarray(row.prompt[: limit(row)], dtype=np.int32) for row in rows}
    order = sorted(prompts, key=lambda index: prompts[index].tolist())
    shared = dict.fromkeys(prompts, 0)
    for a, b in zip(order, order[1:]):
        common = count_common(prompts[a], prompts[b])
        shared[a], shared[b] = max(shared[a], common), max(shared[b], common)
    return shared
