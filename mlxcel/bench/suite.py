"""The whole GPU comparison in one command: python -m mlxcel.bench.suite

    python -m mlxcel.bench.suite --out DIR [--parts batch1,readme,structured,jobs] [--budget 530]

A device lease is short and a cold start costs minutes, so one call runs every comparison the
speed issues name, each part a subprocess with its own share of the time budget, its output in
DIR/<part>.log and its figures in DIR/<part>.json as soon as it ends (a part cut by its timeout
loses only itself), then prints one table:
- jobs: the 512-row ragged job on the 1B and 0.5B shapes against mlx-lm's BatchGenerator
  (`bench.jobs --rows 512 --max-rows 256`);
- batch1: one 512-token prompt decoding 128 tokens on both shapes against mlx-lm (`bench`);
- readme: the README's job command as a user types it (`python -m mlxcel prompt=jsonl
  prompt.file=rows.jsonl`, no runner.max_rows), the whole process, on the 1B shape and the job's rows;
- structured: the constrained step's orders (`bench.structured --orders split,thread,after`);
- families: batch 1 and the ragged job for the newer shapes (hybrids, gpt-oss, Gemma 4, DeepSeek),
  not in the default set (a second call; on an H100 the four batch-1 benches alone took 530 s, so
  family-batch1 and family-jobs run either half);
- draft: speculative decoding, `bench --draft ngram` (the verify call ragged, then as decode rows:
  MLXCEL_VERIFY_AS_ROWS=1) and `--draft model` (SmolLM2's extraction prompt at
  batch 1 against plain decoding and mlx-lm, then 64 rows with and without), and adapters:
  `bench.adapters` (256 rows over 4 LoRA adapters against one merged, the 1B shape); a third call
  (`--parts draft,adapters`), their tables in the parts' logs;
- lone-step: where a lone row's decode step goes (`bench.lone_step`: the 1B shape and the family
  shapes, mlxcel's dense and scheduler variants against mlx-lm), its table in its log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mlxcel.bench.harness import align_columns

SHAPES = "llama-3.2-1b,qwen2.5-0.5b"
FAMILY_SHAPES = "qwen3.5-0.8b,gpt-oss-small,gemma4-e2b-small,deepseek-v2-lite-small"
# each part's share of the budget (what a part leaves goes to the parts still to run: the short
# ones run first, so the ragged jobs, two mlx-lm runs of ~100 s on a GPU, get what they leave)
SHARES = {
    "jobs": 0.55,
    "batch1": 0.15,
    "readme": 0.15,
    "structured": 0.15,
    "families": 1.0,
    "family-batch1": 1.0,
    "family-jobs": 1.0,
    "draft": 0.6,
    "adapters": 1.0,
    "lone-step": 1.0,
}
DEFAULT_PARTS = "batch1,readme,structured,jobs"  # (2026-12-05, H100: jobs first was cut at 202 s)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mlxcel.bench.suite", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for each part's log and JSON")
    parser.add_argument("--parts", default=DEFAULT_PARTS, help=f"comma-separated, of {', '.join(SHARES)}")
    parser.add_argument("--budget", type=float, default=530.0, help="seconds for all parts together")
    parser.add_argument("--shapes", default=SHAPES, help="bench shapes of the jobs, batch1 and readme parts")
    parser.add_argument("--family-shapes", default=FAMILY_SHAPES, help="bench shapes of the families part")
    parser.add_argument("--rows", type=int, default=512, help="rows of the ragged jobs")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.parts.split(",")) - set(SHARES))
    if unknown:
        parser.error(f"--parts: unknown part {unknown[0]!r}; the parts are {', '.join(SHARES)}")
    return args


def commands(part: str, args: argparse.Namespace) -> list[list[str]]:
    """The part's command lines (run one after another within its time)."""
    out, py = args.out, sys.executable
    if part == "jobs":
        return [[py, "-m", "mlxcel.bench.jobs", "--models", args.shapes, "--rows", str(args.rows), "--max-rows", "256"]]
    batch1 = ["--prompt-lengths", "512", "--batch-sizes", "1", "--gen", "128", "--reps", "3"]
    if part == "batch1":
        return [[py, "-m", "mlxcel.bench", "--models", args.shapes, *batch1]]
    if part == "structured":
        orders = ["--orders", "split,thread,after", "--repeats", "3"]
        return [[py, "-m", "mlxcel.bench.structured", "--batch-sizes", "1,32", "--schemas", "records", *orders]]
    if part == "draft":  # prompt lookup with the ragged verify call, then as decode rows; then a draft model
        bench = [py, "-m", "mlxcel.bench", "--draft"]
        rows_form = ["env", "MLXCEL_VERIFY_AS_ROWS=1", *bench, "ngram", "--reps", "3"]
        return [[*bench, "ngram", "--reps", "3"], rows_form, [*bench, "model", "--reps", "3"]]
    if part == "adapters":
        return [[py, "-m", "mlxcel.bench.adapters", "--json", str(out / "adapters.json")]]
    if part == "lone-step":  # a model a command, so a cut keeps what ended before it
        shapes = [args.shapes.split(",")[0], *args.family_shapes.split(",")]
        return [[py, "-m", "mlxcel.bench.lone_step", "--models", shape] for shape in shapes]
    if part.startswith("famil"):  # a command a shape and bench, so a cut keeps what ended before it
        shapes = args.family_shapes.split(",")
        jobs = ["--rows", str(args.rows), "--max-rows", "256"]
        benches = []
        if part != "family-jobs":
            for shape in shapes:
                json_out = ["--json", str(out / f"families-batch1-{shape}.json")]
                benches.append([py, "-m", "mlxcel.bench", "--models", shape, *batch1, *json_out])
        if part != "family-batch1":
            for shape in shapes:
                json_out = ["--json", str(out / f"families-jobs-{shape}.json")]
                benches.append([py, "-m", "mlxcel.bench.jobs", "--models", shape, *jobs, *json_out])
        return benches
    return [readme_command(args)]


