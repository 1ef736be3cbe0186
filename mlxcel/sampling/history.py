"""The history stages: repetition/frequency/presence penalties and DRY, on the device.

A batch keeps each row's history (prompt + generated tokens) as a right-aligned [B, H] int32
array, -1 where a row has fewer tokens. DRY also keeps `suffix` [B, H]: at each position, the
length of the longest common suffix of the history ending there and the history ending at the
last token. Appending token t updates it in O(H) (suffix'[p] = w[p] == t ? suffix[p-1] + 1 : 0),
so no step rescans the window and nothing is read back to the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

PAD = -1
DRY_MAX_TAIL_TOKENS = 20
FLOAT_MAX_LOG = 88.7228391


@dataclass(frozen=True)
class Breaker:
    head: int
    tail: tuple[int, ...]


def make_breakers(texts: list[str], encode: Callable[[str], list[int]] | None) -> list[Breaker]:
    """Pre-tokenize each breaker string into a head token and a tail (at most 20 tokens)."""
    if encode is None:
        return []
    breakers = []
    for text in texts:
        ids = list(encode(text))
        if ids:
            breakers.append(Breaker(ids[0], tuple(ids[1 : 1 + DRY_MAX_TAIL_TOKENS])))
    return list(dict.fromkeys(breakers))


def make_piece_encoder(tokenizer) -> Callable[[str], list[int]]:
    """Encode a string as it appears mid-text: no special tokens, and no leading token that is not
    part of it (SentencePiece's dummy-prefix space: "\n" -> ["▁", "<0x0A>"] becomes ["<0x0A>"])."""

    def encode(text: str) -> list[int]:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        while len(ids) > 1:
            head = tokenizer.decode(ids[:1])
            if head and text.startswith(head):
                break
            ids = ids[1:]
        return ids

    return encode


def make_exempt_mask(breakers: list[Breaker], vocab_size: int) -> mx.array | None:
    singles = [b.head for b in breakers if not b.tail and 0 <= b.head < vocab_size]
    if not singles:
        return None
    mask = np.zeros(vocab_size, dtype=bool)
    mask[singles] = True
    return mx.array(mask)


def make_history(histories: list[list[int]], width: int | None) -> np.ndarray:
    """[B, H] right-aligned; width None: as wide as the longest history."""
    width = width or max(len(h) for h in histories)
    out = np.full((len(histories), width), PAD, dtype=np.int32)
    for row, tokens in enumerate(histories):
        tail = tokens[-width:]
        if tail:
            out[row, width - len(tail) :] = tail
    return out


def make_suffix_lengths(history: np.ndarray) -> np.ndarray:
    """For each position p < last: the longest common suffix of history[..p] and history[..last]."""
    rows, width = history.shape
    out = np.zeros((rows, width), dtype=np.int32)
    for row in range(rows):
        h = history[row]
        alive = np.ones(width - 1, dtype=bool)
        for offset in range(width - 1):
            p = np.arange(width - 1) - offset
            ok = p >= 0
            alive &= ok & (h[np.maximum(p, 0)] == h[width - 1 - offset]) & (h[np.maximum(p, 0)] != PAD)
            if not alive.any():
                break
            out[row, : width - 1] += alive
    return out


def append_token(history: mx.array, suffix: mx.array | None, tokens: mx.array, bounded: bool):
    """The state after each row emits tokens[b]."""
    t = tokens.astype(mx.int32)[:, None]
    if bounded:
        history = mx.concatenate([history[:, 1:], t], axis=1)
        previous = suffix[:, :-1] if suffix is not None else None
    else:
        history = mx.concatenate([history, t], axis=1)
        if suffix is not None:
            previous = mx.concatenate([mx.zeros_like(suffix[:, :1]), suffix[:, :-1]], axis=1)
    if suffix is not None:
        match = history[:, :-1] == t
        suffix = mx.concatenate([mx.where(match, previous + 1, 0), mx.zeros_like(t)], axis=1)
    return history, suffix


def count_tokens(window: mx.array, vocab_size: int) -> mx.array:
    """[B, V] occurrences of each token in the window (pads ignored)."""
    rows = mx.arange(window.shape[0])[:, None]
    valid = window >= 0
    return (
        mx.zeros((window.shape[0], vocab_size), mx.float32)
        .at[rows, mx.where(valid, window, 0)]
        .add(valid.astype(mx.float32))
    )


def apply_penalties(
    x: mx.array, history: mx.array, repeat: float, frequency: float, presence: float, last_n: int
) -> mx.array:
    window = history if last_n < 0 else history[:, -last_n:]
    counts = count_tokens(window, x.shape[-1])
    penalized = mx.where(x <= 0, x * repeat, x / repeat) - counts * frequency - presence
    return mx.where(counts > 0, penalized, x)


def apply_dry(
    x: mx.array, history: mx.array, suffix: mx.array, params: dict, breakers: list[Breaker], exempt: mx.array | None
) -> mx.array:
    """exempt: [V] bool, the single-token breakers (never penalized)."""
    allowed, last_n = params["allowed_length"], params["last_n"]
    width = history.shape[-1]
    valid = history >= 0
    n_valid = valid.sum(axis=-1, keepdims=True)
    n = n_valid if last_n < 0 else mx.minimum(n_valid, last_n)  # N = min(tokens so far, last_n)
    start = width - n  # first position of the window
    position = mx.arange(width)[None, :]
    in_window = position >= start
    rep_limit = find_repeat_limit(history, in_window, n, breakers)
    # L_p, capped by the window start and by the nearest breaker
    length = mx.minimum(mx.minimum(suffix, position - start + 1), rep_limit)
    length = mx.where(in_window, length, 0)[:, :-1]
    follower = history[:, 1:]  # the token that followed each position
    counted = (length >= allowed) & (follower >= 0)
    rows = mx.arange(x.shape[0])[:, None]
    max_repeat = (
        mx.full(x.shape, -1, mx.int32).at[rows, mx.where(counted, follower, 0)].maximum(mx.where(counted, length, -1))
    )
    base = params["base"]
    max_exponent = int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0
    exponent = (max_repeat - allowed).astype(mx.float32)
    if max_exponent > 0:
        exponent = mx.minimum(exponent, max_exponent)
    penalty = params["multiplier"] * mx.power(base, exponent)
    hit = (max_repeat >= allowed) & (n > allowed) & (rep_limit >= allowed)
    if exempt is not None:
        hit = hit & ~exempt
    return mx.where(hit, x - penalty, x)


def find_repeat_limit(history: mx.array, in_window: mx.array, n: mx.array, breakers: list[Breaker]) -> mx.array:
    """[B, 1]: tokens after the nearest complete breaker in the window (N when there is none)."""
    width = history.shape[-1]
    if not breakers:
        return n
    longest = mx.full(history.shape, -1, mx.int32)  # per head position: the longest breaker matched there
    for breaker in breakers:
        match = (history == breaker.head) & in_window
        for offset, token in enumerate(breaker.tail, start=1):
            shifted = mx.concatenate([history[:, offset:], mx.full((history.shape[0], offset), -2, mx.int32)], axis=1)
            match = match & (shifted == token)
        longest = mx.where(match, mx.maximum(longest, len(breaker.tail)), longest)
    position = mx.arange(width)[None, :]
    nearest = mx.max(mx.where(longest >= 0, position, -1), axis=-1, keepdims=True)
    seq_len = mx.take_along_axis(longest, mx.maximum(nearest, 0), axis=-1)
    return mx.where(nearest >= 0, (width - 1 - nearest) - seq_len, n)
