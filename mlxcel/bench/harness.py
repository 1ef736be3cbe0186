"""Alternate the two engines over repetitions of each case, take medians and ratios.

A case is (model, batch, prompt length). Run-to-run noise is large (~30% on a GPU, see
docs/benchmarks.md), so every repetition runs both engines back to back, in swapped order on odd
repetitions, and only medians over repetitions are compared.
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxcel.bench.checkpoints import read_model_config
from mlxcel.bench.peers import ENGINES, Peer, Run, compare_kv_bytes, format_kv_bytes, load_peer, uses_latent_attention

METRICS = {  # key -> (table label, higher is better)
    "prefill_tok_s": ("prefill tok/s", True),
    "decode_tok_s": ("decode tok/s", True),
    "ttft_ms": ("TTFT ms", False),
    "peak_gb": ("peak GB", False),
}


@dataclass
class CaseResult:
    model: str
    batch: int
    prompt_len: int
    gen: int
    runs: dict[str, list[Run]] = field(default_factory=lambda: {name: [] for name in ENGINES})
    kv_bytes: dict[str, float] | None = None  # an MLA model's KV bytes a position (peers.compare_kv_bytes)

    def medians(self, engine: str) -> dict[str, float]:
        per_run = [run.metrics() for run in self.runs[engine]]
        return {key: statistics.median(m[key] for m in per_run) for key in METRICS}

    def ratios(self) -> dict[str, float]:
        ours, theirs = self.medians("mlxcel"), self.medians("mlx-lm")
        return {key: ours[key] / theirs[key] if theirs[key] else math.nan for key in METRICS}

    def agreement(self) -> str:
        return compare_token_ids(self.runs["mlxcel"][0].token_ids, self.runs["mlx-lm"][0].token_ids)

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "batch": self.batch,
            "prompt_len": self.prompt_len,
            "gen": self.gen,
            "median": {name: self.medians(name) for name in ENGINES},
            "ratio": self.ratios(),
            "token_ids_agree": self.agreement(),
            "kv_bytes_per_position": self.kv_bytes,
            "runs": {
                name: [{**run.metrics(), "token_ids": run.token_ids} for run in runs]
                for name, runs in self.runs.items()
            },
        }


def make_prompts(batch: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Fixed pseudo-random token ids, one distinct prompt per row, all of one length (no padding
    on either side). Low ids are skipped: they are the special tokens of real vocabularies."""
    low = min(100, vocab_size // 4)
    rng = np.random.default_rng(seed)
    return rng.integers(low, vocab_size, size=(batch, length)).tolist()


def compare_token_ids(
    ours: list[list[int]], theirs: list[list[int]], names: tuple[str, str] = ("mlxcel", "mlx-lm")
) -> str:
    """'agree', or where the first row that differs first differs."""
    for row, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            position = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first = a[position] if position < len(a) else None
            second = b[position] if position < len(b) else None
            return f"row {row} differs at token {position} ({names[0]} {first}, {names[1]} {second})"
    return "agree"


def count_repeated_rows(first: list[list[int]], others: list[list[list[int]]]) -> int:
    """Rows whose token ids in `first` are the same in every run of `others`."""
    return sum(all(run[i] == ids for run in others) for i, ids in enumerate(first))


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def format_run(run: Run) -> str:
    m = run.metrics()
    return (
        f"prefill {m['prefill_tok_s']:.1f} tok/s, decode {m['decode_tok_s']:.1f} tok/s, ttft {m['ttft_ms']:.0f} ms, "
        f"peak {m['peak_gb']:.3f} GB"
    )


def warm_up(peers: dict[str, Peer], prompts: list[list[int]], gen: int) -> None:
    """Kernel JIT, allocator and first-call costs, outside every measurement."""
    for peer in peers.values():
        peer.generate(prompts, gen)


def bench_model(
    label: str,
    folder: Path,
    prompt_lengths: list[int],
    batch_sizes: list[int],
    gen: int,
    reps: int,
    dtype: mx.Dtype,
    warm_each_case: bool,
) -> list[CaseResult]:
    """Load both engines on one folder and measure every (batch, prompt length) case.

    A warm-up at a short prompt covers the CPU, where nothing compiles per shape; on a GPU
    `warm_each_case` adds one unmeasured run per case, since kernels are built per shape there."""
    config = read_model_config(folder)
    vocab_size = config["vocab_size"]
    peers = {name: load_peer(name, folder, dtype) for name in ENGINES}
    kv_bytes = None
    if uses_latent_attention(config):  # what the latent saves: mlxcel's pool against mlx-lm's cache
        kv_bytes = compare_kv_bytes({name: peer.model for name, peer in peers.items()})
        log(format_kv_bytes(label, kv_bytes))
    for batch in sorted({1, max(batch_sizes)}):
        warm_up(peers, make_prompts(batch, 16, vocab_size), 4)
    results = []
    for batch in batch_sizes:
        for prompt_len in prompt_lengths:
            if warm_each_case:
                warm_up(peers, make_prompts(batch, prompt_len, vocab_size, seed=1), min(gen, 8))
            results.append(measure_case(peers, label, batch, prompt_len, gen, reps, vocab_size))
            results[-1].kv_bytes = kv_bytes
    del peers
    mx.clear_cache()
    return results


def measure_case(
    peers: dict[str, Peer], model: str, batch: int, prompt_len: int, gen: int, reps: int, vocab_size: int
) -> CaseResult:
    result = CaseResult(model, batch, prompt_len, gen)
    prompts = make_prompts(batch, prompt_len, vocab_size)
    for rep in range(reps):
        order = ENGINES if rep % 2 == 0 else ENGINES[::-1]
        for name in order:
            run = peers[name].generate(prompts, gen)
            result.runs[name].append(run)
            log(f"{model} batch {batch} prompt {prompt_len} rep {rep + 1}/{reps} {name}: {format_run(run)}")
    return result


def align_columns(lines: list[tuple], text_columns: int) -> list[str]:
    """A table's lines (the first the header) as aligned text: the first `text_columns` columns
    left-aligned, the figures right-aligned, a rule under the header."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = [
        "  ".join(cell.ljust(w) if i < text_columns else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
        for line in lines
    ]
    text.insert(1, "  ".join("-" * w for w in widths))
    return text


def explain_ratios(metrics: dict[str, tuple[str, bool | None]], note: str = "") -> str:
    """The legend under a table of mlxcel / mlx-lm ratios (metrics: key -> (label, higher is better;
    None for a count))."""
    better = ", ".join(f"{label} {'>' if up else '<'} 1" for label, up in metrics.values() if up is not None)
    return f"ratio = mlxcel / mlx-lm{note}; mlxcel is ahead where {better}"


def format_value(value: float) -> str:
    if math.isnan(value):
        return "nan"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"


def make_table_rows(results: list[CaseResult]) -> list[dict]:
    rows = []
    for case in results:
        ours, theirs, ratios = case.medians("mlxcel"), case.medians("mlx-lm"), case.ratios()
        for key, (label, _) in METRICS.items():
            rows.append(
                {
                    "model": case.model,
                    "batch": case.batch,
                    "prompt": case.prompt_len,
                    "metric": label,
                    "mlxcel": ours[key],
                    "mlx-lm": theirs[key],
                    "ratio": ratios[key],
                }
            )
    return rows


def format_table(results: list[CaseResult]) -> str:
    header = ("model", "batch", "prompt", "metric", "mlxcel", "mlx-lm", "ratio")
    lines = [header]
    for row in make_table_rows(results):
        lines.append(
            (
                row["model"],
                str(row["batch"]),
                str(row["prompt"]),
                row["metric"],
                format_value(row["mlxcel"]),
                format_value(row["mlx-lm"]),
                f"{row['ratio']:.2f}",
            )
        )
    return "\n".join([*align_columns(lines, 4), explain_ratios(METRICS, " (medians)")])


def format_agreement(results: list[CaseResult]) -> str:
    lines = [
        f"greedy token ids, {case.model} batch {case.batch} prompt {case.prompt_len}: {case.agreement()}"
        for case in results
    ]
    figures = {case.model: case.kv_bytes for case in results if case.kv_bytes}  # one line a model
    return "\n".join(lines + [format_kv_bytes(model, figure) for model, figure in figures.items()])
