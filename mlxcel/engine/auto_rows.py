"""runner.max_rows=auto: how many rows decode at once when the config does not say (docs/jobs.md)."""

from __future__ import annotations

import mlx.core as mx

from mlxcel.engine.scheduler import kv_bytes_per_position, ring_bytes_per_row, state_bytes_per_row

CPU_ROWS = 8  # the CPU's (and the batch engine's) rows at once: the default before auto
# On a GPU, rows at once stop at this many. H200, bf16, the 512-row ragged job (docs/benchmarks.md):
# the 1B shape ran 7,694 tok/s at 256 rows against 2,120 at 8. More than 256 rows were not measured.
GPU_ROWS_CAP = 256
# An open loop (a server, a Ray worker) does not know its rows' lengths: it sizes for rows of
# decode.max_tokens after a prompt this long (a long chat turn), within the model's context.
OPEN_PROMPT_TOKENS = 2048


def choose_max_rows(
    setting: int | str,
    model,
    positions: float,
    kv_budget_bytes: int,
    rows: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    gpu: bool | None = None,
) -> int:
    """runner.max_rows as an int: a number is kept; `auto` is CPU_ROWS on the CPU, where more rows
    at once gain little (one core set computes every row), and on a GPU as many rows as
    `kv_budget_bytes` holds at `positions` positions a row (the job's mean, or an open loop's
    estimate), each row's recurrent states and rings included, at most GPU_ROWS_CAP and at most
    the job's `rows`. A GPU's step costs about the same for 8 rows as for hundreds, so rows at
    once are its throughput; the budget, not the slot count, bounds memory: the scheduler admits a
    row only when the blocks for its own prompt and tokens are free, so a longer row than the
    mean waits for blocks, it never overruns the budget. `gpu` None: MLX's default device (on_gpu)."""
    if setting != "auto":
        return int(setting)
    if not (on_gpu() if gpu is None else gpu) or model is None:
        return CPU_ROWS
    # (sliding layers counted at every position: the pool holds them so where the CUDA kernels run)
    per_row = positions * kv_bytes_per_position(model, kv_bits, kv_group_size)
    per_row += ring_bytes_per_row(model, rings=False) + state_bytes_per_row(model)
    fits = int(kv_budget_bytes // max(1.0, per_row))
    return max(1, min(GPU_ROWS_CAP, fits, rows or GPU_ROWS_CAP))


def on_gpu() -> bool:
    return mx.default_device() == mx.gpu


def choose_batch_engine_rows(setting: int | str) -> int:
    """Rows at once on the batch engine (what the scheduler does not run yet): `auto` stays
    CPU_ROWS everywhere, as it has no budget to size by: its dense caches pad every row to the
    batch's longest, and nothing admits rows by memory."""
    return CPU_ROWS if setting == "auto" else int(setting)
