"""How many tokens a verify step draws under each draft-size rule, replayed on plain decoding's tokens.

    python scripts/replay_drafts.py [--prompts 5] [--tokens 256] [--dtype auto] [--work-dir DIR]

A greedy row's verify step keeps its draft up to the first token plain decoding disagrees with, so
once plain decoding's tokens are known (the embedded SmolLM2 on the bench's extraction prompts,
one run each) any draft-size rule can be replayed without the model: prompt lookup's proposals
from the real index, the accepted counts from the plain tokens. Prints, per rule and `tokens`,
the steps taken (verify and plain), the drafted tokens, and tokens per step: what a step's cost
(at batch 1 on a GPU, its launches, nearly the same for any width) is divided by.
"""

from __future__ import annotations

import argparse

from mlxcel.bench.__main__ import add_checkpoint_arguments
from mlxcel.bench.checkpoints import prepare_checkpoint
from mlxcel.bench.draft import render_prompts, run_mlxcel
from mlxcel.bench.peers import load_peer
from mlxcel.checkpoints.loader import pick_dtype
from mlxcel.engine.drafts import NgramIndex, RowDrafts, count_accepted


def replay(prompt: list[int], plain: list[int], drafts: RowDrafts) -> tuple[int, int, int]:
    """(steps, verify steps, drafted tokens) to draw `plain` after its first token."""
    generated, steps, verify, drafted = plain[:1], 0, 0, 0
    while len(generated) < len(plain):
        room = len(plain) - len(generated) - 1
        draft = []
        if drafts.paused:
            drafts.paused -= 1
        elif room > 0:
            draft = drafts.propose(prompt, generated, room)
        accepted = count_accepted(draft, plain[len(generated) :]) if draft else 0
        if draft:
            drafts.record(len(draft), accepted)
            drafted += len(draft)
            verify += 1
        generated = plain[: len(generated) + accepted + 1]
        steps += 1
    return steps, verify, drafted


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=256)
    add_checkpoint_arguments(parser)
    args = parser.parse_args()
    dtype = pick_dtype(args.dtype)
    folder = prepare_checkpoint("smollm2", args.work_dir.expanduser(), dtype)
    model = load_peer("mlxcel", folder, dtype).model
    seeds = [0] + [100 + i for i in range(args.prompts - 1)]
    rows = []
    for seed in seeds:
        prompt = render_prompts(1, seed)
        rows.append((prompt[0], run_mlxcel(model, prompt, args.tokens, None).token_ids[0]))
    rules = {"lookup (cheap)": True, "draft model (accepted + 1)": False}
    print(f"{len(rows)} extraction prompts (seeds {seeds}), {args.tokens} greedy tokens each")
    print(f"{'rule':28s} {'tokens':>6s} {'steps':>6s} {'verify':>6s} {'drafted':>7s} {'tok/step':>8s}")
    for name, cheap in rules.items():
        for size in (4, 8, 16):
            totals = [0, 0, 0]
            for prompt, plain in rows:
                drafts = RowDrafts(NgramIndex(2, 4), size, adaptive=True, cheap=cheap)
                totals = [a + b for a, b in zip(totals, replay(prompt, plain, drafts))]
            drawn = sum(len(plain) - 1 for _, plain in rows)
            steps, verify, drafted = totals
            print(f"{name:28s} {size:6d} {steps:6d} {verify:6d} {drafted:7d} {drawn / steps:8.2f}")


if __name__ == "__main__":
    main()
