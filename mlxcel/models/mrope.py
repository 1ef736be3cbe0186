"""Multimodal rotary embedding (M-RoPE) of Qwen2-VL and Qwen2.5-VL.

Each position has three ids (temporal, height, width). The head's frequency pairs are split in
three sections (`mrope_section`, e.g. [16, 24, 24] of head_dim 128's 64 pairs): each section
turns by its own id. A text token's three ids are equal, so text is plain RoPE; an image's
tokens take (t, row, column) ids on its merged-patch grid, and the text after an image resumes
at the image's largest id + 1. After the prompt, every row therefore decodes as plain RoPE
shifted by a per-row delta (`make_mrope_positions` returns it), which is what the KV cache's
position shift carries into the fused RoPE kernel.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx import nn

from mlxcel.errors import MlxcelError


class MRoPE(nn.Module):
    """Rotate-half RoPE taking either a start offset (int or [B], the fused kernel) or explicit
    [3, B, L] position ids (a prefill that holds images)."""

    def __init__(self, dims: int, base: float, sections: list[int]):
        super().__init__()
        if 2 * sum(sections) != dims:
            raise MlxcelError(
                f"mrope_section {sections} covers {2 * sum(sections)} of head_dim {dims} (it must cover all of it, in "
                "pairs)"
            )
        self.dims = dims
        self.base = base
        self._inv_freq = mx.array(1.0 / base ** (np.arange(0, dims, 2, dtype=np.float32) / dims))
        self._section = mx.array(np.repeat(np.arange(3), sections))  # which id turns each pair

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if isinstance(offset, mx.array) and offset.ndim == 3:
            return self.apply_positions(x, offset)
        return mx.fast.rope(x, self.dims, traditional=False, base=self.base, scale=1.0, offset=offset)

    def apply_positions(self, x: mx.array, positions: mx.array) -> mx.array:
        """x [B, heads, L, D] rotated by positions [3, B, L], as transformers' Qwen2-VL does."""
        angles = positions.astype(mx.float32)[..., None] * self._inv_freq  # [3, B, L, D/2]
        picked = mx.take_along_axis(angles, mx.broadcast_to(self._section, angles.shape[1:])[None], axis=0)[0]
        angles = mx.concatenate([picked, picked], axis=-1)[:, None]  # [B, 1, L, D]
        cos, sin = mx.cos(angles).astype(x.dtype), mx.sin(angles).astype(x.dtype)
        half = x.shape[-1] // 2
        rotated = mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin


def make_vision_positions(start: int, grid_thw: tuple[int, int, int], merge_size: int) -> np.ndarray:
    """[3, t*h*w / merge^2]: (t, row, column) ids of an image's merged patches, from `start`."""
    t, h, w = grid_thw[0], grid_thw[1] // merge_size, grid_thw[2] // merge_size
    tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    return np.stack([tt, hh, ww]).reshape(3, -1) + start


def make_mrope_positions(
    token_ids: list[int], image_grids: list[tuple[int, int, int]], image_token_id: int, merge_size: int
) -> tuple[np.ndarray, int]:
    """One row's [3, L] position ids and its decode delta (next position - L), as transformers'
    get_rope_index: each run of image tokens is the next image of `image_grids`."""
    ids = np.asarray(token_ids)
    pieces, position, cursor, grids = [], 0, 0, iter(image_grids)
    while cursor < len(ids):
        is_image = ids[cursor] == image_token_id
        end = cursor
        while end < len(ids) and (ids[end] == image_token_id) == is_image:
            end += 1
        if is_image:
            grid = next(grids, None)
            if grid is None:
                raise MlxcelError(f"the prompt holds more image placeholder runs than images ({len(image_grids)})")
            piece = make_vision_positions(position, grid, merge_size)
            if piece.shape[1] != end - cursor:
                raise MlxcelError(
                    f"an image of grid {tuple(grid)} needs {piece.shape[1]} placeholder tokens, the prompt holds "
                    f"{end - cursor}"
                )
            position += max(grid[1], grid[2]) // merge_size
        else:
            piece = np.broadcast_to(np.arange(position, position + end - cursor), (3, end - cursor))
            position += end - cursor
        pieces.append(piece)
        cursor = end
    if next(grids, None) is not None:
        raise MlxcelError(f"{len(image_grids)} images but fewer image placeholder runs in the prompt")
    positions = np.concatenate(pieces, axis=1) if pieces else np.zeros((3, 0), np.int64)
    delta = int(positions.max()) + 1 - len(ids) if len(ids) else 0
    return positions, delta
