"""The sampler of a changing set of rows (the scheduler's): rows join and leave between steps.

Each row keeps its own base key, its own step (tokens it has drawn) and its slice of the chain's
state, so what it draws depends on nothing else in the batch: not on which rows share the step,
nor on their order, nor on when it joined. Rows are kept in batch order; `add` appends one and
`keep` selects the rows that go on, in the order given.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxcel.sampling import history as hist
from mlxcel.sampling import selectors as sel
from mlxcel.sampling.chain import Draw, RowKey, SamplerChain, should_compile
from mlxcel.sampling.processors import apply_token_bitmask
from mlxcel.sampling.rng import KEY_WORDS, derive_row_seed, make_base_keys, make_step_key_words


class RowsSampler:
    def __init__(self, chain: SamplerChain, logprobs: int = 0):
        self.chain = chain
        self.top_n = logprobs
        self.keys = mx.zeros((0, 2), mx.uint32)
        self.steps = np.zeros(0, dtype=np.int64)
        self.history_lengths = np.zeros(
            0, dtype=np.int64
        )  # prompt + drawn tokens: trims histories without a device read
        self.state: dict[str, mx.array] = {}
        # only a random draw or XTC reads the step keys: greedy chains skip deriving them
        self.needs_keys = not chain.is_greedy or chain.has("xtc")

    def __len__(self) -> int:
        return len(self.steps)

    def add(self, row: RowKey, prompt_ids: list[int]) -> None:
        """A new row at the end of the batch, its history the prompt (penalties, DRY)."""
        chain = self.chain
        seed = derive_row_seed(chain.seed if row.seed is None else row.seed, row.row_id, row.sample_index)
        state = chain.make_state(1, [prompt_ids]) if chain.is_stateful else {}
        if len(self) == 0:
            self.state = state
        else:
            self.state = {name: join_rows(name, self.state[name], value) for name, value in state.items()}
        self.keys = mx.concatenate([self.keys, make_base_keys([seed])])
        self.steps = np.append(self.steps, 0)
        self.history_lengths = np.append(self.history_lengths, len(prompt_ids))

    def keep(self, rows: list[int]) -> None:
        """Only these rows go on, in this order."""
        index = mx.array(np.asarray(rows, dtype=np.int32))
        self.keys = self.keys[index] if rows else self.keys[:0]
        self.steps, self.history_lengths = self.steps[rows], self.history_lengths[rows]
        self.state = {name: value[index] for name, value in self.state.items()} if rows else {}
        if "history" in self.state and self.chain.history_width is None:
            self.trim_unbounded_history()

    def trim_unbounded_history(self) -> None:
        """Whole-context histories grow a column a step for every row: drop the leading columns no
        kept row reaches, so the width follows the longest live row, not the job. The widths are
        known on the host (prompt + drawn tokens), so no step waits on a device read."""
        first = self.state["history"].shape[1] - int(self.history_lengths.max())
        if first > 0:
            self.state = {
                name: value[:, first:] if name in ("history", "suffix") else value for name, value in self.state.items()
            }

    def sample(self, logits: mx.array) -> Draw:
        """Each row's next token, at its own step."""
        if self.needs_keys:
            step_keys = make_step_key_words(self.keys, mx.array(self.steps.astype(np.uint32))[:, None])[:, 0]
        else:
            step_keys = mx.zeros((len(self), KEY_WORDS), mx.uint32)
        self.steps = self.steps + 1
        self.history_lengths = self.history_lengths + 1
        chain, top_n = self.chain, min(self.top_n, logits.shape[-1])
        compiled = self.is_compiled(len(self))
        if top_n <= 0:
            tokens, self.state = (chain._compiled_draw if compiled else chain.run_draw)(logits, step_keys, self.state)
            return Draw(tokens)
        tokens, z, self.state = (chain._compiled if compiled else chain.run_step)(logits, step_keys, self.state)
        lp = sel.log_softmax(z)
        top_ids = mx.argpartition(-lp, top_n - 1, axis=-1)[:, :top_n]
        return Draw(tokens, sel.take_token(lp, tokens), top_ids, mx.take_along_axis(lp, top_ids, axis=-1))

    def keys_ahead(self, rows: list[int], ahead: list[int]) -> mx.array:
        """[N, KEY_WORDS]: the step keys of these rows `ahead` draws past their next one (a verify
        step's later positions draw with the keys plain steps would have used)."""
        if not self.needs_keys:
            return mx.zeros((len(rows), KEY_WORDS), mx.uint32)
        index = np.asarray(rows, dtype=np.int32)
        steps = (self.steps[index] + np.asarray(ahead)).astype(np.uint32)
        return make_step_key_words(self.keys[mx.array(index)], mx.array(steps)[:, None])[:, 0]

    def advance(self, row: int, count: int) -> None:
        """The row drew `count` more tokens than its draws counted (accepted drafts)."""
        self.steps[row] += count
        self.history_lengths[row] += count

    def is_compiled(self, batch: int) -> bool:
        """Only when the chain was built with compile=True: the batch changes size as rows join and
        leave, and mx.compile traces again for every new size (slower than eager on the H200:
        docs/benchmarks.md)."""
        fixed_shapes = self.chain.history_width is not None or not self.chain.uses_history
        return fixed_shapes and self.chain.compile is True and should_compile(True, batch, self.chain.vocab_size)

    def state_arrays(self) -> list[mx.array]:
        return list(self.state.values())


