"""mlxcel against mlx-lm, side by side: python -m mlxcel.bench [options]

    python -m mlxcel.bench [--models smollm2,qwen2.5-0.5b,llama-3.2-1b] [--prompt-lengths 128,512]
                           [--batch-sizes 1,8] [--gen 64] [--reps 3] [--json OUT.json] [--quick]

Both engines load the same HF folder in the same process and run alternately; progress goes to
stderr, the table of medians and ratios (mlxcel / mlx-lm) and the token-id check to stdout.
Defaults depend on the device: the full set on a GPU, a few minutes' worth on a CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

import mlxcel
from mlxcel import blas
from mlxcel.bench.checkpoints import CHECKPOINT_NAMES, dtype_name, prepare_checkpoint, read_model_config
from mlxcel.bench.harness import bench_model, format_agreement, format_table, log
from mlxcel.bench.peers import check_peer_dtype
from mlxcel.blas import describe_blas
from mlxcel.checkpoints.loader import pick_dtype
from mlxcel.errors import MlxcelError

# (models, prompt lengths, batch sizes, gen tokens, reps). The CPU set stays small enough for a
# 2-core machine (run times: docs/benchmarks.md); ask for longer prompts with --prompt-lengths 128,512.
GPU_DEFAULTS = (["smollm2", "qwen2.5-0.5b", "llama-3.2-1b"], [128, 512], [1, 8, 32], 128, 5)
CPU_DEFAULTS = (["smollm2", "qwen2.5-0.5b"], [128], [1, 8], 16, 3)
QUICK = (["smollm2"], [64], [1], 8, 1)


def parse_ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers (got {text!r})")
    return values


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """--dtype and --work-dir, as every bench takes them."""
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bf16 on a GPU, fp32 on the CPU",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path(os.environ.get("MLXCEL_BENCH_DIR", "~/.cache/mlxcel-bench")),
        help="where the built checkpoints are kept between runs (default $MLXCEL_BENCH_DIR or ~/.cache/mlxcel-bench)",
    )


def split_models(text: str | None, defaults: list[str]) -> list[str]:
    """--models: comma-separated checkpoint names or folders, else the device's defaults."""
    return [m.strip() for m in text.split(",") if m.strip()] if text else defaults


def draft_tokens(value: str) -> int | str:
    return value if value == "auto" else int(value)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mlxcel.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated: {', '.join(CHECKPOINT_NAMES)}, or HF model folders")
    parser.add_argument("--prompt-lengths", type=parse_ints, help="prompt tokens per row, comma-separated")
    parser.add_argument("--batch-sizes", type=parse_ints, help="rows per generation, comma-separated")
    parser.add_argument("--gen", type=int, help="tokens generated per row")
    parser.add_argument("--reps", type=int, help="measured repetitions per engine and case")
    parser.add_argument("--json", type=Path, help="also write every run and the medians here")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: smollm2, 64-token prompt, batch 1, 8 tokens, 1 rep"
    )
    draft = parser.add_argument_group("speculative decoding (mlxcel/bench/draft.py)")
    draft.add_argument(
        "--draft",
        choices=["ngram", "model"],
        help="an extraction prompt with SmolLM2, plain / drafted / mlx-lm: ngram (prompt lookup) or model (SmolLM2 "
        "at 4 bits drafts on a GPU, SmolLM2 itself on the CPU)",
    )
    draft.add_argument(
        "--draft-tokens",
        default="auto",
        type=draft_tokens,
        help="decode.draft.tokens (auto: 16 for ngram, 4 for model)",
    )
    draft.add_argument("--draft-rows", type=int, help="rows of the job run with and without (64 GPU, 8 CPU)")
    draft.add_argument("--seed", type=int, default=0, help="draws the extraction prompts' documents")
    add_checkpoint_arguments(parser)
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else GPU_DEFAULTS if mx.default_device() == mx.gpu else CPU_DEFAULTS
    models, prompt_lengths, batch_sizes, gen, reps = defaults
    args.models = split_models(args.models, models)
    args.prompt_lengths = args.prompt_lengths or prompt_lengths
    args.batch_sizes = args.batch_sizes or batch_sizes
    if args.draft:  # (its own defaults: an answer long enough to copy spans, a job of rows)
        gpu = mx.default_device() == mx.gpu
        gen = 128 if gpu else 64
        args.draft_rows = args.draft_rows or (64 if gpu else 8)
    args.gen = args.gen or gen
    args.reps = args.reps or reps
    if args.gen < 2 or args.reps < 1:
        parser.error("--gen must be >= 2 (decode speed needs tokens after the first) and --reps >= 1")
    return args


