"""The ragged job on Ray workers: python -m mlxcel.bench.jobs --backend ray --workers 1,2

The job of mlxcel.bench.jobs (same seed, same rows) run as `runner.backend=ray` runs it
(mlxcel.ray_jobs.run_on_ray), once per worker count, on one cluster: a local one started here, or
--address. Each worker loads the model, runs an untimed warm-up job (a full decode batch) and then
takes rows as the driver hands them out. The rows go as text ("t17 t5 ...") that the bench's
word-level tokenizer reads back as the job's token ids; every row's prompt ids are checked.

Measured per worker count, from the first row handed out to the last worker closed: wall time,
generated tok/s, p50/p95 TTFT (a row's first token on the driver's clock: when the row came back
less its own first-token-to-end time), and per worker: rows, tokens, busy time, occupancy (rows
decoding per step) and peak memory. Then the scaling over the first count, and whether every row
drew the same token ids at every count. For one thread per worker on the CPU, start the bench with
OPENBLAS_NUM_THREADS=1 (the workers inherit it, docs/scaleout.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mlxcel.bench.harness import align_columns, count_repeated_rows, log
from mlxcel.bench.job_runs import JobRun, compose_config, format_run
from mlxcel.jobs import JobRow, Sample
from mlxcel.progress import Progress


@dataclass
class RayRun:
    workers: int
    run: JobRun  # the job as the driver saw it; peak_bytes: the largest worker's peak
    figures: list[dict]  # each worker's, as stats.json's ray.workers lists them

    def metrics(self) -> dict[str, float]:
        return self.run.metrics()

    def to_dict(self) -> dict:
        return {
            "workers": self.workers,
            "metrics": self.metrics(),
            "ttft_s": self.run.ttft_s,
            "worker_figures": self.figures,
        }


def make_samples(prompts: list[list[int]], output_lengths: list[int], prefix: str = "") -> list[Sample]:
    """The rows as text the word-level tokenizer (jobs.prepare_tokenizer) encodes back to these ids."""
    return [
        Sample(
            JobRow(
                id=f"{prefix}{i}", messages=[{"role": "user", "content": " ".join(f"t{t}" for t in ids)}], max_tokens=n
            )
        )
        for i, (ids, n) in enumerate(zip(prompts, output_lengths))
    ]


def run_workers(cfg, job, warm_up) -> RayRun:
    """One run of the job on cfg.runner.ray.workers workers."""
    from mlxcel.ray_jobs import run_on_ray

    came_back: dict[str, tuple[float, dict]] = {}

    def record(row: dict) -> None:
        came_back[row["id"]] = (time.perf_counter(), row)

    samples = make_samples(job.prompts, job.output_lengths)
    progress = Progress(len(samples), "log", sys.stderr)
    try:
        _, section = run_on_ray(cfg, samples, record, progress, sys.stderr, warm_up=warm_up)
    finally:
        progress.close()
    ended = time.perf_counter()
    start = ended - section["wall_s"]  # (the driver's clock when the first rows went out)
    rows = [came_back[s.row.id] for s in samples]
    errors = [row for _, row in rows if row["finish_reason"] == "error"]
    if errors:
        raise SystemExit(f"bench: {len(errors)} rows ended with an error, the first: {errors[0].get('error')}")
    misread = [i for i, (_, row) in enumerate(rows) if row["prompt_token_ids"] != job.prompts[i]]
    if misread:
        raise RuntimeError(f"the word-level tokenizer did not read row {misread[0]}'s prompt back as its ids")
    ttft = [at - (row["latency_ms"] - row["ttft_ms"]) / 1000 - start for at, row in rows]
    peak_bytes = int(max(f.get("peak_memory_gb", 0.0) for f in section["workers"]) * 1e9)
    run = JobRun(section["wall_s"], ttft, [row["token_ids"] for _, row in rows], peak_bytes)
    return RayRun(cfg.runner.ray.workers, run, section["workers"])


def bench_ray(
    label: str, folder: Path, tokenizer_dir: Path, args: argparse.Namespace, dtype, job, warm_up_job
) -> list[RayRun]:
    """The job at each of args.workers counts, on one cluster."""
    from mlxcel.ray_jobs import connect, import_ray

    ray = import_ray()
    runs = []
    started_here = False
    try:
        for count in args.workers:
            settings = {
                "address": args.address,
                "workers": count,
                "cpus_per_worker": args.cpus_per_worker,
                "gpus_per_worker": args.gpus_per_worker,
            }
            cfg = compose_config(
                folder,
                tokenizer_dir,
                dtype,
                args.max_rows,
                not args.no_prompt_cache,
                args.max_context,
                backend="ray",
                ray=settings,
            )
            started_here = connect(ray, cfg.runner.ray, sys.stderr) or started_here
            warm_up = make_samples(warm_up_job.prompts, warm_up_job.output_lengths, prefix="warm-up-")
            runs.append(run_workers(cfg, job, warm_up))
            log(f"{label} ray, {count} worker(s): {format_run(runs[-1].run)}")
    finally:
        if started_here:
            ray.shutdown()
    return runs


def format_ray_table(label: str, runs: list[RayRun]) -> str:
    base = runs[0].metrics()["gen_tok_s"]
    lines = [
        ("model", "workers", "wall s", "gen tok/s", f"vs {runs[0].workers}", "TTFT p50 s", "TTFT p95 s", "peak GB")
    ]
    for run in runs:
        m = run.metrics()
        lines.append(
            (
                label,
                str(run.workers),
                f"{m['wall_s']:.1f}",
                f"{m['gen_tok_s']:.1f}",
                f"{m['gen_tok_s'] / base:.2f}",
                f"{m['ttft_p50_s']:.2f}",
                f"{m['ttft_p95_s']:.2f}",
                f"{m['peak_gb']:.3f}",
            )
        )
    workers = [
        (
            "workers",
            "worker",
            "node",
            "device",
            "rows",
            "tokens",
            "busy s",
            "tok/s",
            "occupancy",
            "host ms/step",
            "peak GB",
        )
    ]
    for run in runs:
        for f in run.figures:
            workers.append(
                (
                    str(run.workers),
                    f["name"],
                    f["node"],
                    f["device"],
                    str(f.get("rows", 0)),
                    str(f.get("generated_tokens", 0)),
                    f"{f.get('busy_s', 0.0):.1f}",
                    f"{f.get('generated_tok_per_sec', 0.0):.1f}",
                    f"{f.get('occupancy', 0.0):.2f}",
                    f"{f.get('host_ms_per_step', 0.0):.2f}",
                    f"{f.get('peak_memory_gb', 0.0):.3f}",
                )
            )
    return "\n".join([*align_columns(lines, 2), "", *align_columns(workers, 2)])


def describe_agreement(label: str, runs: list[RayRun]) -> str:
    first = runs[0].run.token_ids
    same = count_repeated_rows(first, [r.run.token_ids for r in runs[1:]])
    counts = ", ".join(str(r.workers) for r in runs)
    return f"{label} token ids: {same}/{len(first)} rows the same with {counts} worker(s)"
