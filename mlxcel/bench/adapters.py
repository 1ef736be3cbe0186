"""Several LoRA adapters in one job against the same job merged: python -m mlxcel.bench.adapters

    python -m mlxcel.bench.adapters [--model llama-3.2-1b] [--rows 256] [--adapters 4] [--rank 16]
                                    [--prompt-tokens 32,512] [--output-tokens 16,256] [--max-rows 256]

The job (bench.jobs' ragged rows, random token ids, greedy, no EOS stop) runs through mlxcel's job
path on three models, each after an unmeasured warm-up: the base model, one adapter merged into the
weights (`model.adapter`: the speed a single fine-tune gets), and --adapters adapters kept unmerged
(`model.adapters`), the rows taking them in turn, so every forward call mixes them. Each model runs
the job twice, both measured: the first run also pays the plans a GPU builds for each new call shape
(the unmerged adapters' products add shapes), the second is what a server meets once it has seen
them. The adapters are random (rank --rank on every projection of every layer, mlx-lm's format),
which costs what a trained one costs. Prints tok/s and the mixed job's ratio to the merged one (issue 44's
target: >= 0.7 on the H200, 1B shape, rank 16, 256 rows over 4 adapters).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxcel.bench.__main__ import add_checkpoint_arguments, describe_environment, reexec_with_openblas
from mlxcel.bench.checkpoints import CHECKPOINT_NAMES, prepare_checkpoint, read_model_config
from mlxcel.bench.harness import log
from mlxcel.bench.job_runs import format_run
from mlxcel.bench.jobs import (
    draw_job,
    load_mlxcel,
    measure,
    parse_range,
    prepare_tokenizer,
    read_special_ids,
    run_mlxcel,
)
from mlxcel.checkpoints.loader import pick_dtype

GPU_DEFAULTS = ("llama-3.2-1b", 256, (32, 512), (16, 256), 256)
CPU_DEFAULTS = ("smollm2", 32, (16, 128), (8, 48), 8)
RUNS = ("first", "again")  # each model runs the job twice: new call shapes' plan builds, then without them
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mlxcel.bench.adapters", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help=f"{', '.join(CHECKPOINT_NAMES)}, or an HF model folder")
    parser.add_argument("--rows", type=int, help="rows in the job")
    parser.add_argument("--adapters", type=int, default=4, help="adapters the mixed job's rows take in turn")
    parser.add_argument("--rank", type=int, default=16, help="every adapter's LoRA rank")
    parser.add_argument("--prompt-tokens", type=parse_range, help="MIN,MAX prompt tokens per row (uniform)")
    parser.add_argument("--output-tokens", type=parse_range, help="MIN,MAX generated tokens per row (uniform)")
    parser.add_argument("--max-rows", type=int, help="runner.max_rows")
    parser.add_argument("--seed", type=int, default=0, help="draws the rows and the adapters' weights")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    add_checkpoint_arguments(parser)
    args = parser.parse_args(argv)
    defaults = CPU_DEFAULTS if mx.default_device() == mx.cpu else GPU_DEFAULTS
    for key, value in zip(("model", "rows", "prompt_tokens", "output_tokens", "max_rows"), defaults):
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.adapters < 1 or args.rank < 1:
        parser.error("--adapters and --rank must be at least 1")
    return args


def write_random_adapter(folder: Path, config: dict, rank: int, seed: int) -> Path:
    """An mlx-lm adapter over every projection of every layer: A ~ N(0, 1/in), B ~ N(0, 0.01/rank)
    (mlx-lm starts B at zero; a trained B is not, and small enough that the model still answers)."""
    if (folder / "adapters.safetensors").exists():
        return folder
    rng = np.random.default_rng(seed)
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    dims = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inner),
        "up_proj": (hidden, inner),
        "down_proj": (inner, hidden),
    }
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (in_dims, out_dims) in dims.items():
            part = "self_attn" if name in PROJECTIONS[:4] else "mlp"
            key = f"model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_a"] = mx.array(rng.normal(0, in_dims**-0.5, (in_dims, rank)).astype(np.float32))
            tensors[f"{key}.lora_b"] = mx.array(rng.normal(0, 0.1 * rank**-0.5, (rank, out_dims)).astype(np.float32))
    folder.mkdir(parents=True, exist_ok=True)
    parameters = {"rank": rank, "scale": 2.0, "dropout": 0.0, "keys": [f"self_attn.{p}" for p in PROJECTIONS[:4]]}
    parameters["keys"] += [f"mlp.{p}" for p in PROJECTIONS[4:]]
    settings = {"fine_tune_type": "lora", "num_layers": config["num_hidden_layers"], "lora_parameters": parameters}
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    mx.save_safetensors(str(folder / "adapters.safetensors"), tensors)
    return folder


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = pick_dtype(args.dtype)
    env = describe_environment(dtype, peer=False)
    log(" | ".join(f"{k} {v}" for k, v in env.items()))
    work_dir = args.work_dir.expanduser()
    folder = prepare_checkpoint(args.model, work_dir, dtype)
    config = read_model_config(folder)
    tokenizer_dir = prepare_tokenizer(config["vocab_size"], work_dir)
    names = [f"a{i}" for i in range(args.adapters)]
    # (a checkpoint name or a folder's, and the shape: a folder is reused only for the same shapes)
    label = f"{Path(args.model).name}-{config['num_hidden_layers']}x{config['hidden_size']}"
    adapters = {
        name: str(write_random_adapter(work_dir / f"adapter-{label}-r{args.rank}-{i}", config, args.rank, i))
        for i, name in enumerate(names)
    }
    special = read_special_ids(config)
    job = draw_job(args.rows, args.prompt_tokens, args.output_tokens, config["vocab_size"], special, args.seed)
    vocab_size = config["vocab_size"]
    warm_up = draw_job(args.max_rows, (args.prompt_tokens[0],) * 2, (4, 4), vocab_size, special, args.seed + 1)
    runs = {
        "base": ({}, None),
        "merged": ({"adapter": adapters[names[0]]}, None),
        "mixed": ({"adapters": adapters}, [names[i % len(names)] for i in range(args.rows)]),
    }
    figures = {}
    for label, (model_settings, row_adapters) in runs.items():
        start = time.perf_counter()
        pipeline = load_mlxcel(folder, tokenizer_dir, dtype, args.max_rows, model_settings=model_settings)
        log(f"{label}: loaded in {time.perf_counter() - start:.1f} s")
        warm_adapters = row_adapters and [names[i % len(names)] for i in range(len(warm_up.prompts))]
        run_mlxcel(pipeline, warm_up, warm_adapters)
        for run in RUNS:
            result = measure(partial(run_mlxcel, pipeline, adapters=row_adapters), job, 0)
            log(f"{label}, {run} run: {format_run(result)}")
            figures[f"{label} {run}"] = result.metrics()
        del pipeline
    ratios = {run: figures[f"mixed {run}"]["gen_tok_s"] / figures[f"merged {run}"]["gen_tok_s"] for run in RUNS}
    print(" | ".join(f"{k} {v}" for k, v in env.items()))
    print(
        f"{args.model}: {args.rows} rows, prompts {args.prompt_tokens[0]}-{args.prompt_tokens[1]} tokens, "
        f"outputs {args.output_tokens[0]}-{args.output_tokens[1]}, max_rows {args.max_rows}; "
        f"{args.adapters} adapters of rank {args.rank} on every projection"
    )
    for label, m in figures.items():
        print(f"  {label:13s} {m['gen_tok_s']:9.1f} tok/s  wall {m['wall_s']:7.2f} s  TTFT p50 {m['ttft_p50_s']:.2f} s")
    print(
        f"  mixed / merged: first run {ratios['first']:.2f}x, again {ratios['again']:.2f}x "
        "(target >= 0.7 on the H200; the first run also pays the job's new call shapes' plan builds)"
    )
    if args.json:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"environment": env, "args": settings, "runs": figures}, indent=1))
    return 0


if __name__ == "__main__":
    reexec_with_openblas(sys.argv[1:], module="mlxcel.bench.adapters")
    sys.exit(main(sys.argv[1:]))