def readme_command(args: argparse.Namespace) -> list[str]:
    """`python -m mlxcel prompt=jsonl prompt.file=rows.jsonl` on the first shape, with the ragged
    job's rows as text of a word-level tokenizer (one word a token: the rows' exact lengths)."""
    from mlxcel.bench.checkpoints import prepare_checkpoint, read_model_config
    from mlxcel.bench.jobs import draw_job, prepare_tokenizer
    from mlxcel.checkpoints.loader import pick_dtype

    work_dir = Path(os.environ.get("MLXCEL_BENCH_DIR", "~/.cache/mlxcel-bench")).expanduser()
    shape = args.shapes.split(",")[0]
    folder = prepare_checkpoint(shape, work_dir, pick_dtype("auto"))
    vocab = read_model_config(folder)["vocab_size"]
    job = draw_job(args.rows, (32, 1024), (16, 512), vocab, [], seed=0)
    rows_file = args.out / "readme-rows.jsonl"
    with rows_file.open("w") as f:
        for i, (ids, tokens) in enumerate(zip(job.prompts, job.output_lengths)):
            f.write(json.dumps({"id": i, "prompt": " ".join(f"t{t}" for t in ids), "max_tokens": tokens}) + "\n")
    tokenizer = prepare_tokenizer(vocab, work_dir)
    return [
        *(sys.executable, "-m", "mlxcel", "model=hf", f"model.path={folder}", "tokenizer.kind=hf"),
        *(f"tokenizer.path={tokenizer}", "template=none", "prompt=jsonl", f"prompt.file={rows_file}"),
        *("decode.ignore_eos=true", "runner.progress=off", f"hydra.run.dir={args.out / 'readme-run'}"),
    ]


