"""A ragged batch job through mlxcel's job path and mlx-lm's BatchGenerator: python -m mlxcel.bench.jobs

    python -m mlxcel.bench.jobs [--models llama-3.2-1b,qwen2.5-0.5b] [--rows 512] [--prompt-tokens 32,1024]
                                [--output-tokens 16,512] [--max-rows 32] [--seed 0] [--engines mlxcel,mlx-lm]
                                [--json OUT.json]

The job: --rows rows drawn from --seed, each a prompt of random token ids (length uniform in
--prompt-tokens; low ids and the config's bos/eos/pad ids left out) with its own output length
(uniform in --output-tokens), decoded greedily with no EOS stop, so every row generates exactly
its output length. Both engines load the same HF folder in one process and run the job one after
the other, in --engines order, each after an unmeasured warm-up job; at most --max-rows rows
decode at once:

- mlxcel: the runner's job loop (`mlxcel.runner.run_job`, what `mlxcel-run prompt=jsonl` runs per
  job) with runner.max_rows = --max-rows, fed token ids instead of text, writing no run folder.
  The bench checkpoints carry no tokenizer, so a word-level one over the whole id space stands in
  (every token is still detokenized, as in a real job).
- mlx-lm: `BatchGenerator` (continuous batching), every row inserted at once with its own
  max_tokens, completion batch size --max-rows, prefill batch size min(8, --max-rows).

Measured per engine over the whole job, prefill included: wall time, generated tokens and tok/s
over the wall time, p50/p95 TTFT (job start to each row's first token on the host), peak memory
(the engine's weights + what the job allocated), and how many rows both engines decoded to the
same token ids. The table and ratios (mlxcel / mlx-lm) go to stdout, progress to stderr.
Defaults depend on the device: Llama-3.2-1B and Qwen2.5-0.5B shapes and 512 rows on a GPU,
SmolLM2 (135M) and 48 rows on a CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxcel.bench.__main__ import (
    add_checkpoint_arguments,
    describe_environment,
    parse_ints,
    reexec_with_openblas,
    split_models,
)
from mlxcel.bench.checkpoints import CHECKPOINT_NAMES, prepare_checkpoint, read_model_config
from mlxcel.bench.harness import (
    align_columns,
    compare_token_ids,
    count_repeated_rows,
    explain_ratios,
    format_value,
    log,
)
from mlxcel.bench.job_runs import Job, JobRun, compose_config, format_run
from mlxcel.bench.peers import (
    ENGINES,
    check_peer_dtype,
    compare_kv_bytes,
    count_weight_bytes,
    format_kv_bytes,
    load_peer,
    synchronize_streams,
    uses_latent_attention,
)
from mlxcel.checkpoints.loader import pick_dtype
from mlxcel.errors import MlxcelError
from mlxcel.jobs import JobRow, Sample
from mlxcel.pipeline import Pipeline, PreparedSample
from mlxcel.runner import run_job
from mlxcel.template import PromptTokens

# (models, rows, prompt tokens, output tokens, max rows). Max rows: mlx-lm's default completion
# batch on a GPU, mlxcel's default runner.max_rows on the CPU. The CPU set takes ~2.5 minutes on a
# 2-core x86_64 VM with OpenBLAS (the batch engine, 346db3b: ~75 s mlxcel, ~60 s mlx-lm).
GPU_DEFAULTS = (["llama-3.2-1b", "qwen2.5-0.5b"], 512, (32, 1024), (16, 512), 32)
CPU_DEFAULTS = (["smollm2"], 48, (16, 256), (8, 64), 8)
WARM_UP_OUTPUT = 4
MLX_LM_PREFILL_BATCH = 8  # BatchGenerator's default prefill_batch_size

METRICS = {  # key -> (table label, higher is better; None: a count, not a speed)
    "generated_tokens": ("generated tokens", None),
    "gen_tok_s": ("gen tok/s", True),
    "ttft_p50_s": ("TTFT p50 s", False),
    "ttft_p95_s": ("TTFT p95 s", False),
    "peak_gb": ("peak GB", False),
    "wall_s": ("wall s", False),
}


@dataclass
class ModelResult:
    model: str
    job: Job
    runs: dict[str, JobRun]
    uniform: JobRun | None = None  # mlxcel on the rows at their mean lengths (--uniform)
    reruns: list[JobRun] | None = None  # mlxcel's job run again (--reruns): the same token ids?
    ray: list | None = None  # --backend ray: a jobs_ray.RayRun per worker count
    # --batch-invariant: mlxcel with runner.batch_invariant=true at invariant_rows (--max-rows, then a third of it)
    invariant: list[JobRun] | None = None
    invariant_rows: list[int] | None = None
    kv_bytes: dict[str, float] | None = None  # an MLA model's KV bytes a position (peers.compare_kv_bytes)

    @property
    def has_both(self) -> bool:
        return set(self.runs) == set(ENGINES)

    def ratios(self) -> dict[str, float] | None:
        if not self.has_both:
            return None
        ours, theirs = self.runs["mlxcel"].metrics(), self.runs["mlx-lm"].metrics()
        return {key: ours[key] / theirs[key] if theirs[key] else math.nan for key in METRICS}

    def count_agreeing_rows(self) -> int:
        return sum(a == b for a, b in zip(self.runs["mlxcel"].token_ids, self.runs["mlx-lm"].token_ids))

    def find_first_difference(self) -> str:
        return compare_token_ids(self.runs["mlxcel"].token_ids, self.runs["mlx-lm"].token_ids)

    def describe_checks(self) -> list[str]:
        lines = [
            f"{self.model} {name}: {run.count_wrong_lengths(self.job)} rows off their output length"
            for name, run in self.runs.items()
        ]
        if self.uniform is not None:
            ragged, uniform = self.runs["mlxcel"].peak_bytes, self.uniform.peak_bytes
            lines.append(
                f"{self.model} mlxcel peak memory, ragged / uniform at the mean lengths: {ragged / 1e9:.3f} / "
                f"{uniform / 1e9:.3f} GB = {ragged / uniform:.2f}"
            )
        if self.reruns:
            lines.append(self.describe_reruns())
        if self.invariant:
            lines += self.describe_invariant()
        if self.ray:
            from mlxcel.bench.jobs_ray import describe_agreement

            lines += [
                f"{self.model} ray, {run.workers} worker(s): {run.run.count_wrong_lengths(self.job)} rows off their "
                "output length"
                for run in self.ray
            ]
            lines.append(describe_agreement(self.model, self.ray))
        if self.kv_bytes:
            lines.append(format_kv_bytes(self.model, self.kv_bytes))
        if self.has_both:
            first = self.find_first_difference()
            detail = "" if first == "agree" else f"; first: {first}"
            lines.append(
                f"{self.model} greedy token ids: {self.count_agreeing_rows()}/{len(self.job.prompts)} rows "
                f"agree{detail}"
            )
        return lines

    def describe_reruns(self) -> str:
        first = self.runs["mlxcel"].token_ids
        same = count_repeated_rows(first, [run.token_ids for run in self.reruns])
        differences = [compare_token_ids(first, run.token_ids, ("first run", "rerun")) for run in self.reruns]
        detail = "".join(f"; rerun {k + 1}: {d}" for k, d in enumerate(differences) if d != "agree")
        return (
            f"{self.model} mlxcel reruns: {same}/{len(first)} rows drew the same token ids in all "
            f"{len(self.reruns) + 1} runs{detail}"
        )

    def describe_invariant(self) -> list[str]:
        """The mode's cost (the default mode's wall time over its own) and its check: the job at
        two max_rows gives every row the same token ids."""
        default, (first, *others) = self.runs["mlxcel"], self.invariant
        ours, theirs = first.metrics(), default.metrics()
        lines = [
            f"{self.model} mlxcel batch-invariant, max_rows {self.invariant_rows[0]}: {format_run(first)}; "
            f"{ours['wall_s'] / theirs['wall_s']:.2f}x the default mode's wall time "
            f"({ours['gen_tok_s'] / theirs['gen_tok_s']:.2f}x its tok/s); "
            f"{count_repeated_rows(default.token_ids, [first.token_ids])}/{len(first.token_ids)} rows have the "
            "default mode's token ids"
        ]
        for rows, run in zip(self.invariant_rows[1:], others):
            same = count_repeated_rows(first.token_ids, [run.token_ids])
            detail = compare_token_ids(
                first.token_ids, run.token_ids, (f"max_rows {self.invariant_rows[0]}", f"{rows}")
            )
            lines.append(
                f"{self.model} mlxcel batch-invariant, max_rows {rows}: {same}/{len(first.token_ids)} rows drew the "
                f"token ids they drew at max_rows {self.invariant_rows[0]}"
                + ("" if detail == "agree" else f"; {detail}")
            )
        return lines

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "metrics": {name: run.metrics() for name, run in self.runs.items()},
            "ratio": self.ratios(),
            "rows_agree": self.count_agreeing_rows() if self.has_both else None,
            "token_ids_agree": self.find_first_difference() if self.has_both else None,
            "rows": {
                name: {"ttft_s": run.ttft_s, "generated_tokens": list(map(len, run.token_ids))}
                for name, run in self.runs.items()
            },
            "scheduler": self.runs["mlxcel"].scheduler if "mlxcel" in self.runs else None,
            "kv_bytes_per_position": self.kv_bytes,
            "uniform": None
            if self.uniform is None
            else {**self.uniform.metrics(), "scheduler": self.uniform.scheduler},
            "ray": None if self.ray is None else [run.to_dict() for run in self.ray],
            "reruns": None if not self.reruns else self.describe_reruns(),
            "batch_invariant": None
            if not self.invariant
            else {
                "max_rows": self.invariant_rows,
                "metrics": [run.metrics() for run in self.invariant],
                "scheduler": [run.scheduler for run in self.invariant],
                "checks": self.describe_invariant(),
            },
        }


def parse_range(text: str) -> tuple[int, int]:
    values = parse_ints(text)
    if len(values) != 2 or values[0] > values[1]:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with 0 < MIN <= MAX (got {text!r})")
    return values[0], values[1]


def parse_engines(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or not set(names) <= set(ENGINES) or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected some of {','.join(ENGINES)}, comma-separated (got {text!r})")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mlxcel.bench.jobs", description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated: {', '.join(CHECKPOINT_NAMES)}, or HF model folders")
    parser.add_argument("--rows", type=int, help="rows in the job")
    parser.add_argument("--prompt-tokens", type=parse_range, help="MIN,MAX prompt tokens per row (uniform)")
    parser.add_argument("--output-tokens", type=parse_range, help="MIN,MAX generated tokens per row (uniform)")
    parser.add_argument(
        "--max-rows", type=int, help="rows decoding at once: mlxcel's runner.max_rows, mlx-lm's completion batch size"
    )
    parser.add_argument("--seed", type=int, default=0, help="draws the rows' lengths and token ids")
    parser.add_argument("--engines", type=parse_engines, help="comma-separated, run in this order (default: both)")
    parser.add_argument("--json", type=Path, help="also write the job, every engine's metrics and per-row TTFTs here")
    parser.add_argument(
        "--uniform",
        action="store_true",
        help=(
            "also run mlxcel on the same rows at their mean lengths (same ids, max rows) and print the ragged job's "
            "peak memory against it"
        ),
    )
    parser.add_argument(
        "--reruns",
        type=int,
        default=0,
        help="run mlxcel's job this many more times and count the rows whose token ids repeat exactly",
    )
    parser.add_argument(
        "--no-prompt-cache",
        action="store_true",
        help="mlxcel with runner.prompt_cache=false (the job's rows share no prefix: what the cache costs)",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help=(
            "also run mlxcel with runner.batch_invariant=true, at --max-rows and at a third of it: its cost against "
            "the default mode, and whether every row drew the same token ids at both"
        ),
    )
    ray = parser.add_argument_group("on Ray workers (mlxcel.bench.jobs_ray; needs the ray extra)")
    ray.add_argument(
        "--backend", choices=("local", "ray"), default="local", help="ray: mlxcel's runner.backend=ray, no mlx-lm"
    )
    ray.add_argument("--workers", type=parse_ints, default=[1], help="worker counts, comma-separated, each run in turn")
    ray.add_argument("--address", help="a running cluster's address (default: start a local one)")
    ray.add_argument(
        "--max-context",
        type=int,
        help="model.max_context (default: the checkpoint's); a worker's KV pool holds max-rows rows of it",
    )
    ray.add_argument("--cpus-per-worker", type=float, default=1.0, help="runner.ray.cpus_per_worker")
    ray.add_argument(
        "--gpus-per-worker", type=float, help="runner.ray.gpus_per_worker (default: 1 where MLX has a GPU, else 0)"
    )
    add_checkpoint_arguments(parser)
    args = parser.parse_args(argv)
    if args.backend == "ray":
        if args.engines and "mlx-lm" in args.engines:
            parser.error("--backend ray runs mlxcel only: mlx-lm has no Ray path (drop --engines or give mlxcel)")
        args.engines = ["mlxcel"]
        if args.gpus_per_worker is None:
            args.gpus_per_worker = 1.0 if mx.default_device() == mx.gpu else 0.0
    args.engines = args.engines or list(ENGINES)
    models, rows, prompt_tokens, output_tokens, max_rows = (
        GPU_DEFAULTS if mx.default_device() == mx.gpu else CPU_DEFAULTS
    )
    args.models = split_models(args.models, models)
    args.rows = args.rows or rows
    args.prompt_tokens = args.prompt_tokens or prompt_tokens
    args.output_tokens = args.output_tokens or output_tokens
    args.max_rows = args.max_rows or max_rows
    if args.rows < 1 or args.max_rows < 1:
        parser.error("--rows and --max-rows must be >= 1")
    return args


def read_special_ids(config: dict) -> list[int]:
    ids = []
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        ids += [value] if isinstance(value, int) else value or []
    return ids


def draw_job(
    rows: int,
    prompt_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    vocab_size: int,
    special_ids: list[int],
    seed: int,
) -> Job:
    """Lengths first, then ids: one seed gives every model the same lengths. Low ids are left out,
    as harness.make_prompts does: they are the special tokens of real vocabularies."""
    rng = np.random.default_rng(seed)
    prompt_lengths = rng.integers(prompt_tokens[0], prompt_tokens[1] + 1, size=rows)
    output_lengths = rng.integers(output_tokens[0], output_tokens[1] + 1, size=rows)
    allowed = np.setdiff1d(np.arange(min(100, vocab_size // 4), vocab_size), special_ids)
    return Job([rng.choice(allowed, size=n).tolist() for n in prompt_lengths], output_lengths.tolist())


def prepare_tokenizer(vocab_size: int, work_dir: Path) -> Path:
    """A word-level tokenizer.json over ids 0..vocab_size-1 ("t0", "t1", ...), built once."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = work_dir / f"tokenizer-wordlevel-{vocab_size}"
    if (folder / "tokenizer.json").exists():
        return folder
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    partial_file = folder / "tokenizer.json.partial"  # renamed when whole: an interrupted build is never reused
    tokenizer.save(str(partial_file))
    partial_file.rename(folder / "tokenizer.json")
    return folder


