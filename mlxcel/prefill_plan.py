"""PrefillPlan: how a prompt is split into prefill pieces. A pure function of lengths and
capabilities, shared by the runner and (later) the server so both split prompts the same way.

The four rules (SPEC.md, "PrefillPlan"):
1. a prefix adopted from the prompt cache is not run again;
2. the span up to the history boundary (the chat without its generation prompt) is one
   unpadded piece, so a cache snapshot can correspond exactly to those tokens;
3. the rest is cut into pieces of at most `chunk_size` tokens when the model supports
   multi-piece prefill and the input is tokens (pre-merged embeddings go in one piece);
4. with `tile_size` set and a model that supports padded prefill, pieces are right-padded to
   a multiple of the tile; a piece ending at the history boundary is never padded.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CHUNK_SIZE = 2048  # single-sequence generation
BUSY_CHUNK_SIZE = 512  # while other rows are decoding (server)


@dataclass(frozen=True)
class PrefillPiece:
    start: int  # first prompt position of the piece
    end: int  # one past the last real position
    pad: int = 0  # padding tokens appended after the real ones (trimmed from the cache after)

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class PrefillPlan:
    pieces: tuple[PrefillPiece, ...]
    adopted_prefix: int = 0

    @property
    def padded_tokens(self) -> int:
        return sum(piece.pad for piece in self.pieces)


def plan_prefill(
    total_tokens: int,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    adopted_prefix: int = 0,
    history_boundary: int = 0,
    tile_size: int | None = None,
    supports_multi_piece: bool = True,
    supports_padded: bool = True,
    input_is_tokens: bool = True,
) -> PrefillPlan:
    if total_tokens <= 0:
        raise ValueError("a prompt needs at least one token")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    if not 0 <= adopted_prefix < total_tokens:
        raise ValueError(f"adopted_prefix must be in [0, {total_tokens}), got {adopted_prefix}")
    can_split = supports_multi_piece and input_is_tokens
    pieces: list[PrefillPiece] = []
    start = adopted_prefix
    if can_split and adopted_prefix < history_boundary < total_tokens:
        pieces.append(PrefillPiece(start, history_boundary))
        start = history_boundary
    step = chunk_size if can_split else total_tokens
    tile = tile_size if (tile_size and supports_padded and input_is_tokens) else None
    while start < total_tokens:
        end = min(start + step, total_tokens)
        pad = (-(end - start)) % tile if tile else 0
        pieces.append(PrefillPiece(start, end, pad))
        start = end
    return PrefillPlan(tuple(pieces), adopted_prefix)

