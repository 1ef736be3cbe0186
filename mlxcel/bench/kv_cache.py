"""What a quantized KV cache (`decode.kv_bits`) costs in accuracy, against the unquantized cache.

    python -m mlxcel.bench.kv_cache [--model PATH] [--bits 8,6,4,3,2] [--tokens 96]

A fixed text is fed through the model one token at a time after a short prompt (teacher
forcing, so every position sees the same history in both runs); at each position the next-token
distributions of the quantized and unquantized caches are compared: largest logit difference,
mean KL divergence, how often the argmax agrees. Then a greedy continuation from the prompt
says after how many tokens the text first differs. Prints one table row per bit width.
"""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx
import numpy as np

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import DirectEngine, GenerationRequest, RowRequest
from mlxcel.models.quantized_cache import quantize_caches
from mlxcel.sampling import Sampler
from mlxcel.tokenizer.loader import load_tokenizer

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press. Within fifty years printing shops had spread "
    "to more than two hundred cities across Europe, and the price of books fell so far that ordinary merchants "
    "could own them. Scholars argue about how much this changed the way people thought, but few doubt that "
    "it changed how quickly ideas could travel from one country to another."
)
PROMPT_TOKENS = 16


def teacher_forced_logits(model, ids: list[int], kv_bits: int | None, group_size: int) -> np.ndarray:
    cache = model.make_cache(1)
    if kv_bits:
        cache = quantize_caches(cache, kv_bits, group_size)
    out = [model(mx.array([ids[:PROMPT_TOKENS]]), cache)[0, -1]]
    for token in ids[PROMPT_TOKENS:-1]:
        out.append(model(mx.array([[token]]), cache)[0, -1])
    return np.array(mx.stack(out).astype(mx.float32))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def greedy(model, prompt: list[int], n: int, kv_bits: int | None, group_size: int) -> list[int]:
    request = GenerationRequest(
        [RowRequest(prompt)], Sampler("greedy"), max_tokens=n, kv_bits=kv_bits, kv_group_size=group_size
    )
    return DirectEngine(model, max_context=4096).generate(request).results[0].token_ids


def first_difference(a: list[int], b: list[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return str(i)
    return f"none in {min(len(a), len(b))}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded:smollm2")
    parser.add_argument("--bits", default="8,6,4,3,2")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=96, help="greedy tokens to compare")
    args = parser.parse_args(argv)
    loaded = load_model(args.model, dtype="float32" if mx.default_device() == mx.cpu else "bfloat16")
    model = loaded.model
    ids = load_tokenizer(loaded.path, gguf_metadata=loaded.gguf_metadata).encode(TEXT)
    reference = teacher_forced_logits(model, ids, None, args.group_size)
    ref_lp = log_softmax(reference)
    ref_greedy = greedy(model, ids[:PROMPT_TOKENS], args.tokens, None, args.group_size)
    print(
        f"{args.model}: {len(ids) - PROMPT_TOKENS} teacher-forced positions after a {PROMPT_TOKENS}-token "
        "prompt; group "
        ""
        f"size {args.group_size}"
    )
    print("| kv_bits | max abs logit diff | mean KL (nats) | argmax agrees | greedy text first differs at token |")
    print("| --- | --- | --- | --- | --- |")
    for bits in (int(b) for b in args.bits.split(",")):
        got = teacher_forced_logits(model, ids, bits, args.group_size)
        lp = log_softmax(got)
        kl = (np.exp(ref_lp) * (ref_lp - lp)).sum(-1).mean()
        agree = (got.argmax(-1) == reference.argmax(-1)).mean()
        diff = first_difference(ref_greedy, greedy(model, ids[:PROMPT_TOKENS], args.tokens, bits, args.group_size))
        print(f"| {bits} | {np.abs(got - reference).max():.3f} | {kl:.5f} | {100 * agree:.1f}% | {diff} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