class TokenIdPipeline(Pipeline):
    """The runner's pipeline fed token ids, each row's first token time-stamped on the host.

    run_job calls `prepare` once, then `generate` per group of rows (Pipeline.group_rows): the
    whole job for the scheduler, runner.max_rows rows at a time for the batch engine, which runs
    each group to its longest row. If the runner stops handing tokens out through `generate`,
    move the stamp there; run_mlxcel fails loudly when rows go unstamped."""

    def start_job(self, prompts: list[list[int]]) -> None:
        self.prompts = prompts
        self.first_token_at: dict[int, float] = {}

    def prepare(self, samples: list[Sample]) -> list[PreparedSample]:
        return [PreparedSample(s, PromptTokens("", self.prompts[s.row.id], history_tokens=0)) for s in samples]

    def generate(self, batch: list[PreparedSample], on_token, on_row_done=None):
        def stamp(row: int, token: int) -> bool:
            row_id = batch[row].sample.row.id
            if row_id not in self.first_token_at:
                self.first_token_at[row_id] = time.perf_counter()
            return on_token(row, token)

        return super().generate(batch, stamp, on_row_done)


class DiscardedOutputs:
    """run_job's RunOutputs without the disk: an fsync'd line per row is the file system's cost,
    not the engine's (mlx-lm writes nothing). The rows come back in RunResult.generations."""

    dir = None

    def append_generation(self, row: dict) -> None:
        pass

    def write_stats(self, stats: dict) -> None:
        pass


