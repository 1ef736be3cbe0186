"""Recurrent layers' states in the scheduler: each row's fixed-size state beside its KV blocks.

A row's state is taken where the page table's step says (the call's slots, in batch order) and
given back after the call. Where it lives between calls:
- the decode batch's rows: one array per state, their rows in the order of the last decode step
  (`order`). The next step usually has the same rows in the same order and takes the arrays as
  they are; when rows joined or left, one gather makes the new batch's arrays.
- rows still prefilling: an array of their own each (`rows`, by slot), until their first decode step.
A row's first piece starts from fresh states (zeros). Nothing is written in place: a scatter into
a pool that the same step reads from makes MLX copy the whole pool each step (it cannot donate a
buffer another array of the graph still reads), and per-row arrays would cost a few ops per row
and layer each step.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlxcel.models.recurrent import InitialStates


class PagedRecurrentCache:
    window = None

    def __init__(self, table):
        self.table = table  # paged_cache.PageTable: the step's slots, starts and leads
        self.order: np.ndarray | None = None  # slots of `dense`, row by row
        self.dense: list[mx.array] | None = None
        self.rows: dict[int, list[mx.array]] = {}  # slot -> [1, ...] states of a row outside `dense`
        self.last: list[mx.array] = []  # what the last call wrote (evaluating the cache means these)

    def read(self, initial: InitialStates) -> tuple[list[mx.array], np.ndarray | None]:
        step = self.table.step
        slots, fresh = step.slots, step.starts == 0
        leads = step.leads if step.leads.any() else None
        same_rows = self.order is not None and np.array_equal(slots, self.order)
        # (a slot of `order` with a state of its own holds a new row: the dense one there has ended)
        if same_rows and not fresh.any() and (not self.rows or not any(s in self.rows for s in slots.tolist())):
            return self.dense, leads
        if len(slots) == 1 and not fresh[0] and int(slots[0]) in self.rows:
            return self.rows[int(slots[0])], leads
        # one gather over [dense rows..., rows of their own..., fresh rows...]
        sources, index, own = [], [], []
        dense_at = {int(s): i for i, s in enumerate(self.order)} if self.order is not None else {}
        base = len(dense_at)
        for slot, is_fresh in zip(slots.tolist(), fresh.tolist()):
            if is_fresh:
                index.append(-1)
            elif slot in self.rows:
                index.append(base + len(own))
                own.append(self.rows[slot])
            elif slot in dense_at:
                index.append(dense_at[slot])
            else:
                raise RuntimeError(f"row slot {slot} has no recurrent state to continue from")
        if self.order is not None and any(0 <= i < base for i in index):
            sources.append(self.dense)
        else:
            index = [i - base if i >= base else i for i in index]
            base = 0
        sources += own
        n_fresh = int(fresh.sum())
        if n_fresh:
            start = base + len(own)
            sources.append(initial(n_fresh))
            counter = iter(range(start, start + n_fresh))
            index = [next(counter) if i == -1 else i for i in index]
        joined = [part[0] if len(sources) == 1 else mx.concatenate(part) for part in zip(*sources)]
        if index == list(range(joined[0].shape[0])):
            return joined, leads
        take = mx.array(np.array(index, dtype=np.int32))
        return [x[take] for x in joined], leads

    def write(self, states: list[mx.array], length: int) -> None:
        step = self.table.step
        self.last = states
        slots = step.slots
        if step.decoding:  # a decode step: these rows are the batch now (not a one-token prefill piece)
            self.order, self.dense = slots.copy(), states
            if self.rows:  # (rows that just joined the batch: their own arrays go)
                for slot in slots.tolist():
                    self.rows.pop(slot, None)
            return
        if len(slots) == 1:
            self.rows[int(slots[0])] = states
            return
        for i, slot in enumerate(slots.tolist()):
            self.rows[slot] = [x[i : i + 1] for x in states]

    def row_states(self, slot: int) -> list[mx.array] | None:
        """The states of the row in `slot` after its last prefill piece ([1, ...] each); None once
        it decodes (the batch's arrays move on with every step)."""
        return self.rows.get(slot)

    def adopt(self, slot: int, states: list[mx.array]) -> None:
        """The row in `slot` starts from a cached prefix: its states after that prefix."""
        self.rows[slot] = states

    def snapshot(self, slots: np.ndarray) -> dict[int, list[mx.array]]:
        """The rows' states now ([1, ...] each, by slot): what restore puts back (speculative
        decoding, when a verify call ran a row past the drafted tokens it keeps)."""
        dense_at = {int(s): i for i, s in enumerate(self.order)} if self.order is not None else {}
        saved = {}
        for slot in slots.tolist():
            if slot in self.rows:
                saved[slot] = self.rows[slot]
            elif slot in dense_at:
                saved[slot] = [x[dense_at[slot] : dense_at[slot] + 1] for x in self.dense]
        return saved

    def restore(self, slot: int, states: list[mx.array]) -> None:
        self.rows[slot] = states

    def forget(self, slot: int) -> None:
        """The row in `slot` ended: its own state goes (a decode batch's rows drop at its next step)."""
        self.rows.pop(slot, None)

    @property
    def state(self) -> list[mx.array]:
        return self.last
