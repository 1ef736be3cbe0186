"""The prompt cache's benchmark: python -m mlxcel.bench.prefix

    python -m mlxcel.bench.prefix [--models llama-3.2-1b] [--rows 256] [--prefix-tokens 1500]
                                  [--question-tokens 20,40] [--output-tokens 16] [--max-rows 32]
                                  [--chat-history 2000] [--chat-new 50] [--reps 3] [--engines mlxcel,mlx-lm]

A shared-prefix job: --rows rows that start with the same --prefix-tokens random token ids and
end with a question of their own (length uniform in --question-tokens), each generating
--output-tokens tokens greedily with no EOS stop. It runs through mlxcel's job path (as
bench.jobs does) with the prompt cache off, then on (emptied before the run), and through mlx-lm's
BatchGenerator for reference, all in one process on the same BLAS, each after an unmeasured
warm-up job of the same shape. Reported per run: wall time, prompt tokens computed, generated
tok/s over the wall time, TTFT p50/p95, and whether the cache-on rows' token ids equal the
cache-off rows'.

Then a chat turn: a --chat-history token conversation is answered (--output-tokens), then a turn
of --chat-new new tokens follows it (the history, the answer, the new tokens). Its TTFT with the
cache (the history and answer adopted) is set against a fresh --chat-new token prompt's and the
same turn's without the cache; medians of --reps, each case warmed up once at its shapes.
Defaults: Llama-3.2-1B shape and 256 rows on a GPU, SmolLM2 and 32 rows on a CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import sys
import time

import mlx.core as mx
import numpy as np

from mlxcel.bench.__main__ import add_checkpoint_arguments, describe_environment, reexec_with_openblas, split_models
from mlxcel.bench.checkpoints import prepare_checkpoint, read_model_config
from mlxcel.bench.harness import log
from mlxcel.bench.job_runs import Job, JobRun, format_run
from mlxcel.bench.jobs import (
    load_mlxcel,
    measure,
    name_model,
    parse_engines,
    parse_range,
    prepare_tokenizer,
    read_special_ids,
    run_mlx_lm,
    run_mlxcel,
)
from mlxcel.bench.peers import load_peer
from mlxcel.checkpoints.loader import pick_dtype
from mlxcel.errors import MlxcelError

# (models, rows, max rows)
GPU_DEFAULTS = (["llama-3.2-1b"], 256, 32)
CPU_DEFAULTS = (["smollm2"], 32, 8)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mlxcel.bench.prefix", description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated bench checkpoint names or HF model folders")
    parser.add_argument("--rows", type=int, help="rows in the shared-prefix job")
    parser.add_argument("--prefix-tokens", type=int, default=1500, help="tokens every row starts with")
    parser.add_argument("--question-tokens", type=parse_range, default=(20, 40), help="MIN,MAX of each row's own end")
    parser.add_argument("--output-tokens", type=int, default=16, help="tokens each row generates")
    parser.add_argument("--max-rows", type=int, help="rows decoding at once")
    parser.add_argument("--chat-history", type=int, default=2000, help="tokens of the conversation so far")
    parser.add_argument("--chat-new", type=int, default=50, help="tokens of the new turn")
    parser.add_argument("--reps", type=int, default=3, help="chat turns measured per case (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines", type=parse_engines, default=["mlxcel", "mlx-lm"])
    add_checkpoint_arguments(parser)
    args = parser.parse_args(argv)
    models, rows, max_rows = GPU_DEFAULTS if mx.default_device() == mx.gpu else CPU_DEFAULTS
    args.models = split_models(args.models, models)
    args.rows = args.rows or rows
    args.max_rows = args.max_rows or max_rows
    return args


def draw_ids(rng: np.random.Generator, allowed: np.ndarray, n: int) -> list[int]:
    return rng.choice(allowed, size=n).tolist()


def draw_shared_job(args: argparse.Namespace, allowed: np.ndarray, seed: int, rows: int | None = None) -> Job:
    rng = np.random.default_rng(seed)
    rows = rows or args.rows
    prefix = draw_ids(rng, allowed, args.prefix_tokens)
    low, high = args.question_tokens
    prompts = [prefix + draw_ids(rng, allowed, int(rng.integers(low, high + 1))) for _ in range(rows)]
    return Job(prompts, [args.output_tokens] * rows)


def computed_tokens(run: JobRun, job: Job) -> int:
    cache = (run.scheduler or {}).get("prompt_cache") or {}
    return cache.get("computed_prompt_tokens", sum(map(len, job.prompts)))


def run_shared_prefix(pipeline, peer_model, args, allowed) -> dict:
    """The job with the cache off and on (and mlx-lm's): their runs, keyed by name."""
    cache = pipeline.prompt_cache
    # the warm-up: one full decode batch of the job's shape (JIT, graph builds, the allocator)
    warm = draw_shared_job(args, allowed, args.seed + 1, min(args.rows, args.max_rows))
    job = draw_shared_job(args, allowed, args.seed)
    runs = {}
    cases = [("mlxcel, cache off", None), ("mlxcel, cache on", cache)]
    for name, with_cache in cases:
        pipeline.prompt_cache = with_cache
        for measured in (False, True):
            cache.clear()
            run = measure(lambda j: run_mlxcel(pipeline, j), job if measured else warm, 0)
        runs[name] = run
        log(f"{name}: {format_run(run)}; prompt tokens computed {computed_tokens(run, job)}")
    if peer_model is not None:
        run_mlx_lm(peer_model, warm, args.max_rows)
        runs["mlx-lm"] = measure(lambda j: run_mlx_lm(peer_model, j, args.max_rows), job, 0)
        log(f"mlx-lm: {format_run(runs['mlx-lm'])}")
    pipeline.prompt_cache = cache
    return {"job": job, "runs": runs}


def measure_chat_turn(pipeline, args, allowed) -> dict:
    """TTFT (ms, median of --reps) of a fresh --chat-new token prompt, and of a --chat-new token
    turn after a --chat-history token conversation and its answer, with the cache and without."""
    cache = pipeline.prompt_cache
    rng = np.random.default_rng(args.seed + 7)
    times: dict[str, list[float]] = {"fresh prompt": [], "turn, cache on": [], "turn, cache off": []}
    for rep in range(args.reps + 1):  # the first round warms every shape up and is not counted
        fresh = Job([draw_ids(rng, allowed, args.chat_new)], [args.output_tokens])
        history = draw_ids(rng, allowed, args.chat_history)
        new = draw_ids(rng, allowed, args.chat_new)
        pipeline.prompt_cache = None
        fresh_ms = run_mlxcel(pipeline, fresh).ttft_s[0] * 1000
        pipeline.prompt_cache, pipeline.keep_answers = cache, True
        cache.clear()
        answer = run_mlxcel(pipeline, Job([history], [args.output_tokens])).token_ids[0]
        turn = Job([history + answer + new], [args.output_tokens])
        on = run_mlxcel(pipeline, turn)
        pipeline.prompt_cache, pipeline.keep_answers = None, False
        off = run_mlxcel(pipeline, turn)
        if on.token_ids != off.token_ids:
            log("chat turn: the cache changed the token ids")
        if rep:
            times["fresh prompt"].append(fresh_ms)
            times["turn, cache on"].append(on.ttft_s[0] * 1000)
            times["turn, cache off"].append(off.ttft_s[0] * 1000)
    pipeline.prompt_cache = cache
    return {name: float(np.median(values)) for name, values in times.items()}


def format_report(label: str, shared: dict, chat: dict, args) -> str:
    job, runs = shared["job"], shared["runs"]
    lines = [
        f"{label}: {args.rows} rows = {args.prefix_tokens} shared tokens + {args.question_tokens[0]}-"
        f"{args.question_tokens[1]} of their own, {args.output_tokens} tokens out, greedy, at most {args.max_rows} "
        "rows decoding",
        f"{'run':20}{'wall s':>9}{'computed':>10}{'gen tok/s':>11}{'TTFT p50 s':>12}{'TTFT p95 s':>12}",
    ]
    for name, run in runs.items():
        m = run.metrics()
        lines.append(
            f"{name:20}{m['wall_s']:>9.2f}{computed_tokens(run, job):>10}{m['gen_tok_s']:>11.1f}"
            f"{m['ttft_p50_s']:>12.3f}{m['ttft_p95_s']:>12.3f}"
        )
    off, on = runs["mlxcel, cache off"], runs["mlxcel, cache on"]
    fell = 1 - computed_tokens(on, job) / computed_tokens(off, job)
    same = sum(a == b for a, b in zip(on.token_ids, off.token_ids))
    lines.append(
        f"cache on vs off: prefill work -{fell:.1%}, job {off.wall_s / on.wall_s:.2f}x faster, "
        f"{same}/{len(job.prompts)} rows with the same token ids"
    )
    if "mlx-lm" in runs:
        lines.append(f"cache on vs mlx-lm: job {runs['mlx-lm'].wall_s / on.wall_s:.2f}x faster")
    fresh, on_ms, off_ms = chat["fresh prompt"], chat["turn, cache on"], chat["turn, cache off"]
    lines.append(
        f"chat turn of {args.chat_new} new tokens after {args.chat_history} (+ answer): TTFT {on_ms:.1f} ms with "
        f"the cache, {off_ms:.1f} ms without; a fresh {args.chat_new}-token prompt {fresh:.1f} ms (ratio "
        f"{on_ms / fresh:.2f})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_peer = "mlx-lm" in args.engines
    if use_peer and importlib.util.find_spec("mlx_lm") is None:
        print(
            "mlxcel.bench.prefix: mlx-lm is not installed: pip install -e '.[bench]', or --engines mlxcel",
            file=sys.stderr,
        )
        return 2
    dtype = pick_dtype(args.dtype)
    env = {**describe_environment(dtype, peer=use_peer), "platform": platform.platform(terse=True)}
    log(" | ".join(f"{k} {v}" for k, v in env.items()))
    work_dir = args.work_dir.expanduser()
    reports = []
    for name in args.models:
        try:
            folder = prepare_checkpoint(name, work_dir, dtype)
        except (MlxcelError, ValueError) as exc:
            print(f"mlxcel.bench.prefix: {name}: {exc}", file=sys.stderr)
            return 1
        config = read_model_config(folder)
        vocab = config["vocab_size"]
        allowed = np.setdiff1d(np.arange(min(100, vocab // 4), vocab), read_special_ids(config))
        pipeline = load_mlxcel(folder, prepare_tokenizer(vocab, work_dir), dtype, args.max_rows)
        peer = load_peer("mlx-lm", folder, dtype).model if use_peer else None
        started = time.perf_counter()
        shared = run_shared_prefix(pipeline, peer, args, allowed)
        chat = measure_chat_turn(pipeline, args, allowed)
        log(f"{name}: measured in {time.perf_counter() - started:.0f} s")
        reports.append(format_report(name_model(name), shared, chat, args))
    print(" | ".join(f"{k} {v}" for k, v in env.items()))
    print("\n\n".join(reports))
    return 0


if __name__ == "__main__":
    reexec_with_openblas(sys.argv[1:], module="mlxcel.bench.prefix")
    sys.exit(main(sys.argv[1:]))
