"""A bench job and one engine's run of it: shared by bench.jobs (local) and bench.jobs_ray."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxcel.api import load_config
from mlxcel.bench.checkpoints import dtype_name
from mlxcel.config import RunConfig


@dataclass
class Job:
    prompts: list[list[int]]
    output_lengths: list[int]


@dataclass
class JobRun:
    wall_s: float
    ttft_s: list[float]  # per row, in job order
    token_ids: list[list[int]]  # per row, in job order
    peak_bytes: int = 0
    scheduler: dict | None = None  # mlxcel's own figures: occupancy, host ms per step, KV peak

    def metrics(self) -> dict[str, float]:
        generated = sum(map(len, self.token_ids))
        return {
            "generated_tokens": generated,
            "gen_tok_s": generated / self.wall_s,
            "ttft_p50_s": float(np.percentile(self.ttft_s, 50)),
            "ttft_p95_s": float(np.percentile(self.ttft_s, 95)),
            "peak_gb": self.peak_bytes / 1e9,
            "wall_s": self.wall_s,
        }

    def count_wrong_lengths(self, job: Job) -> int:
        return sum(len(ids) != n for ids, n in zip(self.token_ids, job.output_lengths))


def compose_config(
    folder: Path,
    tokenizer_dir: Path,
    dtype: mx.Dtype,
    max_rows: int,
    prompt_cache: bool = True,
    max_context: int | None = None,
    model_settings: dict | None = None,
    **runner,
) -> RunConfig:
    """Composed as mlxcel-run composes a config (conf/ defaults: greedy sampler), plus the job's settings."""
    model = {"path": str(folder), "dtype": dtype_name(dtype), **(model_settings or {})}
    return load_config(
        {
            "model": model if max_context is None else {**model, "max_context": max_context},
            "tokenizer": {"path": str(tokenizer_dir), "kind": "hf"},
            "template": {"kind": "none"},
            "decode": {"ignore_eos": True},  # each row's max_tokens is its output length
            "prompt": {"text": "unused: the rows are token ids"},
            "runner": {"max_rows": max_rows, "progress": "log", "prompt_cache": prompt_cache, **runner},
        }
    )


def format_run(run: JobRun) -> str:
    m = run.metrics()
    line = (
        f"{m['generated_tokens']} tokens in {m['wall_s']:.1f} s ({m['gen_tok_s']:.1f} tok/s), "
        f"TTFT p50 {m['ttft_p50_s']:.2f} s p95 {m['ttft_p95_s']:.2f} s, peak {m['peak_gb']:.3f} GB"
    )
    if run.scheduler:
        s = run.scheduler
        line += (
            f"; occupancy {s['occupancy']:.1f}, host {s['host_ms_per_step']:.2f} ms per step, "
            f"{s.get('forward_calls', 0)} forward calls of {s.get('call_shapes', 0)} shapes, "
            f"KV peak {s['kv_peak_gb']:.3f} GB"
        )
    return line