def load_mlxcel(
    folder: Path, tokenizer_dir: Path, dtype: mx.Dtype, max_rows: int, prompt_cache: bool = True, **runner
) -> TokenIdPipeline:
    return TokenIdPipeline.load(compose_config(folder, tokenizer_dir, dtype, max_rows, prompt_cache, **runner))


def run_mlxcel(pipeline: TokenIdPipeline, job: Job, adapters: list[str | None] | None = None) -> JobRun:
    """`adapters`: each row's adapter name (model.adapters'), None for the base model."""
    adapters = adapters or [None] * len(job.prompts)
    samples = [
        Sample(JobRow(id=i, messages=[], max_tokens=n, adapter=a))
        for i, (n, a) in enumerate(zip(job.output_lengths, adapters))
    ]
    pipeline.start_job(job.prompts)
    start = time.perf_counter()
    result = run_job(pipeline, samples, set(), DiscardedOutputs(), {}, stream=None, log=None)
    wall = time.perf_counter() - start
    errors = [row for row in result.generations if row.get("finish_reason") == "error"]
    if errors:  # e.g. prompts longer than the model's context: the bench needs every row
        raise SystemExit(
            f"bench: {len(errors)} of {len(samples)} rows ended with an error, the first: {errors[0].get('error')}; "
            "pick --prompt-tokens/--output-tokens that fit the model's context"
        )
    if len(pipeline.first_token_at) != len(samples):
        raise RuntimeError(
            "TokenIdPipeline.generate saw no tokens of some rows: the runner no longer calls it; move its stamp"
        )
    tokens = {row["id"]: row["token_ids"] for row in result.generations}
    stats = result.stats
    scheduler = (
        None
        if stats is None
        else {
            "occupancy": stats.occupancy,
            "host_ms_per_step": stats.host_ms_per_step,
            "forward_calls": stats.forward_calls,
            "call_shapes": stats.call_shapes,
            "kv_peak_gb": stats.kv_peak_gb,
            "prompt_cache": stats.prompt_cache,
        }
    )
    return JobRun(
        wall,
        [pipeline.first_token_at[i] - start for i in range(len(samples))],
        [tokens[i] for i in range(len(samples))],
        scheduler=scheduler,
    )


