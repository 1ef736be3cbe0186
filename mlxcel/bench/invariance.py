"""Which of MLX's kernels give a row the same bits whatever else shares the call: python -m mlxcel.bench.invariance

    python -m mlxcel.bench.invariance [--shapes 2048x8192,8192x2048,2048x128256] [--rows 1,2,...,1024]
                                      [--dtype bfloat16] [--json OUT.json]

A row's logits depend on what shares its batch when a kernel picks its tiling or reduction split
by the number of rows (docs/jobs.md, "Reproducible"). For each matmul shape KxN (x[M, K] @ W.T,
W [N, K], random, seed 0) this runs M = each of --rows and reports the M at which row 0 has the
bits it has at M=1, and the M at which rows 0-63 have the bits they have at M=64; then the same
for RMSNorm (row 0 against M=1) and for one-query attention over 512 keys (row 0 against a batch
of 1). The figures a batch-invariant mode is built on: which row counts can share one kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

from mlxcel.bench.__main__ import describe_environment, parse_ints

DEFAULT_ROWS = [1, 2, 3, 4, 7, 8, 16, 17, 32, 33, 64, 65, 100, 128, 129, 256, 512, 1024]
DEFAULT_SHAPES = "2048x8192,8192x2048,2048x128256"  # Llama-3.2-1B: q/MLP up, MLP down, the vocabulary head
ATTENTION_BATCHES = [1, 2, 4, 8, 16, 32, 64]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(n) for n in part.split("x")) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected KxN[,KxN...] (got {text!r})") from None
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected KxN[,KxN...] with positive sizes (got {text!r})")
    return shapes


def same_rows(outputs: dict[int, mx.array], base: int, rows: int) -> list[int]:
    """The row counts whose first `rows` rows have the bits they have at row count `base`."""
    reference = outputs[base][:rows]
    return [m for m, y in outputs.items() if m >= rows and mx.array_equal(y[:rows], reference).item()]


def check_matmul(k: int, n: int, counts: list[int], dtype: mx.Dtype) -> dict:
    weight = (mx.random.normal((n, k), key=mx.random.key(0)) * 0.02).astype(dtype)
    x = mx.random.normal((max(counts), k), key=mx.random.key(1)).astype(dtype)
    outputs = {}
    for m in counts:
        outputs[m] = x[:m] @ weight.T
        mx.eval(outputs[m])
    result = {"shape": f"{k}x{n}", "row0_as_at_1": same_rows(outputs, 1, 1)}
    if 64 in outputs:
        result["rows64_as_at_64"] = same_rows(outputs, 64, 64)
    return result


def check_rms_norm(counts: list[int], dtype: mx.Dtype, dim: int = 2048) -> list[int]:
    x = mx.random.normal((max(counts), dim), key=mx.random.key(2)).astype(dtype)
    weight = mx.ones((dim,), dtype)
    return same_rows({m: mx.fast.rms_norm(x[:m], weight, 1e-5) for m in counts}, 1, 1)


def check_attention(dtype: mx.Dtype) -> list[int]:
    """One query per row, 32 query heads over 8 KV heads of 64, 512 keys (a decode step's shape)."""
    keys = [mx.random.key(i) for i in (3, 4, 5)]
    q = mx.random.normal((64, 32, 1, 64), key=keys[0]).astype(dtype)
    k = mx.random.normal((64, 8, 512, 64), key=keys[1]).astype(dtype)
    v = mx.random.normal((64, 8, 512, 64), key=keys[2]).astype(dtype)
    outputs = {b: mx.fast.scaled_dot_product_attention(q[:b], k[:b], v[:b], scale=0.125) for b in ATTENTION_BATCHES}
    return same_rows(outputs, 1, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlxcel.bench.invariance", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES), help="KxN matmuls")
    parser.add_argument("--rows", type=parse_ints, default=DEFAULT_ROWS, help="row counts M (1 is the reference)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    counts = sorted(set(args.rows) | {1})
    dtype = getattr(mx, args.dtype)
    env = describe_environment(dtype, peer=False)
    print(" | ".join(f"{k} {v}" for k, v in env.items()))
    report = {"environment": env, "rows": counts, "matmul": [], "rms_norm": None, "attention": None}
    for k, n in args.shapes:
        result = check_matmul(k, n, counts, dtype)
        report["matmul"].append(result)
        line = f"matmul {result['shape']}: row 0 as at M=1 for M in {result['row0_as_at_1']}"
        if "rows64_as_at_64" in result:
            line += f"; rows 0-63 as at M=64 for M in {result['rows64_as_at_64']}"
        print(line, flush=True)
    report["rms_norm"] = check_rms_norm(counts, dtype)
    print(f"rms_norm: row 0 as at M=1 for M in {report['rms_norm']}")
    report["attention"] = check_attention(dtype)
    print(f"attention (1 query, 512 keys): row 0 as at B=1 for B in {report['attention']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
