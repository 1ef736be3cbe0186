"""The sampler chain's per-token cost against mlx-lm's make_sampler: python -m mlxcel.bench.sampler

    python -m mlxcel.bench.sampler [--vocab 151936] [--batch-sizes 1,32] [--steps 30] [--reps 3]
                                   [--dtype float32|bfloat16] [--cases NAME,...]

Each case times one sampling step (random logits [B, V] in, token ids evaluated out), alternating
mlxcel (its step under mx.compile, and eager) and mlx-lm round by round; the table gives medians
in ms per step and the ratio of mlxcel's default (compiled on a GPU or for batch x vocab >= 2^20
on a CPU, else eager) to mlx-lm. mlx-lm's
step includes the log-softmax its generate loop applies before its sampler. Cases mlx-lm cannot
express (DRY, mirostat, adaptive-p, ...) show mlxcel alone. mlx-lm is the optional `bench` extra.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import mlx.core as mx

from mlxcel.sampling import RowKey, make_sampler_chain
from mlxcel.sampling.chain import should_compile

# name: (mlxcel sampler config, mlx-lm make_sampler kwargs or None, mlx-lm logits-processor kwargs or None)
CASES = {
    "greedy": ({"selector": {"kind": "greedy"}}, {"temp": 0.0}, None),
    "temperature": ({"processors": {"temperature": {"value": 0.8}}}, {"temp": 0.8}, None),
    "top_k+top_p+min_p+temp": (
        {"processors": {"top_k": {"k": 40}, "top_p": {"p": 0.95}, "min_p": {"p": 0.05}, "temperature": {"value": 0.8}}},
        {"temp": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
        None,
    ),
    "top_p+temp": (
        {"processors": {"top_p": {"p": 0.95}, "temperature": {"value": 0.8}}},
        {"temp": 0.8, "top_p": 0.95},
        None,
    ),
    "min_p+xtc+temp": (
        {
            "processors": {
                "min_p": {"p": 0.02},
                "xtc": {"probability": 0.5, "threshold": 0.1},
                "temperature": {"value": 1.0},
            }
        },
        {"temp": 1.0, "min_p": 0.02, "xtc_probability": 0.5, "xtc_threshold": 0.1},
        None,
    ),
    "penalties+min_p+temp (row)": (
        {
            "processors": {
                "penalties": {"repeat": 1.1, "last_n": 64},
                "min_p": {"p": 0.05},
                "temperature": {"value": 0.8},
            }
        },
        {"temp": 0.8, "min_p": 0.05},
        {"repetition_penalty": 1.1, "repetition_context_size": 64},
    ),
    "dry+min_p+temp (row)": (
        {"processors": {"dry": {"multiplier": 0.8, "last_n": 64}, "min_p": {"p": 0.05}, "temperature": {"value": 0.8}}},
        None,
        None,
    ),
    "typical+top_n_sigma (fused)": (
        {"processors": {"top_n_sigma": {"n": 1.0}, "typical_p": {"p": 0.95}, "temperature": {"value": 0.8}}},
        None,
        None,
    ),
    "mirostat_v2 (row)": (
        {"processors": {"temperature": {"value": 0.8}}, "selector": {"kind": "mirostat_v2"}},
        None,
        None,
    ),
    "adaptive_p (row)": (
        {"processors": {"min_p": {"p": 0.05}}, "selector": {"kind": "adaptive_p", "target": 0.5}},
        None,
        None,
    ),
}


def make_ours(config: dict, logits: mx.array, compiled: bool):
    batch, vocab = logits.shape
    chain = make_sampler_chain(config, vocab, encode=lambda text: [ord(ch) % vocab for ch in text], compile=compiled)
    sampler = chain.start(
        [RowKey(i) for i in range(batch)], [[(7 * i + j) % vocab for j in range(200)] for i in range(batch)]
    )

    def step():
        draw = sampler.sample(logits)
        mx.eval(draw.tokens, *sampler.state_arrays())

    return step


def make_theirs(kwargs: dict, processor_kwargs: dict | None, logits: mx.array):
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    sampler = make_sampler(**kwargs)
    processors = make_logits_processors(**processor_kwargs) if processor_kwargs else []
    history = [mx.array([(7 * j) % logits.shape[-1] for j in range(200)])]

    def step():
        x = logits
        for processor in processors:
            x = processor(history[0], x)
        tokens = sampler(x - mx.logsumexp(x, axis=-1, keepdims=True))
        mx.eval(tokens)
        if processors:
            history[0] = mx.concatenate([history[0], tokens[:1].astype(history[0].dtype)])

    return step


def time_steps(step, steps: int) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args(argv)
    try:
        import mlx_lm  # noqa: F401

        have_peer = True
    except ImportError:
        print("mlx-lm is not installed (pip install 'mlxcel[bench]'): mlxcel's figures only", file=sys.stderr)
        have_peer = False
    print(
        f"device {mx.default_device()}, vocab {args.vocab}, {args.dtype} logits, median ms per step over {args.steps} "
        f"steps x {args.reps} rounds"
    )
    print(
        "| case | batch | mlxcel compiled ms | mlxcel eager ms | mlx-lm ms | mlxcel / mlx-lm |\n| --- | --- | "
        "--- | --- | --- | --- |"
    )
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        logits = mx.random.normal((batch, args.vocab), key=mx.random.key(0)).astype(getattr(mx, args.dtype)) * 3
        mx.eval(logits)
        for name in args.cases.split(","):
            config, theirs_kwargs, processor_kwargs = CASES[name]
            runs = {"compiled": make_ours(config, logits, True), "eager": make_ours(config, logits, False)}
            if have_peer and theirs_kwargs is not None:
                runs["theirs"] = make_theirs(theirs_kwargs, processor_kwargs, logits)
            times: dict[str, list[float]] = {key: [] for key in runs}
            for _ in range(args.reps):  # alternate, round by round
                for key, step in runs.items():
                    times[key].append(time_steps(step, args.steps))
            compiled, eager = statistics.median(times["compiled"]), statistics.median(times["eager"])
            theirs = f"{statistics.median(times['theirs']):.2f}" if "theirs" in times else "-"
            default = "compiled" if should_compile(None, batch, args.vocab) else "eager"
            ratio = (
                f"{statistics.median(times[default]) / statistics.median(times['theirs']):.2f}"
                if "theirs" in times
                else "-"
            )
            print(f"| {name} | {batch} | {compiled:.2f} | {eager:.2f} | {theirs} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
