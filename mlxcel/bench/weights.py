"""Measure GGUF weights kept quantized vs dequantized, on this machine's default device.

    python -m mlxcel.bench.weights [--path embedded:smollm2] [--prompt-tokens 128] [--gen 64] [--reps 3]

Both variants are loaded once and run alternately (after a warm-up that absorbs kernel JIT),
so the ratio comes from one run under the same conditions. Prints medians per variant.
"""

from __future__ import annotations

import argparse
import statistics

import mlx.core as mx

from mlxcel.checkpoints.loader import is_optimized_blas_loaded, load_model
from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
from mlxcel.sampling import Sampler


def run_once(model, prompt: list[int], gen: int) -> tuple[float, float]:
    engine = DirectEngine(model, max_context=len(prompt) + gen + 1)
    state = engine.generate(GenerationRequest([RowRequest(prompt)], Sampler("greedy"), max_tokens=gen))
    t = state.timings
    prefill = len(prompt) / (t.first_token - t.start)
    decode = (len(state.results[0].token_ids) - 1) / (t.end - t.first_token)
    return prefill, decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", default="embedded:smollm2")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    variants = {name: load_model(args.path, gguf_weights=name) for name in ("quantized", "dequantize")}
    prompt = [(17 * i + 3) % 30000 + 100 for i in range(args.prompt_tokens)]
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for loaded in variants.values():  # warm-up: kernel compilation, allocator
        run_once(loaded.model, prompt, 4)
    for _ in range(args.reps):
        for name, loaded in variants.items():
            results[name].append(run_once(loaded.model, prompt, args.gen))
    device = f"{mx.default_device()}" + (" + OpenBLAS" if is_optimized_blas_loaded() else "")
    print(
        f"device: {device}; dtype: {variants['quantized'].info['dtype']}; prompt {args.prompt_tokens} tok; gen "
        f"{args.gen}; reps {args.reps}"
    )
    print(f"{'weights':<12}{'prefill tok/s':>15}{'decode tok/s':>15}{'load ms':>10}")
    for name, runs in results.items():
        prefill = statistics.median(r[0] for r in runs)
        decode = statistics.median(r[1] for r in runs)
        print(f"{name:<12}{prefill:>15.1f}{decode:>15.1f}{variants[name].info['load_ms']:>10.0f}")


if __name__ == "__main__":
    main()
