"""Batch-invariant matmuls (runner.batch_invariant): a row's numbers do not depend on what shares
its forward call.

A GPU's matmul picks its kernel, tiling and split of the reduction by the shape, the number of
rows included: on the H200 in bf16 a one-row matmul never gives the bits the same row gets among
others, and the MLP's down projection (8192 -> 2048) changes kernel above 100 rows
(`python -m mlxcel.bench.invariance`, docs/benchmarks.md). Here every matmul of the language
model runs at one row count where rows meet, in a decode step: its rows are padded to a multiple
of ROWS and each ROWS-row slice is a call of its own, so a row meets the same kernel alone as
among 255 others, at any position of its slice (a tiled matmul computes every row of a tile the
same way). A prefill call needs no slicing: in this mode it holds one row's own piece, whose
shape is the row's alone (engine/scheduler.py, INVARIANT_PIECE). The CPU's BLAS keeps one
reduction order whatever the row count (checked by the same bench and the tests), so there the
layers stay as they are.

The layers are switched in place by class (`set_batch_invariant`): parameter names, isinstance
checks and the loaded weights stay as they are, and a sweep's next job can switch them back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

ROWS = 64  # every decode step's matmuls run at this row count in batch-invariant mode
_slicing = False  # within sliced_matmuls: the switched layers run ROWS rows a call


@contextmanager
def sliced_matmuls() -> Iterator[None]:
    """The switched layers slice their rows while the graph of a decode step is built."""
    global _slicing
    previous, _slicing = _slicing, True
    try:
        yield
    finally:
        _slicing = previous


def pads_matmuls() -> bool:
    """Where matmuls must be padded to ROWS rows: on a GPU (CUDA, Metal), not on the CPU."""
    return mx.default_device() == mx.gpu


def run_in_slices(call: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
    """`call` (a matmul over the last axis) on x's rows, ROWS rows a call, padded with zeros."""
    *lead, width = x.shape
    flat = x.reshape(-1, width)
    rows = flat.shape[0]
    padded = -(-rows // ROWS) * ROWS
    if padded != rows:
        flat = mx.pad(flat, [(0, padded - rows), (0, 0)])
    parts = [call(flat[start : start + ROWS]) for start in range(0, padded, ROWS)]
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts)
    return out[:rows].reshape(*lead, out.shape[-1])


class InvariantLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        return run_in_slices(super().__call__, x) if _slicing else super().__call__(x)


class InvariantQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        return run_in_slices(super().__call__, x) if _slicing else super().__call__(x)


class InvariantEmbedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:  # a tied vocabulary head
        return run_in_slices(super().as_linear, x) if _slicing else super().as_linear(x)


class InvariantQuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:
        return run_in_slices(super().as_linear, x) if _slicing else super().as_linear(x)


INVARIANT = {
    nn.Linear: InvariantLinear,
    nn.QuantizedLinear: InvariantQuantizedLinear,
    nn.Embedding: InvariantEmbedding,
    nn.QuantizedEmbedding: InvariantQuantizedEmbedding,
}
PLAIN = {invariant: plain for plain, invariant in INVARIANT.items()}


def language_modules(model) -> list[nn.Module]:
    """The modules a generated token runs through: the text backbone and the vocabulary head (a
    vision tower runs once per row, on that row's images alone)."""
    modules = list(model.model.modules())
    if "lm_head" in model:
        modules += list(model.lm_head.modules())
    return modules


def set_batch_invariant(model, on: bool) -> None:
    """Switch the language model's matmuls to ROWS-row calls (`on`, where pads_matmuls) or back."""
    swap = INVARIANT if on and pads_matmuls() else PLAIN
    for module in language_modules(model):
        cls = swap.get(type(module))
        if cls is not None:
            module.__class__ = cls


def find_invariance_problem(model) -> str | None:
    """Why `model` cannot run batch-invariant, or None. Mixture-of-experts layers group a step's
    tokens by expert across rows; a per-row adapter (Phi-4-multimodal's vision LoRA) adds low-rank
    matmuls over the whole batch."""
    if hasattr(model, "lora_control"):
        return "its vision LoRA adds matmuls over the whole batch (Phi-4-multimodal)"
    from mlxcel.models.switch import QuantizedSwitchLinear, SwitchLinear

    if any(isinstance(m, (SwitchLinear, QuantizedSwitchLinear)) for m in language_modules(model)):
        return "its mixture-of-experts layers group tokens by expert across rows"
    if pads_matmuls() and hasattr(model, "state_bytes_per_row"):
        # (on the CPU every row's reductions run alone whatever the batch; on a GPU the kernels'
        # split of a reduction may follow the batch's shape, and that is not measured yet)
        return "its recurrent layers' state updates are not checked batch-invariant on a GPU yet"
    return None
