"""Draft sources for speculative decoding (decode.draft, docs/speculative.md): what a row proposes
its next tokens to be, for the scheduler to verify in one forward call.

Prompt lookup (`method: ngram`, llama.cpp's lookup decoding and vLLM's `[ngram]`): the row's last
n tokens (n from ngram_max down to ngram_min) are looked up in everything before them (prompt and
output), and the tokens that followed their latest earlier occurrence are the draft. Each row keeps
an index of its n-grams, extended by the tokens it gains, so a proposal costs O(new tokens).

How many tokens a row drafts adapts to what it gets accepted (`adaptive`): a row that keeps
missing drafts fewer and then pauses, so a row (or a batch) where lookup does not pay goes back to
plain decoding steps; one that keeps hitting drafts up to `tokens`. A lookup draft costs nothing to
make, only its positions in the verify call (at batch 1 on a GPU, next to nothing), and its hits
come in runs (a copied span) that a miss at a span's end says little about: a miss that kept some
tokens keeps the size, and only a step with nothing accepted halves it. A draft model pays a
forward step for every drafted token, so there a miss sets the size to what was accepted, plus one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PAUSE_AFTER_MISSES = 3  # verify steps in a row with nothing accepted before a row pauses drafting
PAUSE_STEPS = (4, 64)  # the first pause, doubled per pause up to the last


@dataclass
class NgramIndex:
    """One row's n-grams (n in [low, high]) -> where their latest occurrence ends."""

    low: int
    high: int
    tokens: list[int] = field(default_factory=list)
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in `ends`
    generated: int = 0  # of the row's generated tokens, those in `tokens`

    def sync(self, prompt: list[int], generated: list[int]) -> None:
        """The row's context is now `prompt` + `generated` (which only grows)."""
        if not self.tokens:
            self.tokens = list(prompt)
        self.tokens += generated[self.generated :]
        self.generated = len(generated)
        tokens = self.tokens
        # index every n-gram ending before the last position: the last one is the suffix looked up
        for end in range(self.indexed, len(tokens) - 1):
            for n in range(self.low, self.high + 1):
                if end + 1 >= n:
                    self.ends[tuple(tokens[end + 1 - n : end + 1])] = end
        self.indexed = max(self.indexed, len(tokens) - 1)

    def propose(self, count: int) -> list[int]:
        """Up to `count` tokens after the latest earlier occurrence of the longest suffix found."""
        tokens = self.tokens
        for n in range(min(self.high, len(tokens) - 1), self.low - 1, -1):
            end = self.ends.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end + 1 : end + 1 + count]
        return []


@dataclass
class RowDrafts:
    """A row's draft source and its running figures (RowResult.draft)."""

    index: NgramIndex
    tokens: int  # the most it drafts a step
    adaptive: bool
    cheap: bool = True  # drafting costs nothing (lookup): a partial miss keeps the size
    size: int = 0  # what it drafts now (adaptive); 0: start at `tokens`
    misses: int = 0  # verify steps in a row with nothing accepted
    paused: int = 0  # steps left without drafting (the scheduler counts them down)
    pauses: int = 0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # verify steps it drafted in

    def propose(self, prompt: list[int], generated: list[int], room: int) -> list[int]:
        """The draft for the row's next step (at most `room` tokens: what its limit leaves)."""
        self.index.sync(prompt, generated)
        size = min(self.size or self.tokens, room)
        return self.index.propose(size) if size > 0 else []

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.steps += 1
        if not self.adaptive:
            return
        size = self.size or self.tokens
        if accepted == drafted:
            self.size = min(self.tokens, size * 2 if self.cheap else size + 1)
        elif not self.cheap:
            self.size = max(1, accepted + 1)
        else:
            self.size = size if accepted else max(1, size // 2)
        self.misses = self.misses + 1 if accepted == 0 else 0
        if self.misses >= PAUSE_AFTER_MISSES:
            self.paused = min(PAUSE_STEPS[0] << self.pauses, PAUSE_STEPS[1])
            self.pauses += 1
            self.misses = 0

    def describe(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "steps": self.steps}


def make_row_drafts(settings) -> RowDrafts:
    """A row's drafts for decode.draft's `settings` (its lookup index goes unused with a draft model)."""
    index = NgramIndex(settings.ngram_min, settings.ngram_max)
    return RowDrafts(index, settings.tokens, settings.adaptive, cheap=settings.method == "ngram")


def count_accepted(draft: list[int], targets: list[int]) -> int:
    """Drafted tokens the target agrees with: targets[j] is the target's token after the context and
    draft[:j], so draft[j] stands while it equals targets[j]."""
    accepted = 0
    for drafted, target in zip(draft, targets):
        if drafted != target:
            break
        accepted += 1
    return accepted