def run_mlx_lm(model, job: Job, max_rows: int) -> JobRun:
    from mlx_lm.generate import BatchGenerator

    # mlx-lm's own prefill batch, but never above the decode batch (BatchGenerator would raise that instead)
    generator = BatchGenerator(
        model, completion_batch_size=max_rows, prefill_batch_size=min(MLX_LM_PREFILL_BATCH, max_rows)
    )
    try:
        start = time.perf_counter()
        uids = generator.insert(job.prompts, job.output_lengths)
        tokens: dict[int, list[int]] = {uid: [] for uid in uids}
        first: dict[int, float] = {}
        while responses := generator.next_generated():
            now = time.perf_counter()
            for response in responses:
                first.setdefault(response.uid, now)
                tokens[response.uid].append(response.token)
        wall = time.perf_counter() - start
    finally:
        generator.close()
    return JobRun(wall, [first[uid] - start for uid in uids], [tokens[uid] for uid in uids])


def load_engine(
    name: str, folder: Path, tokenizer_dir: Path, dtype: mx.Dtype, max_rows: int, prompt_cache: bool = True
) -> tuple[Callable[[Job], JobRun], int, object]:
    """The engine's job runner, its weight bytes and its model."""
    if name == "mlxcel":
        pipeline = load_mlxcel(folder, tokenizer_dir, dtype, max_rows, prompt_cache)
        model = pipeline.loaded.model
        return partial(run_mlxcel, pipeline), count_weight_bytes(model), model
    peer = load_peer(name, folder, dtype)
    return partial(run_mlx_lm, peer.model, max_rows=max_rows), peer.weight_bytes, peer.model


