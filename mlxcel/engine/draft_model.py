"""A draft model (decode.draft.method=model): a smaller model of the same tokenizer drafts each row's
next tokens greedily, for the scheduler's verify call (engine/drafts.py has prompt lookup).

It keeps its own paged KV pool beside the target's, the same row slots. What a row's sequence (its
prompt and every token it emitted) holds that the draft's pool does not is its backlog: the whole
prompt the first time (prefilled a row at a time, in pieces), then the tokens the last verify step
emitted. A proposal feeds every drafting row's backlog in one ragged call (the draft's first token
from its last position), then one decode call per further token; the pool then forgets the drafted
positions (the row's length goes back to its sequence's), so whatever the target accepts arrives as
the next backlog.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxcel.models.paged_cache import PageTable

CATCH_UP_PIECE = 512  # a long backlog (a new row's prompt) is prefilled in pieces of this, a row a call
BATCHED_BACKLOG = 16  # backlogs up to this ride in the proposal's first (ragged) call


class DraftModel:
    def __init__(self, model, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size  # the target's: a draft token past it could not be verified
        self.table: PageTable | None = None  # its lengths: how much of each row's sequence the pool holds
        self.caches: list = []

    def start(self, table: PageTable, caches: list) -> None:
        """A run's pool (the scheduler makes it: engine/scheduler.py make_draft_pool)."""
        self.table, self.caches = table, caches

    def admit(self, slot: int, positions: int) -> None:
        self.table.reserve(slot, positions)

    def release(self, slot: int) -> None:
        if self.table.owned[slot]:
            self.table.release(slot)
            for cache in self.caches:
                if hasattr(cache, "forget"):
                    cache.forget(slot)

    def propose(self, rows: list[tuple[int, list[int], list[int], int]], pad_id: int) -> list[list[int]]:
        """Greedy drafts for (slot, prompt, generated, count) rows: `count` tokens after each sequence
        (the prompt, then the tokens generated)."""
        for slot, prompt, generated, _ in rows:
            self.catch_up(slot, prompt, generated)
        slots = np.array([slot for slot, _, _, _ in rows], dtype=np.int32)
        backlogs = [read_tail(prompt, generated, int(self.table.lengths[slot])) for slot, prompt, generated, _ in rows]
        width = max(map(len, backlogs))
        leads = np.array([width - len(b) for b in backlogs], dtype=np.int32)
        lines = mx.array([[pad_id] * int(lead) + b for lead, b in zip(leads, backlogs)], dtype=mx.int32)
        self.table.begin(slots, width, leads)
        token = self.pick(self.model(lines, self.caches, logits_at=width - 1)[:, -1, :])
        self.table.end()
        drafted = [token]
        for _ in range(max(count for _, _, _, count in rows) - 1):
            self.table.begin(slots, 1, decoding=True)
            token = self.pick(self.model(token[:, None], self.caches)[:, -1, :])
            self.table.end()
            drafted.append(token)
        tokens = mx.stack(drafted, axis=1).tolist()
        for slot, prompt, generated, _ in rows:  # the drafted positions go: the target's verdict is the next backlog
            self.table.lengths[slot] = len(prompt) + len(generated)
        return [tokens[i][:count] for i, (_, _, _, count) in enumerate(rows)]

    def pick(self, logits: mx.array) -> mx.array:
        return mx.argmax(logits[:, : self.vocab_size], axis=-1).astype(mx.int32)

    def catch_up(self, slot: int, prompt: list[int], generated: list[int]) -> None:
        """A long backlog (a new row's prompt) into the pool, a piece a call, but for its last
        BATCHED_BACKLOG tokens (the proposal's first call takes those)."""
        start, end = int(self.table.lengths[slot]), len(prompt) + len(generated) - BATCHED_BACKLOG
        while end - start > 0:
            size = min(CATCH_UP_PIECE, end - start)
            self.table.begin(np.array([slot], dtype=np.int32), size)
            piece = read_tail(prompt, generated, start, start + size)
            self.model(mx.array([piece], dtype=mx.int32), self.caches, logits_at=size - 1)
            self.table.end()
            mx.eval([a for c in self.caches for a in c.state])
            start += size


def read_tail(prompt: list[int], generated: list[int], start: int, end: int | None = None) -> list[int]:
    """(prompt + generated)[start:end] without joining the two (a long prompt, every step)."""
    end = len(prompt) + len(generated) if end is None else end
    if start >= len(prompt):
        return generated[start - len(prompt) : end - len(prompt)]
    return prompt[start:end] + generated[: max(end - len(prompt), 0)]


def check_draft_vocabulary(target, draft, setting: str) -> None:
    """The draft must tokenize as the target does: the same token at every id of the target's
    vocabulary. `setting`: what names the draft in an error (decode.draft.model_path=...)."""
    from mlxcel.errors import MlxcelError

    if draft.vocab_size < target.vocab_size:
        raise MlxcelError(
            f"{setting}: its vocabulary has {draft.vocab_size} tokens, the model's {target.vocab_size}; a draft "
            "model must share the model's tokenizer"
        )
    for token_id in range(target.vocab_size):
        ours, theirs = target.id_to_token(token_id), draft.id_to_token(token_id)
        if ours != theirs:
            raise MlxcelError(
                f"{setting}: token {token_id} is {theirs!r} in the draft's vocabulary and {ours!r} in the "
                "model's; a draft model must share the model's tokenizer"
            )
