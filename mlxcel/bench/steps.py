"""Where a scheduled job's time goes: python -m mlxcel.bench.steps

    python -m mlxcel.bench.steps [--model llama-3.2-1b] [--rows 256] [--context 600] [--steps 64]

Three measurements on one model (a bench checkpoint name, as in mlxcel.bench.jobs, or an HF folder):
- decode step: --rows rows whose cached lengths are uniform in [context/2, 3*context/2] (ragged),
  one token each through the paged cache, synchronized: device + host ms per step;
- prefill piece: one row's piece of 512 and of 2048 tokens on top of --context cached positions
  (and on top of --context rounded down to a multiple of paged_cache.ALIGNED_START, as the
  scheduler's pieces start);
- the scheduler: --rows rows of --context prompt tokens decoding --steps tokens each, all at once
  (runner.max_rows = --rows): ms per iteration, and the host's share of it (building steps,
  scheduling, reading draws; the rest is the host waiting on the device).
Run it with MLXCEL_PAGED_KERNEL=0 to see the plain-MLX path where the kernels run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from mlxcel.bench.__main__ import add_checkpoint_arguments, reexec_with_openblas
from mlxcel.bench.checkpoints import dtype_name, prepare_checkpoint
from mlxcel.bench.harness import log
from mlxcel.checkpoints.loader import load_model, pick_dtype
from mlxcel.engine import GenerationRequest, RowRequest
from mlxcel.engine.scheduler import BatchScheduler, uses_kernels
from mlxcel.models.paged_cache import ALIGNED_START, PageTable, count_blocks
from mlxcel.models.paged_layers import make_paged_caches
from mlxcel.sampling import Sampler

PIECES = (512, 2048)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mlxcel.bench.steps", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=None,
        help="bench checkpoint name or HF folder (default: llama-3.2-1b on a GPU, smollm2 on the CPU)",
    )
    parser.add_argument(
        "--rows", type=int, default=None, help="rows decoding at once (default: 256 on a GPU, 8 on the CPU)"
    )
    parser.add_argument("--context", type=int, default=600, help="mean cached positions per row")
    parser.add_argument("--steps", type=int, default=64, help="tokens each row decodes in the scheduler run")
    add_checkpoint_arguments(parser)
    return parser.parse_args(argv)


def fill_rows(model, lengths: np.ndarray, extra: int) -> tuple[PageTable, list]:
    """A paged cache whose slots hold `lengths` prefilled positions of random tokens (room for `extra` more)."""
    table = PageTable(
        int(count_blocks(lengths + extra).sum()), len(lengths), int(lengths.max()) + extra, *uses_kernels(model)
    )
    caches = make_paged_caches(len(model.model.layers), table)
    rng = np.random.default_rng(0)
    for slot, length in enumerate(lengths.tolist()):
        table.reserve(slot, length + extra)
        for start in range(0, length, 2048):
            size = min(2048, length - start)
            table.begin(np.array([slot]), size)
            model(mx.array(rng.integers(100, 1000, size=(1, size))), caches, logits_at=size - 1)
            table.end()
            mx.eval([c.state for c in caches])
    return table, caches


def time_decode_step(model, table: PageTable, caches: list, reps: int) -> tuple[float, float]:
    """(median ms per synchronized step, median host ms to build it)."""
    slots = np.arange(table.table.shape[0])
    tokens = mx.array(np.full((len(slots), 1), 123))
    totals, builds = [], []
    for _ in range(reps + 2):
        start = time.perf_counter()
        table.begin(slots, 1)
        logits = model(tokens, caches)[:, -1, :]
        table.end()
        built = time.perf_counter()
        mx.eval(logits.argmax(-1))
        totals.append(time.perf_counter() - start)
        builds.append(built - start)
    return 1000 * statistics.median(totals[2:]), 1000 * statistics.median(builds[2:])


def time_prefill_piece(model, context: int, size: int) -> float:
    """ms for one row's piece of `size` tokens after `context` cached positions (median of 3
    after a warm-up: each rep rewrites the same positions, so the shapes repeat)."""
    table, caches = fill_rows(model, np.array([context]), size)
    times = []
    for _ in range(4):
        table.lengths[0] = context
        start = time.perf_counter()
        table.begin(np.array([0]), size)
        model(mx.array(np.full((1, size), 123)), caches, logits_at=size - 1)
        table.end()
        mx.eval([c.state for c in caches])
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])


def run_scheduler(model, rows: int, context: int, steps: int) -> dict:
    rng = np.random.default_rng(1)
    requests = [
        RowRequest(rng.integers(100, 1000, size=context).tolist(), row_id=i, max_tokens=steps) for i in range(rows)
    ]
    scheduler = BatchScheduler(model, context + steps + 64, rows)
    scheduler.generate(GenerationRequest(requests[:2], Sampler("greedy"), max_tokens=4))  # warm-up
    start = time.perf_counter()
    state = scheduler.generate(GenerationRequest(requests, Sampler("greedy"), max_tokens=steps))
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "iterations": state.iterations,
        "decode_steps": state.decode_steps,
        "ms_per_iteration": 1000 * wall / state.iterations,
        "host_ms_per_iteration": state.host_ms_per_iteration,
        "generated": sum(len(r.token_ids) for r in state.results),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_gpu = mx.default_device() == mx.gpu
    name = args.model or ("llama-3.2-1b" if on_gpu else "smollm2")
    rows = args.rows or (256 if on_gpu else 8)
    dtype = pick_dtype(args.dtype)
    model = load_model(str(prepare_checkpoint(name, args.work_dir.expanduser(), dtype)), dtype=dtype_name(dtype)).model
    in_place, decode_kernel = uses_kernels(model)
    print(
        f"model {name} ({dtype}), {mx.default_device()}, pool writes in place: {in_place}, decode kernel: "
        f"{decode_kernel}"
    )
    lengths = np.random.default_rng(0).integers(args.context // 2, args.context * 3 // 2 + 1, size=rows)
    log(f"filling {rows} rows ({lengths.sum()} positions)")
    table, caches = fill_rows(model, lengths, 32)
    step_ms, build_ms = time_decode_step(model, table, caches, 16)
    print(
        f"decode step, {rows} rows of {args.context} positions on average: {step_ms:.2f} ms ({build_ms:.2f} ms of it "
        "building the graph)"
    )
    del table, caches
    # a piece after a multiple of ALIGNED_START (the scheduler's pieces) runs mask-free; others do not
    for context in sorted({args.context // ALIGNED_START * ALIGNED_START, args.context}):
        for size in PIECES:
            print(f"prefill piece of {size} tokens after {context}: {time_prefill_piece(model, context, size):.2f} ms")
    log(f"scheduler: {rows} rows x {args.steps} tokens")
    run = run_scheduler(model, rows, args.context, args.steps)
    print(
        f"scheduler, {rows} rows of {args.context} prompt tokens x {args.steps} tokens: {run['ms_per_iteration']:.2f} "
        "ms per iteration "
        f"({run['iterations']} iterations, {run['decode_steps']} decode steps), host work "
        f"{run['host_ms_per_iteration']:.2f} ms per iteration, "
        f"{run['generated'] / run['wall_s']:.0f} generated tok/s over {run['wall_s']:.2f} s (prefill included)"
    )
    return 0


if __name__ == "__main__":
    reexec_with_openblas(sys.argv[1:], module="mlxcel.bench.steps")
    sys.exit(main(sys.argv[1:]))