def join_rows(name: str, rows: mx.array, new: mx.array) -> mx.array:
    """Stack a new row's state under the batch's; right-aligned histories (and DRY's suffix
    lengths) of different widths are left-padded to the wider (PAD, 0)."""
    if rows.ndim == 2 and rows.shape[1] != new.shape[1]:
        fill = hist.PAD if name == "history" else 0
        width = max(rows.shape[1], new.shape[1])
        rows, new = (mx.pad(a, [(0, 0), (width - a.shape[1], 0)], constant_values=fill) for a in (rows, new))
    return mx.concatenate([rows, new.astype(rows.dtype)])


compiled_apply_token_bitmask = mx.compile(apply_token_bitmask)


class GroupedRowsSampler:
    """Rows with chains of their own in one batch (a server's requests, a batch file's lines,
    each with its own temperature or penalties): the rows of each distinct (chain, logprobs)
    sample together, and the tokens come back in batch order. Rows without a chain of their own
    take the job's; with one group it is exactly RowsSampler, so a job pays nothing for this."""

    def __init__(self, chain: SamplerChain, logprobs: int = 0):
        self.chain, self.top_n = chain, logprobs
        self.groups: dict[tuple[int, int], RowsSampler] = {}
        self.members: list[tuple[int, int]] = []  # batch position -> its group's key

    def __len__(self) -> int:
        return len(self.members)

    def add(self, row: RowKey, prompt_ids: list[int], chain: SamplerChain | None = None, logprobs: int = 0) -> None:
        chain = chain or self.chain
        key = (id(chain), max(logprobs, self.top_n))  # (a group holds its chain: the id stays its own)
        if key not in self.groups:
            self.groups[key] = RowsSampler(chain, key[1])
        self.groups[key].add(row, prompt_ids)
        self.members.append(key)

    def keep(self, rows: list[int]) -> None:
        counts: dict[tuple[int, int], int] = {}
        within = []  # each batch position's place in its group
        for key in self.members:
            within.append(counts.get(key, 0))
            counts[key] = within[-1] + 1
        for key, group in list(self.groups.items()):
            kept = [within[i] for i in rows if self.members[i] == key]
            if kept:
                group.keep(kept)
            else:
                del self.groups[key]
        self.members = [self.members[i] for i in rows]

    def sample(self, logits: mx.array, bitmask: mx.array | None = None) -> Draw | GroupedDraw:
        """Every row's next token; `bitmask` [B, ceil(V / 32)]: structured output's allowed
        tokens (structured.matcher), applied before every stage of every chain."""
        if bitmask is not None:
            # one fused kernel on a GPU (traced once per batch size); eager on the CPU, where
            # compiling needs a system compiler and the mask's ops cost little beside a step
            apply = compiled_apply_token_bitmask if mx.default_device() == mx.gpu else apply_token_bitmask
            logits = apply(logits, bitmask)
        if len(self.groups) == 1:
            return next(iter(self.groups.values())).sample(logits)
        positions = {key: [] for key in self.groups}
        for i, key in enumerate(self.members):
            positions[key].append(i)
        draws = [group.sample(logits[mx.array(positions[key])]) for key, group in self.groups.items()]
        return GroupedDraw(draws, list(positions.values()))

    def state_arrays(self) -> list[mx.array]:
        return [a for group in self.groups.values() for a in group.state_arrays()]

    def locate(self) -> list[tuple[RowsSampler, int]]:
        """Each batch position's group and its place there."""
        counts: dict[tuple[int, int], int] = {}
        places = []
        for key in self.members:
            places.append((self.groups[key], counts.get(key, 0)))
            counts[key] = places[-1][1] + 1
        return places


class GroupedDraw:
    """The groups' draws as one: tokens in batch order on the device, rows in batch order on the host."""

    def __init__(self, draws: list[Draw], positions: list[list[int]]):
        self.draws, self.positions = draws, positions
        order = np.argsort(np.concatenate(positions)).astype(np.int32)
        self.tokens = mx.concatenate([d.tokens for d in draws])[mx.array(order)]

    def arrays(self) -> list[mx.array]:
        return [self.tokens] + [a for d in self.draws for a in d.arrays()]

    def to_host(self) -> tuple[list[int], list[dict | None] | None]:
        """(tokens, per row its logprobs or None; None when no group asked for them)."""
        tokens = self.tokens.tolist()
        asked = [(draw, positions) for draw, positions in zip(self.draws, self.positions) if draw.logprobs is not None]
        if not asked:
            return tokens, None
        logprobs: list[dict | None] = [None] * len(tokens)
        for draw, positions in asked:
            for i, row in zip(positions, draw.to_host()[1]):
                logprobs[i] = row
        return tokens, logprobs
