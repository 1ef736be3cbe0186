"""Where a verify step's time goes (issue 45), on a bench checkpoint with no real weights needed.

    python scripts/profile_verify.py [--model qwen2.5-0.5b] [--draft-tokens 3] [--tokens 128] [--dtype auto]
                                     [--work-dir DIR]

One row, a 700-token prompt of random ids, greedy. Plain decoding runs first; its tokens then
stand in as every step's draft (cut to what the row may still draw), so every drafted token is
accepted and each verify step emits draft-tokens + 1 tokens: the machinery's cost at full
acceptance, on random weights, in one device call (no SmolLM2 to carry). The verify call runs
ragged, then as decode rows (MLXCEL_VERIFY_AS_ROWS). Per form: the decode phase's ms per step,
the scheduler's host work and device waits per step (the whole run's, its prefill included),
whether the tokens equal plain decoding's, then cProfile's top functions by own time for one
drafted run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time

import mlx.core as mx

from mlxcel.bench.__main__ import add_checkpoint_arguments
from mlxcel.bench.checkpoints import dtype_name, prepare_checkpoint
from mlxcel.checkpoints.loader import load_model, pick_dtype
from mlxcel.config import DraftConfig
from mlxcel.engine import GenerationRequest, RowRequest, scheduler
from mlxcel.sampling import Sampler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-0.5b", help="a bench checkpoint name or an HF folder")
    parser.add_argument("--draft-tokens", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    add_checkpoint_arguments(parser)
    args = parser.parse_args()
    dtype = pick_dtype(args.dtype)
    folder = prepare_checkpoint(args.model, args.work_dir.expanduser(), dtype)
    model = load_model(str(folder), dtype=dtype_name(dtype)).model
    prompt = [random.Random(0).randrange(5, model.args.vocab_size) for _ in range(700)]

    def run(draft: DraftConfig | None):
        request = GenerationRequest([RowRequest(prompt, row_id=0)], Sampler("greedy"), args.tokens, draft=draft)
        state = scheduler.BatchScheduler(model, len(prompt) + args.tokens + 8, 1).generate(request)
        mx.synchronize()
        return state

    plain_tokens = run(None).results[0].token_ids

    def propose_plain_tokens(self, batch, table):
        row, drawn = batch.rows[0], len(batch.rows[0].result.token_ids)
        draft = plain_tokens[drawn : drawn + min(args.draft_tokens, self.draft_room(batch, 0, table))]
        return [list(draft)] if draft and row.drafts is not None else None

    scheduler.BatchScheduler.propose_drafts = propose_plain_tokens
    draft = DraftConfig(method="ngram", tokens=args.draft_tokens)
    for label, config, as_rows in (("plain", None, False), ("ragged", draft, False), ("rows", draft, True)):
        scheduler.VERIFY_AS_ROWS = as_rows
        run(config)  # warm-up: traces and kernel builds
        runs = sorted((run(config) for _ in range(3)), key=lambda s: s.timings.end - s.timings.first_token)
        state = runs[1]  # the median by decode time
        steps = max(state.decode_steps, 1)
        decode_ms = 1000 * (state.timings.end - state.timings.first_token)
        print(
            f"{label:7s} {steps} steps, {decode_ms / steps:6.2f} ms a step after the first token; per step "
            f"host {1000 * state.host_seconds / steps:5.2f} ms, waiting {1000 * state.wait_seconds / steps:5.2f} ms; "
            f"tokens equal plain's: {state.results[0].token_ids == plain_tokens}",
            flush=True,
        )
        if config is not None:
            profile = cProfile.Profile()
            began = time.perf_counter()
            profile.runcall(run, config)
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(15)
            print(f"  profiled run {1000 * (time.perf_counter() - began):.0f} ms:\n{out.getvalue()[-3000:]}")


if __name__ == "__main__":
    main()
