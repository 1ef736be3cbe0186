"""An independent NumPy reference of docs/sampling.md, written from the spec (and llama.cpp's
loops), not from mlxcel's MLX code: one row at a time, float64, over an explicit candidate list
(token ids + logits) from which stages remove entries, as llama.cpp's llama_token_data_array.

A token whose logit is -inf is not a candidate (it can never be drawn).
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np


class Candidates:
    def __init__(self, ids: np.ndarray, logits: np.ndarray):
        keep = np.isfinite(logits)
        self.ids, self.logits = ids[keep], logits[keep].astype(np.float64)

    @classmethod
    def full(cls, logits: np.ndarray) -> Candidates:
        return cls(np.arange(len(logits)), np.asarray(logits, dtype=np.float64))

    def keep(self, mask: np.ndarray) -> None:
        self.ids, self.logits = self.ids[mask], self.logits[mask]

    def probs(self) -> np.ndarray:
        e = np.exp(self.logits - self.logits.max())
        return e / e.sum()

    def sorted_desc(self) -> np.ndarray:
        return np.argsort(-self.logits, kind="stable")

    def logprobs(self, vocab: int) -> np.ndarray:
        out = np.full(vocab, -np.inf)
        out[self.ids] = np.log(self.probs())
        return out


def ref_logit_bias(c: Candidates, bias: dict, suppress: list, eos: list, ignore_eos: bool) -> None:
    for token, value in bias.items():
        c.logits[c.ids == int(token)] += value
    banned = set(suppress) | (set(eos) if ignore_eos else set())
    c.keep(np.array([t not in banned for t in c.ids], dtype=bool) & np.isfinite(c.logits))


def ref_penalties(
    c: Candidates, history: list[int], repeat: float, frequency: float, presence: float, last_n: int
) -> None:
    if last_n == 0 or (repeat == 1.0 and frequency == 0.0 and presence == 0.0):
        return
    window = history if last_n < 0 else history[-last_n:]
    counts = Counter(window)
    for i, token in enumerate(c.ids):
        n = counts.get(int(token), 0)
        if n > 0:
            logit = c.logits[i]
            logit = logit * repeat if logit <= 0 else logit / repeat
            c.logits[i] = logit - n * frequency - presence


def ref_dry(
    c: Candidates, history: list[int], multiplier, base, allowed_length, last_n, breakers: list[tuple[int, tuple]]
) -> None:
    if multiplier == 0 or base < 1 or last_n == 0:
        return
    n = len(history) if last_n < 0 else min(len(history), last_n)
    if n <= allowed_length:
        return
    w = history[-n:]
    rep_limit = n
    for i in range(n):  # i tokens from the end
        longest = -1
        for head, tail in breakers:
            fits = head == w[n - 1 - i] and longest < len(tail) <= i
            if fits and all(tail[o] == w[n - i + o] for o in range(len(tail))):
                longest = len(tail)
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed_length:
        return
    max_repeat: dict[int, int] = {}
    for p in range(n - 1):
        length = 0
        while length <= p and w[p - length] == w[n - 1 - length]:
            length += 1
        length = min(length, rep_limit)
        if length >= allowed_length:
            follower = w[p + 1]
            max_repeat[follower] = max(max_repeat.get(follower, -1), length)
    singles = {head for head, tail in breakers if not tail}
    max_exponent = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    for i, token in enumerate(c.ids):
        token = int(token)
        if token in max_repeat and token not in singles:
            exponent = max_repeat[token] - allowed_length
            if max_exponent > 0:
                exponent = min(exponent, max_exponent)
            c.logits[i] -= multiplier * base**exponent


def ref_top_n_sigma(c: Candidates, n: float) -> None:
    if n <= 0 or len(c.ids) <= 1:
        return
    top, sigma = c.logits.max(), c.logits.std()
    c.keep(c.logits >= top - n * sigma)


def ref_top_k(c: Candidates, k: int, min_keep: int) -> None:
    if k <= 0:
        return
    k = max(k, min_keep)
    if k >= len(c.ids):
        return
    kth = np.sort(c.logits)[::-1][k - 1]
    c.keep(c.logits >= kth)  # ties at the boundary kept


def ref_typical_p(c: Candidates, p: float, min_keep: int) -> None:
    if p >= 1.0:
        return
    probs = c.probs()
    entropy = -(probs * np.log(probs)).sum()
    order = np.argsort(np.abs(-np.log(probs) - entropy), kind="stable")
    cum, last = 0.0, len(order)
    for i, idx in enumerate(order):
        cum += probs[idx]
        if cum > p and (min_keep == 0 or i >= min_keep - 1):
            last = i + 1
            break
    mask = np.zeros(len(c.ids), dtype=bool)
    mask[order[:last]] = True
    c.keep(mask)


def ref_top_p(c: Candidates, p: float, min_keep: int) -> None:
    if p >= 1.0:
        return
    order = c.sorted_desc()
    probs = c.probs()[order]
    cum, last = 0.0, len(order)
    for i in range(len(order)):
        cum += probs[i]
        if cum >= p and i + 1 >= min_keep:
            last = i + 1
            break
    mask = np.zeros(len(c.ids), dtype=bool)
    mask[order[:last]] = True
    c.keep(mask)


def ref_min_p(c: Candidates, p: float, min_keep: int) -> None:
    if p <= 0:
        return
    threshold = c.logits.max() + math.log(p)
    passing = c.logits >= threshold
    if passing.sum() >= max(min_keep, 1):
        c.keep(passing)
        return
    order = c.sorted_desc()
    kept = 1
    while kept < len(order) and (c.logits[order[kept]] >= threshold or kept < min_keep):
        kept += 1
    mask = np.zeros(len(c.ids), dtype=bool)
    mask[order[:kept]] = True
    c.keep(mask)


def ref_xtc(c: Candidates, u: float, probability: float, threshold: float, min_keep: int) -> None:
    if probability <= 0 or threshold > 0.5 or len(c.ids) < 2 or u > probability:
        return
    order = c.sorted_desc()
    probs = c.probs()[order]
    pos_last = 0
    for i in range(len(order)):
        if probs[i] >= threshold:
            pos_last = i
        else:
            break
    if len(order) - pos_last >= min_keep and pos_last > 0:
        mask = np.ones(len(c.ids), dtype=bool)
        mask[order[:pos_last]] = False
        c.keep(mask)


def ref_temperature(c: Candidates, value: float, spread: float = 0.0, exponent: float = 1.0) -> None:
    if spread > 0:
        if len(c.ids) <= 1:
            return
        probs = c.probs()
        entropy = -(probs * np.log(probs)).sum()
        value = max(0.0, value - spread) + 2 * spread * (entropy / math.log(len(c.ids))) ** exponent
    c.logits = c.logits / value


def ref_chain(
    logits: np.ndarray, processors: dict, min_keep: int = 0, history=None, breakers=(), eos=(), u_xtc: float = 1.0
) -> np.ndarray:
    """Log-probabilities [V] after the stages present in `processors` (docs/sampling.md defaults
    filled by the caller)."""
    c = Candidates.full(logits)
    p = processors
    if "logit_bias" in p:
        ref_logit_bias(
            c,
            p["logit_bias"].get("bias", {}),
            p["logit_bias"].get("suppress", []),
            list(eos),
            p["logit_bias"].get("ignore_eos", False),
        )
    if "penalties" in p:
        ref_penalties(c, history, **p["penalties"])
    if "dry" in p:
        d = p["dry"]
        ref_dry(c, history, d["multiplier"], d["base"], d["allowed_length"], d["last_n"], list(breakers))
    if "top_n_sigma" in p:
        ref_top_n_sigma(c, p["top_n_sigma"]["n"])
    if "top_k" in p:
        ref_top_k(c, p["top_k"]["k"], min_keep)
    if "typical_p" in p:
        ref_typical_p(c, p["typical_p"]["p"], min_keep)
    if "top_p" in p:
        ref_top_p(c, p["top_p"]["p"], min_keep)
    if "min_p" in p:
        ref_min_p(c, p["min_p"]["p"], min_keep)
    if "xtc" in p:
        ref_xtc(c, u_xtc, p["xtc"]["probability"], p["xtc"]["threshold"], min_keep)
    if "temperature" in p:
        t = p["temperature"]
        ref_temperature(c, t["value"], t.get("dynatemp_range", 0.0), t.get("dynatemp_exponent", 1.0))
    return c.logprobs(len(logits))


def ref_mirostat_v2_support(logits: np.ndarray, mu: float) -> np.ndarray:
    """The log-probabilities mirostat v2 draws from, given mu."""
    c = Candidates.full(logits)
    order = c.sorted_desc()
    surprise = -np.log2(c.probs()[order])
    cut = next((i for i, s in enumerate(surprise) if s > mu), len(order))
    mask = np.zeros(len(c.ids), dtype=bool)
    mask[order[: max(cut, 1)]] = True
    c.keep(mask)
    return c.logprobs(len(logits))


def ref_mirostat_v1_support(logits: np.ndarray, mu: float) -> np.ndarray:
    c = Candidates.full(logits)
    order = c.sorted_desc()
    probs = c.probs()[order]
    num = den = 0.0
    for i in range(min(100 - 1, len(order) - 1)):
        t = math.log((i + 2) / (i + 1))
        b = math.log(probs[i] / probs[i + 1])
        num, den = num + t * b, den + t * t
    s = num / den
    e = s - 1
    k = (e * 2**mu / (1 - len(logits) ** (-e))) ** (1 / s)
    k = max(int(min(k, len(logits))), 1)
    ref_top_k(c, k, 0)
    return c.logprobs(len(logits))


def ref_adaptive_p_logits(logits: np.ndarray, weight: float, total: float, target: float) -> np.ndarray:
    c = Candidates.full(logits)
    probs = c.probs()
    aim = min(max(2 * min(max(target, 0.0), 1.0) - weight / total, 0.0), 1.0)
    d = np.abs(probs - aim) / 0.3
    c.logits = 5 - 10 * d**2 / (1 + d)
    return c.logprobs(len(logits))
