"""The sampler chain, first part: greedy and a seeded categorical draw with temperature.

The chain runs batch-wide on the device with no host read. Each row draws from its own
random stream, derived from (seed, prompt id, sample index, position), so a row's tokens do
not depend on which other rows share its batch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import mlx.core as mx


def derive_row_seed(seed: int, row_id: object, sample_index: int, position: int) -> int:
    digest = hashlib.blake2b(f"{seed}|{row_id}|{sample_index}|{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True)
class RowKey:
    """Identifies a row's random stream; the position is added per step."""

    row_id: object
    sample_index: int = 0
    seed: int | None = None  # a per-row seed (JSONL `seed`) replaces the sampler's


@dataclass(frozen=True)
class Sampler:
    draw: str  # "greedy" | "categorical"
    temperature: float = 1.0
    seed: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.draw == "greedy"

    def row_seed(self, row: RowKey, position: int) -> int:
        seed = self.seed if row.seed is None else row.seed
        return derive_row_seed(seed, row.row_id, row.sample_index, position)

    def __call__(self, logits: mx.array, rows: list[RowKey], positions: list[int]) -> mx.array:
        """logits [B, V] -> token ids [B] (lazy)."""
        if self.is_greedy:
            return mx.argmax(logits, axis=-1)
        scaled = logits.astype(mx.float32) * (1.0 / self.temperature)
        noise = mx.stack(
            [
                mx.random.gumbel(shape=(logits.shape[-1],), key=mx.random.key(self.row_seed(r, pos)))
                for r, pos in zip(rows, positions)
            ]
        )
        return mx.argmax(scaled + noise, axis=-1)  # Gumbel-max: an exact draw from softmax(scaled)


def make_sampler(chain: list[dict], seed: int = 0) -> Sampler:
    """Build from the effective chain (config order): optional temperature stage, then the draw."""
    draw = next((stage for stage in chain if stage["stage"] == "draw"), {"kind": "greedy"})
    temperature = next((stage["value"] for stage in chain if stage["stage"] == "temperature"), 1.0)
    if draw["kind"] == "greedy" or temperature <= 0:  # temperature <= 0 means greedy, as llama.cpp
        return Sampler("greedy", seed=seed)
    if draw["kind"] != "categorical":
        raise ValueError(f"sampler.selector.kind={draw['kind']!r} is not implemented yet")
    return Sampler("categorical", temperature=float(temperature), seed=seed)
