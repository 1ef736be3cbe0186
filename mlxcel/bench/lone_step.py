"""Where a lone row's decode step goes: python -m mlxcel.bench.lone_step

    python -m mlxcel.bench.lone_step [--models deepseek-v2-lite-small,qwen3.5-0.8b] [--context 512] [--steps 128]

One row, a --context-token prompt, then --steps greedy tokens, pipelined as the engines run them
(the next step is queued before the last token is read). Per step: the host's time building the
graph in Python, its time in `mx.async_eval` (MLX encodes and launches the kernels), and the whole
step. Four ways to run the same model: mlxcel's segmented step and its eager step over a dense
cache (the model alone), mlxcel's scheduler (the paged cache, what `python -m mlxcel.bench`
measures; again for Gated DeltaNet models with the delta rule's fused kernel instead of its ops,
and for MLA models with the latent pools written in place), and mlx-lm's model over its own cache
(where mlx-lm is installed). A gap between the dense and the scheduler rows is the paged cache's; between ours
and mlx-lm's, the model's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

from mlxcel.bench.__main__ import add_checkpoint_arguments, reexec_with_openblas
from mlxcel.bench.checkpoints import dtype_name, prepare_checkpoint
from mlxcel.bench.harness import align_columns, log
from mlxcel.checkpoints.loader import load_model, pick_dtype
from mlxcel.engine.engine import get_decoder


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mlxcel.bench.lone_step", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="deepseek-v2-lite-small,qwen3.5-0.8b", help="bench checkpoint names")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens")
    parser.add_argument("--steps", type=int, default=128, help="decode steps timed (after 8 untimed)")
    add_checkpoint_arguments(parser)
    return parser.parse_args(argv)


def time_steps(step, token: mx.array, steps: int) -> dict:
    """step(tokens [1]) -> logits [1, V]; greedy, one step in flight while the host builds the next."""
    for _ in range(8):
        token = mx.argmax(step(token), axis=-1)
        mx.eval(token)
    build = encode = 0.0
    start = time.perf_counter()
    pending = None
    for _ in range(steps):
        t0 = time.perf_counter()
        token = mx.argmax(step(token), axis=-1)
        t1 = time.perf_counter()
        mx.async_eval(token)
        t2 = time.perf_counter()
        build, encode = build + t1 - t0, encode + t2 - t1
        if pending is not None:
            pending.item()
        pending = token
    pending.item()
    total = time.perf_counter() - start
    return {"build_ms": 1e3 * build / steps, "encode_ms": 1e3 * encode / steps, "step_ms": 1e3 * total / steps}


def run_mlxcel(folder, dtype, prompt: mx.array, steps: int) -> dict[str, dict]:
    model = load_model(str(folder), dtype=dtype_name(dtype)).model
    decoder = get_decoder(model, "segmented")
    results = {
        "mlxcel segmented, dense cache": time_dense(lambda t, cache: decoder(t, cache), model, prompt, steps),
        "mlxcel eager, dense cache": time_dense(lambda t, cache: model(t[:, None], cache)[:, -1], model, prompt, steps),
    }
    from mlxcel.engine.scheduler import cache_attentions

    latent = any(getattr(a, "cache_dims", None) for a in cache_attentions(model))
    for way, env in VARIANTS:
        if "MLXCEL_FUSED_DELTA" in env and not getattr(model, "linear_attention", None):
            continue  # (no Gated DeltaNet layers)
        if "MLXCEL_MLA_IN_PLACE" in env and not latent:
            continue  # (no MLA layers)
        with overridden(env):
            model.__dict__.pop("_mlxcel_decoders", None)  # (steps traced under the other settings)
            results[f"mlxcel scheduler{way}"] = time_scheduler(model, prompt, steps)
    return results


# the scheduler's row again with each of its CUDA decode paths switched off (both on by default)
VARIANTS = [
    ("", {}),
    (", delta rule in ops", {"MLXCEL_FUSED_DELTA": "0"}),
    (", MLA pools scattered", {"MLXCEL_MLA_IN_PLACE": "0"}),
]


@contextmanager
def overridden(env: dict[str, str]):
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def time_dense(step, model, prompt: mx.array, steps: int) -> dict:
    """step(tokens, cache) over the model's own dense cache after the prompt."""
    cache = model.make_cache(1)
    first = mx.argmax(model(prompt[None], cache)[:, -1], axis=-1)
    mx.eval(first)
    return time_steps(lambda t: step(t, cache), first, steps)


def time_scheduler(model, prompt: mx.array, steps: int) -> dict:
    """The scheduler's own figure: the row's decode tok/s after its first token (no host split:
    its loop is the engine's)."""
    from mlxcel.engine import GenerationRequest, RowRequest
    from mlxcel.engine.scheduler import BatchScheduler
    from mlxcel.sampling import Sampler

    tokens = prompt.tolist()
    scheduler = BatchScheduler(model, 4096, 1)

    def generate(n: int) -> dict:
        request = GenerationRequest([RowRequest(tokens, row_id=0)], Sampler("greedy"), max_tokens=n)
        return scheduler.generate(request).results[0].timing

    generate(8)
    rate = generate(steps + 1)["decode_tok_per_sec"]
    return {"build_ms": float("nan"), "encode_ms": float("nan"), "step_ms": 1e3 / rate}


def run_mlx_lm(folder, prompt: mx.array, steps: int) -> dict[str, dict]:
    try:
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.utils import load_model as load_peer
    except ImportError:
        return {}
    model = load_peer(folder)[0]
    cache = make_prompt_cache(model)
    first = mx.argmax(model(prompt[None], cache=cache)[:, -1], axis=-1)
    mx.eval(first)
    return {"mlx-lm": time_steps(lambda t: model(t[:, None], cache=cache)[:, -1], first, steps)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if mx.default_device() == mx.cpu:
        reexec_with_openblas(sys.argv[1:] if argv is None else argv, "mlxcel.bench.lone_step")
    dtype = pick_dtype(args.dtype)
    rows = [["model", "way", "build ms", "async_eval ms", "step ms", "tok/s"]]
    for name in args.models.split(","):
        folder = prepare_checkpoint(name, args.work_dir.expanduser(), dtype)
        prompt = mx.array(np.random.default_rng(0).integers(10, 1000, args.context), dtype=mx.int32)
        log(f"{name}: mlxcel")
        results = run_mlxcel(folder, dtype, prompt, args.steps)
        log(f"{name}: mlx-lm")
        results.update(run_mlx_lm(folder, prompt, args.steps))
        for way, r in results.items():
            rows.append(
                [
                    name,
                    way,
                    f"{r['build_ms']:.2f}",
                    f"{r['encode_ms']:.2f}",
                    f"{r['step_ms']:.2f}",
                    f"{1e3 / r['step_ms']:.0f}",
                ]
            )
        print("\n".join(align_columns(rows, 2)), flush=True)


if __name__ == "__main__":
    main()
