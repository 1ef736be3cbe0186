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
