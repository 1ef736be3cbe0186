"""The dtype and prefill-chunk policies, measured on this device: python -m mlxcel.bench.policy

    python -m mlxcel.bench.policy [--model llama-3.2-1b] [--dtypes float32,bfloat16,float16]
        [--dtype-prompt-len 512] [--chunks 256,512,1024,2048,4096] [--chunk-prompt-len 4096]
        [--gen 64] [--reps 3]

Dtype: batch 1, one prompt, greedy decode; prefill and decode tok/s per compute dtype (the
policy, `model.dtype=auto`: bf16 on a GPU, fp32 on the CPU).
Chunk: one long prompt prefilled in pieces of each size, in the device's default dtype; prefill
tok/s and the longest piece, which is how long rows already decoding would wait for it if a
server interleaved it with their steps (the policy, docs/design.md: 2048 alone, 512 while a batch
decodes). The settings alternate inside each repetition; medians are printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from mlxcel.bench.__main__ import describe_environment, parse_ints, reexec_with_openblas
from mlxcel.bench.checkpoints import CHECKPOINT_NAMES, prepare_checkpoint, read_model_config
from mlxcel.bench.harness import log, make_prompts
from mlxcel.checkpoints.loader import DTYPES, load_model, pick_dtype
from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
from mlxcel.sampling import Sampler

ON_GPU = mx.default_device() == mx.gpu
# (model, dtypes, dtype prompt, chunks, chunk prompt, gen, reps). The CPU set's prompt stays short
# because float16 matmuls are slow on CPUs (run times: docs/benchmarks.md).
GPU_DEFAULTS = ("llama-3.2-1b", [mx.float32, mx.bfloat16, mx.float16], 512, [256, 512, 1024, 2048, 4096], 4096, 64, 3)
CPU_DEFAULTS = ("smollm2", [mx.float32, mx.bfloat16, mx.float16], 64, [128, 256, 512, 1024], 1024, 8, 2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mlxcel.bench.policy", description=__doc__.splitlines()[0])
    model, dtypes, dtype_prompt, chunks, chunk_prompt, gen, reps = GPU_DEFAULTS if ON_GPU else CPU_DEFAULTS
    parser.add_argument("--model", default=model, help=f"one of {', '.join(CHECKPOINT_NAMES)}, or an HF model folder")
    parser.add_argument(
        "--dtypes",
        default=",".join(str(d).removeprefix("mlx.core.") for d in dtypes),
        help="comma-separated compute dtypes",
    )
    parser.add_argument("--dtype-prompt-len", type=int, default=dtype_prompt)
    parser.add_argument("--chunks", type=parse_ints, default=chunks, help="prefill chunk sizes, comma-separated")
    parser.add_argument("--chunk-prompt-len", type=int, default=chunk_prompt)
    parser.add_argument("--gen", type=int, default=gen, help="tokens decoded per dtype run")
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--skip", choices=["dtype", "chunk"], help="measure only the other policy")
    parser.add_argument("--work-dir", type=Path, default=Path("~/.cache/mlxcel-bench"))
    args = parser.parse_args(argv)
    names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in names if d not in DTYPES]
    if unknown or not names:
        parser.error(f"--dtypes: {', '.join(unknown) or 'none given'}; choose from {', '.join(DTYPES)}")
    args.dtypes = [DTYPES[d] for d in names]
    if args.gen < 2 or args.reps < 1:
        parser.error("--gen must be >= 2 (decode speed needs tokens after the first) and --reps >= 1")
    return args


def generate(model, prompt: list[int], gen: int, chunk_size: int):
    engine = DirectEngine(model, max_context=len(prompt) + gen + 1)
    request = GenerationRequest(
        rows=[RowRequest(prompt, row_id=0)], sampler=Sampler("greedy"), max_tokens=gen, chunk_size=chunk_size
    )
    return engine.generate(request)


def measure_dtypes(name: str, args: argparse.Namespace) -> list[str]:
    models = {}
    for dtype in args.dtypes:
        folder = prepare_checkpoint(name, args.work_dir.expanduser(), dtype)
        models[dtype] = load_model(str(folder), dtype=str(dtype).removeprefix("mlx.core.")).model
    vocab = read_model_config(folder)["vocab_size"]
    prompt = make_prompts(1, args.dtype_prompt_len, vocab)[0]
    figures: dict[mx.Dtype, list[tuple[float, float]]] = {d: [] for d in args.dtypes}
    for model in models.values():
        generate(model, prompt, 4, 2048)  # kernels built per shape on a GPU: outside the measurement
    for rep in range(args.reps):
        for dtype, model in models.items():
            t = generate(model, prompt, args.gen, 2048).timings
            figures[dtype].append((len(prompt) / (t.first_token - t.start), (args.gen - 1) / (t.end - t.first_token)))
            log(
                f"dtype {dtype} rep {rep + 1}/{args.reps}: prefill {figures[dtype][-1][0]:.1f} tok/s, decode "
                f"{figures[dtype][-1][1]:.1f} tok/s"
            )
    default = pick_dtype("auto")
    lines = [
        f"dtype: batch 1, {args.dtype_prompt_len}-token prompt, {args.gen} tokens, chunk 2048",
        "| dtype | prefill tok/s | decode tok/s |",
        "| --- | --- | --- |",
    ]
    for dtype, runs in figures.items():
        label = str(dtype).removeprefix("mlx.core.") + (" (auto)" if dtype == default else "")
        lines.append(
            f"| {label} | {statistics.median(r[0] for r in runs):.1f} | {statistics.median(r[1] for r in runs):.1f} |"
        )
    return lines


def measure_chunks(name: str, args: argparse.Namespace) -> list[str]:
    dtype = pick_dtype("auto")
    folder = prepare_checkpoint(name, args.work_dir.expanduser(), dtype)
    model = load_model(str(folder), dtype=str(dtype).removeprefix("mlx.core.")).model
    vocab = read_model_config(folder)["vocab_size"]
    prompt = make_prompts(1, args.chunk_prompt_len, vocab)[0]
    for chunk in args.chunks:
        generate(model, prompt[: min(len(prompt), 2 * chunk)], 2, chunk)  # per-shape kernels, unmeasured
    figures: dict[int, list[tuple[float, float, float]]] = {c: [] for c in args.chunks}
    for rep in range(args.reps):
        order = args.chunks if rep % 2 == 0 else args.chunks[::-1]
        for chunk in order:
            t = generate(model, prompt, 2, chunk).timings
            piece_ms = [p["ms"] for p in t.prefill_pieces]
            figures[chunk].append((len(prompt) / (t.first_token - t.start), max(piece_ms), statistics.median(piece_ms)))
            log(
                f"chunk {chunk} rep {rep + 1}/{args.reps}: prefill {figures[chunk][-1][0]:.1f} tok/s, longest piece "
                f"{max(piece_ms):.1f} ms"
            )
    lines = [
        f"chunk: batch 1, {args.chunk_prompt_len}-token prompt, {str(dtype).removeprefix('mlx.core.')}",
        "| chunk | pieces | prefill tok/s | longest piece ms | median piece ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for chunk, runs in figures.items():
        pieces = -(-args.chunk_prompt_len // chunk)
        lines.append(
            f"| {chunk} | {pieces} | {statistics.median(r[0] for r in runs):.1f} | "
            f"{statistics.median(r[1] for r in runs):.1f} | {statistics.median(r[2] for r in runs):.1f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = describe_environment(pick_dtype("auto"), peer=False)
    log(" | ".join(f"{k} {v}" for k, v in env.items()))
    started = time.perf_counter()
    try:
        tables = [] if args.skip == "dtype" else measure_dtypes(args.model, args)
        tables += [] if args.skip == "chunk" else ([""] if tables else []) + measure_chunks(args.model, args)
    except ValueError as exc:  # an unknown checkpoint name or a folder without config.json
        print(f"mlxcel.bench.policy: {exc}", file=sys.stderr)
        return 1
    print(" | ".join(f"{k} {v}" for k, v in env.items()) + f" | model {args.model} | medians of {args.reps} reps")
    print("\n".join(tables))
    log(f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    reexec_with_openblas(sys.argv[1:], module="mlxcel.bench.policy")
    sys.exit(main(sys.argv[1:]))