def read_mlxcel_commit() -> str:
    """The source checkout's commit (+dirty), so a table says which engine it measured."""
    root = Path(mlxcel.__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def describe_environment(dtype: mx.Dtype, peer: bool = True) -> dict:
    from importlib.metadata import version

    device = str(mx.default_device())
    if mx.default_device() == mx.cpu:
        device += f", BLAS {describe_blas()}"
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "device": device,
        "dtype": dtype_name(dtype),
        "mlx": mx.__version__,
        **({"mlx_lm": version("mlx-lm")} if peer else {}),
        "mlxcel": f"{mlxcel.__version__} ({read_mlxcel_commit()})",
    }


def reexec_with_openblas(argv: list[str], module: str = "mlxcel.bench") -> None:
    """As mlxcel-run does (mlxcel/blas.py): on a Linux CPU, run once more with OpenBLAS preloaded
    instead of the mlx-cpu wheel's reference BLAS (~20x slower prefill). Both engines share this
    process, so they always share a BLAS; MLXCEL_BLAS=off keeps the reference one."""
    blas.reexec_with_openblas(argv, module, show_hint=lambda hint: log(hint.removeprefix("mlxcel: ")))


def main(argv: list[str] | None = None) -> int:
    if importlib.util.find_spec("mlx_lm") is None:
        print("mlxcel.bench: mlx-lm (the benchmark peer) is not installed: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    args = parse_args(argv)
    dtype = pick_dtype(args.dtype)
    env = describe_environment(dtype)
    log(" | ".join(f"{k} {v}" for k, v in env.items()))
    log(
        f"models {','.join(args.models)} | prompts {args.prompt_lengths} | batches {args.batch_sizes} | gen {args.gen} "
        f"| reps {args.reps}"
    )
    work_dir = args.work_dir.expanduser()
    if args.draft:
        from mlxcel.bench.draft import bench_draft

        table = bench_draft(args, prepare_checkpoint("smollm2", work_dir, dtype), dtype)
        print(" | ".join(f"{k} {v}" for k, v in env.items()))
        print(table)
        return 0
    results = []
    for name in args.models:
        start = time.perf_counter()
        try:
            folder = prepare_checkpoint(name, work_dir, dtype)
            check_peer_dtype(read_model_config(folder), dtype)
        except (MlxcelError, ValueError) as exc:  # a missing package or a wrong path: one line, no traceback
            print(f"mlxcel.bench: {name}: {exc}", file=sys.stderr)
            return 1
        log(f"{name}: checkpoint {folder} ready in {time.perf_counter() - start:.1f} s")
        results += bench_model(
            name,
            folder,
            args.prompt_lengths,
            args.batch_sizes,
            args.gen,
            args.reps,
            dtype,
            warm_each_case=mx.default_device() == mx.gpu,
        )
    print(" | ".join(f"{k} {v}" for k, v in env.items()))
    print(f"gen {args.gen} tokens per row, greedy; medians of {args.reps} alternating reps")
    print(format_table(results))
    print(format_agreement(results))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "environment": env,
                    "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "cases": [r.to_dict() for r in results],
                    # MLA models: KV bytes a position, mlxcel's pool against mlx-lm's cache
                    "kv_bytes_per_position": {r.model: r.kv_bytes for r in results if r.kv_bytes},
                },
                indent=1,
            )
        )
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    if importlib.util.find_spec("mlx_lm") is not None:  # else main() says how to install it, at once
        reexec_with_openblas(sys.argv[1:])
    sys.exit(main(sys.argv[1:]))
