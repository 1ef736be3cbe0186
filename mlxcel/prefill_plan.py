"""PrefillPlan: how a prompt is split into prefill pieces. A pure function of lengths and
capabilities, shared by the runner and (later) the server so both split prompts the same way.

The four rules (docs/design.md, "PrefillPlan"):
1. a prefix adopted from the prompt cache is not run again;
2. the history boundary (the chat without its generation prompt) is always a cut, so a cache
   snapshot can correspond exactly to those tokens; the span up to it is cut into chunks like
   the rest (a long history is no unbounded piece);
3. pieces hold at most `chunk_size` tokens when the model supports multi-piece prefill and the
   input is tokens (pre-merged embeddings go in one piece);
4. with `tile_size` set and a model that supports padded prefill, pieces are right-padded to
   a multiple of the tile; a piece ending at the history boundary is never padded, even when
   the boundary is the end of the prompt. The chunk size rounds down to whole tiles (to one
   tile when it is smaller), so only a span's last piece pads, by less than one tile.
"""

from __future__ import annotations

import platform
import re
from dataclasses import dataclass

DEFAULT_CHUNK_SIZE = 2048  # single-sequence generation
BUSY_CHUNK_SIZE = 512  # while other rows are decoding (server)
# prefill.tile_size=auto on GPUs with Neural Accelerators. Not measured (no Metal here): the
# accelerators multiply whole tiles of rows, and 32 is the smallest tile that keeps a piece's
# padding under one tile for every chunk size we ship (docs: "Tile alignment").
NEURAL_ACCELERATOR_TILE = 32


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


def has_neural_accelerators(architecture: str, macos_version: str) -> bool:
    """Apple GPUs with Neural Accelerators, by MLX's own test for its NAX kernels
    (metal::is_nax_available): architecture generation >= 17 (>= 18 for phone-class 'p' parts,
    e.g. applegpu_g17s is M5's) and macOS 26.2 or later."""
    match = re.fullmatch(r"applegpu_g(\d+)([a-z])", architecture)
    if match is None or not macos_version:
        return False
    version = tuple(int(part) for part in macos_version.split(".")[:2] if part.isdigit())
    return version >= (26, 2) and int(match.group(1)) >= (18 if match.group(2) == "p" else 17)


def choose_tile_size(setting: int | str | None) -> int | None:
    """prefill.tile_size: a number, None (no padding), or "auto": NEURAL_ACCELERATOR_TILE on a
    Metal GPU with Neural Accelerators, no padding elsewhere (CPU, CUDA, older Apple GPUs)."""
    if setting != "auto":
        return setting
    import mlx.core as mx

    if not mx.metal.is_available() or mx.default_device() != mx.gpu:
        return None
    architecture = str(mx.device_info().get("architecture", ""))
    return NEURAL_ACCELERATOR_TILE if has_neural_accelerators(architecture, platform.mac_ver()[0]) else None


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
    tile = tile_size if (tile_size and supports_padded and input_is_tokens) else None
    if not can_split:
        pad = (-(total_tokens - adopted_prefix)) % tile if tile and history_boundary != total_tokens else 0
        return PrefillPlan((PrefillPiece(adopted_prefix, total_tokens, pad),), adopted_prefix)
    step = max(tile, chunk_size // tile * tile) if tile else chunk_size
    cuts = [history_boundary] if adopted_prefix < history_boundary < total_tokens else []
    pieces: list[PrefillPiece] = []
    start = adopted_prefix
    for span_end in [*cuts, total_tokens]:
        while start < span_end:
            end = min(start + step, span_end)
            pad = (-(end - start)) % tile if tile and end != history_boundary else 0
            pieces.append(PrefillPiece(start, end, pad))
            start = end
    return PrefillPlan(tuple(pieces), adopted_prefix)