def run_part(part: str, args: argparse.Namespace, seconds: float) -> dict:
    """Run the part's commands within `seconds`; its figures, or why there are none."""
    start, log = time.perf_counter(), args.out / f"{part}.log"
    outcome = {"part": part, "status": "completed"}
    with log.open("w") as sink:
        for command in commands(part, args):
            if part in ("jobs", "batch1", "structured"):
                command = [*command, "--json", str(args.out / f"{part}.json")]
            left = seconds - (time.perf_counter() - start)
            sink.write("$ " + " ".join(command) + "\n")
            sink.flush()
            try:
                done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=max(left, 1))
            except subprocess.TimeoutExpired:
                outcome["status"] = f"cut at {seconds:.0f} s"
                break
            if done.returncode:
                outcome["status"] = f"failed (exit {done.returncode}, see {log.name})"
                break
    outcome["seconds"] = round(time.perf_counter() - start, 1)
    return outcome


def summarize(part: str, out: Path, seconds: float | None = None) -> list[tuple]:
    """(part, case, metric, mlxcel, mlx-lm, ratio) rows from a part's JSON (`seconds`: the part's wall time)."""
    rows = []
    paths = sorted(out.glob("families-*.json")) if part.startswith("famil") else [out / f"{part}.json"]
    for path in paths:
        if not path.exists():
            continue
        name, data = part, json.loads(path.read_text())
        for case in data.get("cases", []):  # bench (batch 1)
            label = f"{case['model']} b{case['batch']}"
            for metric in ("decode_tok_s", "prefill_tok_s", "ttft_ms"):
                values = [case["median"].get(e, {}).get(metric) for e in ("mlxcel", "mlx-lm")]
                rows.append((name, label, metric, *values, case.get("ratio", {}).get(metric)))
        for model in data.get("models", []):  # bench.jobs
            metrics = model.get("metrics", {})
            values = [metrics.get(e, {}).get("gen_tok_s") for e in ("mlxcel", "mlx-lm")]
            rows.append((name, model["model"], "gen_tok_s", *values, model.get("ratio", {}).get("gen_tok_s")))
        for case in data.get("results", []):  # bench.structured: constrained over free decode
            rows.append((name, f"b{case['batch']} {case['schema']}", "x free tok/s", None, None, case["ratio"]))
    if part == "readme" and seconds:
        stats_file = out / "readme-run" / "stats.json"
        if stats_file.exists():  # the whole process, as a user's job runs: loading, compiling, everything
            stats = json.loads(stats_file.read_text())
            label = f"max_rows {stats.get('max_rows', 'default')}"
            rows.append(("readme", label, "gen_tok_s", stats.get("generated_tokens", 0) / seconds, None, None))
    return rows


def format_number(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if abs(value) < 10 else f"{value:,.0f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    deadline, outcomes = time.perf_counter() + args.budget, []
    for i, part in enumerate(parts):
        left = deadline - time.perf_counter()
        later = sum(SHARES[p] for p in parts[i:])
        seconds = left * SHARES[part] / later  # its share of what is left: a part that ends early gives time on
        print(f"suite: {part} ({seconds:.0f} s at most) ...", file=sys.stderr, flush=True)
        outcomes.append(run_part(part, args, seconds))
        print(f"suite: {part}: {outcomes[-1]['status']} in {outcomes[-1]['seconds']} s", file=sys.stderr, flush=True)
    table = [row for part, o in zip(parts, outcomes) for row in summarize(part, args.out, o["seconds"])]
    header = ("part", "case", "metric", "mlxcel", "mlx-lm", "ratio")
    lines = align_columns([header, *[(*row[:3], *map(format_number, row[3:])) for row in table]], 3)
    print("\n".join(lines))
    (args.out / "suite.json").write_text(json.dumps({"parts": outcomes, "table": table}, indent=1))
    return 0 if all(o["status"] == "completed" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