def measure(run: Callable[[Job], JobRun], job: Job, weight_bytes: int) -> JobRun:
    """Peak memory as Peer.generate counts it: both engines' weights are resident, so this
    engine's weights plus what its job allocated on top of them."""
    synchronize_streams()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    job_run = run(job)
    synchronize_streams()  # mlx-lm queues a step ahead: that work must not overlap the next engine
    job_run.peak_bytes = mx.get_peak_memory() - base + weight_bytes
    return job_run


def bench_model(label: str, folder: Path, args: argparse.Namespace, dtype: mx.Dtype, work_dir: Path) -> ModelResult:
    config = read_model_config(folder)
    vocab_size, special_ids = config["vocab_size"], read_special_ids(config)
    tokenizer_dir = prepare_tokenizer(vocab_size, work_dir)
    job = draw_job(args.rows, args.prompt_tokens, args.output_tokens, vocab_size, special_ids, args.seed)
    # JIT, allocator and first-call costs; a full decode batch, so a GPU traces that batch size here
    warm_up = draw_job(
        args.max_rows, (args.prompt_tokens[0],) * 2, (WARM_UP_OUTPUT,) * 2, vocab_size, special_ids, args.seed + 1
    )
    if args.backend == "ray":
        from mlxcel.bench.jobs_ray import bench_ray

        return ModelResult(label, job, {}, ray=bench_ray(label, folder, tokenizer_dir, args, dtype, job, warm_up))
    engines = {
        name: load_engine(name, folder, tokenizer_dir, dtype, args.max_rows, not args.no_prompt_cache)
        for name in args.engines
    }
    kv_bytes = None
    if uses_latent_attention(config):  # what the latent saves: mlxcel's pool against mlx-lm's cache
        kv_bytes = compare_kv_bytes({name: model for name, (_, _, model) in engines.items()})
        log(format_kv_bytes(label, kv_bytes))
    for run, _, _ in engines.values():
        run(warm_up)
    runs = {}
    for name, (run, weight_bytes, _) in engines.items():
        runs[name] = measure(run, job, weight_bytes)
        log(f"{label} {name}: {format_run(runs[name])}")
    result = ModelResult(label, job, runs, kv_bytes=kv_bytes)
    if args.reruns and "mlxcel" in engines:
        run, weight_bytes, _ = engines["mlxcel"]
        result.reruns = [measure(run, job, weight_bytes) for _ in range(args.reruns)]
        log(f"{label} mlxcel: {result.describe_reruns()}")
    if args.batch_invariant and "mlxcel" in engines:
        result.invariant_rows = [args.max_rows, max(1, args.max_rows // 3)]
        result.invariant = []
        for rows in result.invariant_rows:
            pipeline = load_mlxcel(folder, tokenizer_dir, dtype, rows, not args.no_prompt_cache, batch_invariant=True)
            run_mlxcel(pipeline, warm_up)
            result.invariant.append(measure(partial(run_mlxcel, pipeline), job, engines["mlxcel"][1]))
            log(f"{label} mlxcel batch-invariant, max_rows {rows}: {format_run(result.invariant[-1])}")
            del pipeline
        log("\n".join(result.describe_invariant()))
    if args.uniform and "mlxcel" in engines:
        run, weight_bytes, _ = engines["mlxcel"]
        result.uniform = measure(run, make_uniform(job), weight_bytes)
        log(f"{label} mlxcel, uniform: {format_run(result.uniform)}")
    return result


def make_uniform(job: Job) -> Job:
    """The job's rows cut or extended (with their own ids, cycled) to the mean prompt and output
    lengths: the uniform job a ragged one's memory is judged against."""
    prompt = round(float(np.mean([len(p) for p in job.prompts])))
    output = round(float(np.mean(job.output_lengths)))
    return Job([(p * -(-prompt // len(p)))[:prompt] for p in job.prompts], [output] * len(job.prompts))


def describe_job(args: argparse.Namespace, job: Job) -> dict:
    return {
        "rows": args.rows,
        "prompt_tokens": list(args.prompt_tokens),
        "output_tokens": list(args.output_tokens),
        "max_rows": args.max_rows,
        "seed": args.seed,
        "engines": args.engines,
        "prompt_tokens_total": sum(map(len, job.prompts)),
        "output_tokens_total": sum(job.output_lengths),
        "prompt_lengths": list(map(len, job.prompts)),
        "output_lengths": job.output_lengths,
    }


def format_job(job: dict) -> str:
    return (
        f"job: {job['rows']} rows (seed {job['seed']}), prompts {job['prompt_tokens'][0]}-{job['prompt_tokens'][1]} "
        "tokens "
        f"({job['prompt_tokens_total']} in all), outputs {job['output_tokens'][0]}-{job['output_tokens'][1]} tokens "
        f"({job['output_tokens_total']} in all); greedy, no EOS stop; at most {job['max_rows']} rows decoding at once"
    )


def format_table(results: list[ModelResult]) -> str:
    if any(result.ray for result in results):
        from mlxcel.bench.jobs_ray import format_ray_table

        return "\n\n".join(format_ray_table(result.model, result.ray) for result in results)
    header = ("model", "metric", *ENGINES, "ratio")
    lines = [header]
    for result in results:
        metrics = {name: run.metrics() for name, run in result.runs.items()}
        ratios = result.ratios()
        for key, (label, _) in METRICS.items():
            values = [format_metric(metrics[name][key]) if name in metrics else "-" for name in ENGINES]
            lines.append((result.model, label, *values, f"{ratios[key]:.2f}" if ratios else "-"))
    return "\n".join([*align_columns(lines, 2), explain_ratios(METRICS)])


def format_metric(value: float) -> str:
    return str(value) if isinstance(value, int) else format_value(value)


def name_model(name: str) -> str:
    return name if name in CHECKPOINT_NAMES else Path(name).name


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "mlx-lm" in args.engines and importlib.util.find_spec("mlx_lm") is None:
        print(
            "mlxcel.bench.jobs: mlx-lm (the benchmark peer) is not installed: pip install -e '.[bench]', or --engines "
            "mlxcel",
            file=sys.stderr,
        )
        return 2
    dtype = pick_dtype(args.dtype)
    env = {**describe_environment(dtype, peer="mlx-lm" in args.engines), "platform": platform.platform(terse=True)}
    log(" | ".join(f"{k} {v}" for k, v in env.items()))
    work_dir = args.work_dir.expanduser()
    results = []
    for name in args.models:
        start = time.perf_counter()
        try:
            folder = prepare_checkpoint(name, work_dir, dtype)
            if "mlx-lm" in args.engines:
                check_peer_dtype(read_model_config(folder), dtype)
        except (MlxcelError, ValueError) as exc:  # a missing package or a wrong path: one line, no traceback
            print(f"mlxcel.bench.jobs: {name}: {exc}", file=sys.stderr)
            return 1
        log(f"{name}: checkpoint {folder} ready in {time.perf_counter() - start:.1f} s")
        results.append(bench_model(name_model(name), folder, args, dtype, work_dir))
    job = describe_job(args, results[0].job)  # the lengths are the same for every model
    print(" | ".join(f"{k} {v}" for k, v in env.items()))
    print(format_job(job))
    print(format_table(results))
    print("\n".join(line for result in results for line in result.describe_checks()))
    if args.json:
        args.json.write_text(
            json.dumps({"environment": env, "job": job, "models": [r.to_dict() for r in results]}, indent=1)
        )
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    reexec_with_openblas(sys.argv[1:], module="mlxcel.bench.jobs")
    sys.exit(main(sys.argv[1:]))
