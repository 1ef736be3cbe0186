"""Speculative decoding against plain decoding and mlx-lm: python -m mlxcel.bench --draft ngram|model

    python -m mlxcel.bench --draft ngram [--gen 128] [--reps 3] [--draft-rows 64] [--draft-tokens auto]
    python -m mlxcel.bench --draft model   (the draft: the same SmolLM2 quantized to 4 bits at load)

An extraction prompt: a list of invoice lines (drawn from --seed) and the instruction to copy out
the ones in euros, exactly, rendered with the model's chat template, so the answer copies spans of
the prompt (what prompt lookup is for). Batch 1: mlxcel's plain decode, mlxcel with prompt lookup
(decode.draft.method=ngram) and mlx-lm's plain decode (`generate_step`), --reps alternating reps
each after a warm-up, --gen greedy tokens each (no EOS stop, so every run decodes as many), the
same weights (the embedded SmolLM2 exported as an HF folder, as python -m mlxcel.bench uses it).
Then the same job at --draft-rows rows (one document each), with and without prompt lookup, to show
what drafting costs where the batch, not the launches, bounds a step.

Prints decode tok/s (tokens after the first over the time after it), TTFT, acceptance (accepted of
drafted tokens) and tokens a verify step, the ratios, and whether the drafted runs drew plain decoding's tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics

import mlx.core as mx

from mlxcel.bench.harness import log
from mlxcel.bench.peers import generate_mlx_lm, load_peer, schedule_mlxcel, synchronize_streams
from mlxcel.config import DraftConfig
from mlxcel.engine import GenerationRequest, RowRequest
from mlxcel.sampling import Sampler

COMPANIES = ["Northwind Traders", "Contoso Ltd", "Fabrikam Inc", "Tailspin Toys", "Litware GmbH", "Adatum SA"]
CURRENCIES = ["EUR", "USD", "GBP"]
MONTHS = ["January", "March", "May", "July", "September", "November"]
INSTRUCTION = "Copy every invoice above that is in EUR, one per line, exactly as written."


def make_document(seed: int, lines: int = 14) -> str:
    rng = random.Random(seed)
    rows = []
    for _ in range(lines):
        seller, buyer = rng.sample(COMPANIES, 2)
        amount = f"{rng.randint(100, 9999):,}.{rng.randint(0, 99):02d}"
        day, month, year = rng.randint(1, 28), rng.choice(MONTHS), rng.choice([2023, 2024])
        rows.append(
            f"Invoice {rng.randint(1000, 9999)}: {seller} billed {buyer} {amount} {rng.choice(CURRENCIES)} "
            f"on {day} {month} {year}, payable within {rng.choice([14, 30, 60])} days."
        )
    return "Invoices:\n" + "\n".join(rows)


def render_prompts(count: int, seed: int) -> list[list[int]]:
    """The extraction prompts as the runner renders them (the embedded SmolLM2's chat template)."""
    from mlxcel.api import load_config
    from mlxcel.jobs import JobRow, Sample
    from mlxcel.pipeline import Pipeline

    pipeline = Pipeline.load(load_config(None, ["runner.device=cpu"]), load_weights=False)  # (tokenizer, template)
    samples = [
        Sample(JobRow(id=i, messages=[{"role": "user", "content": f"{make_document(seed + i)}\n\n{INSTRUCTION}"}]))
        for i in range(count)
    ]
    return [prepared.prompt.token_ids for prepared in pipeline.prepare(samples)]


def run_mlxcel(model, prompts: list[list[int]], gen: int, draft: DraftConfig | None, draft_model=None):
    rows = [RowRequest(prompt, row_id=i) for i, prompt in enumerate(prompts)]
    request = GenerationRequest(rows, Sampler("greedy"), max_tokens=gen, draft=draft)
    synchronize_streams()
    run = schedule_mlxcel(model, request, max(map(len, prompts)) + gen + 1, draft_model)
    synchronize_streams()
    return run


def make_draft(args: argparse.Namespace, folder, dtype: mx.Dtype, model) -> tuple[DraftConfig, object, str]:
    """(decode.draft, the draft model or None, what the drafted runs are called). --draft model: on
    a GPU the same SmolLM2 quantized to 4 bits at load (a cheaper model that mostly agrees with the
    target; as deep as the target, so at batch 1 a drafted token costs about a target step's
    launches); on the CPU, where MLX's quantized matmuls are ~10x slower than OpenBLAS's fp32 ones,
    the model itself (every draft accepted: the machinery's cost, not a gain)."""
    if args.draft == "ngram":
        return DraftConfig(method="ngram", tokens=args.draft_tokens), None, "mlxcel ngram"
    from mlxcel.checkpoints.loader import load_model
    from mlxcel.engine.draft_model import DraftModel

    quantized = load_model(
        str(folder), dtype=str(dtype).replace("mlx.core.", ""), quantize={"bits": 4, "group_size": 64}
    )
    config = DraftConfig(method="model", model_path="smollm2 4-bit", tokens=args.draft_tokens)
    return config, DraftModel(quantized.model, model.args.vocab_size), "mlxcel draft"


def describe(runs: list, label: str) -> dict:
    metrics = [r.metrics() for r in runs]
    figures = {key: statistics.median(m[key] for m in metrics) for key in ("decode_tok_s", "ttft_ms")}
    log(f"{label}: decode {figures['decode_tok_s']:.1f} tok/s, TTFT {figures['ttft_ms']:.0f} ms")
    return figures


def describe_steps(run, label: str) -> str:
    """Where a step's time goes (the whole run, prefill included, over its decode steps): a verify
    step waits for its tokens before the next can be built, a plain step overlaps the two."""
    loop = run.loop
    steps = max(loop["decode_steps"], 1)
    return (
        f"  {label}: {loop['decode_steps']} decode steps, per step {1000 * loop['host_s'] / steps:.2f} ms host "
        f"work, {1000 * loop['wait_s'] / steps:.2f} ms waiting on the device"
    )


def bench_draft(args: argparse.Namespace, folder, dtype: mx.Dtype) -> str:
    """The batch-1 comparison and the --draft-rows job; returns the printed table."""
    model = load_peer("mlxcel", folder, dtype).model
    draft, draft_model, label = make_draft(args, folder, dtype, model)
    peer = load_peer("mlx-lm", folder, dtype)
    prompt = render_prompts(1, args.seed)
    engines = {
        "mlxcel": lambda: run_mlxcel(model, prompt, args.gen, None),
        label: lambda: run_mlxcel(model, prompt, args.gen, draft, draft_model),
        "mlx-lm": lambda: generate_mlx_lm(peer.model, prompt, args.gen),
    }
    for run in engines.values():
        run()  # warm-up
    runs = {name: [] for name in engines}
    for _ in range(args.reps):
        for name, run in engines.items():
            runs[name].append(run())
    figures = {name: describe(done, name) for name, done in runs.items()}
    # drafted against plain is the exactness check; mlx-lm's tokens part from ours at near-ties in
    # bf16 (other kernels), so theirs is reported apart
    plain_tokens = [done.token_ids for done in runs["mlxcel"]]
    same = all(done.token_ids == plain_tokens[0] for done in runs["mlxcel"] + runs[label])
    peer_same = all(done.token_ids == plain_tokens[0] for done in runs["mlx-lm"])
    drafts = runs[label][-1].drafts  # (the last rep's: every rep drafts the same)
    accepted, drafted, steps = (sum(f[key] for f in drafts) for key in ("accepted", "drafted", "steps"))
    plain, spec, peer_tok_s = (figures[n]["decode_tok_s"] for n in ("mlxcel", label, "mlx-lm"))
    lines = [
        f"batch 1, an extraction prompt of {len(prompt[0])} tokens, {args.gen} greedy tokens, medians of "
        f"{args.reps} reps:",
        *(
            f"  {name:13s} decode {f['decode_tok_s']:8.1f} tok/s   TTFT {f['ttft_ms']:7.0f} ms"
            for name, f in figures.items()
        ),
        f"  {draft.method} drafts: {accepted} of {drafted} drafted tokens accepted ({accepted / max(drafted, 1):.0%}),"
        f" {(accepted + steps) / max(steps, 1):.2f} tokens a verify step",
        f"  drafted / plain {spec / plain:.2f}x   drafted / mlx-lm {spec / peer_tok_s:.2f}x   "
        f"drafted runs' tokens equal plain's: {'yes' if same else 'NO'}",
        f"  mlx-lm's tokens equal ours: {'yes' if peer_same else 'no'}",
        *(describe_steps(runs[name][-1], name) for name in ("mlxcel", label)),
    ]
    if args.draft_rows > 1:
        job = render_prompts(args.draft_rows, args.seed + 100)
        run_mlxcel(model, job[: min(4, len(job))], 4, draft, draft_model)  # warm-up of the batch shapes
        plain_job = run_mlxcel(model, job, args.gen, None)
        spec_job = run_mlxcel(model, job, args.gen, draft, draft_model)
        same_rows = sum(a == b for a, b in zip(plain_job.token_ids, spec_job.token_ids))
        rates = [run.tokens_after_first / run.decode_s for run in (plain_job, spec_job)]
        lines.append(
            f"{args.draft_rows} rows (a document each): decode {rates[0]:.1f} tok/s plain, {rates[1]:.1f} with "
            f"{draft.method} drafts ({rates[1] / rates[0]:.2f}x); rows whose tokens equal plain's: "
            f"{same_rows}/{len(job)}"
        )
    return "\n".join(lines)
