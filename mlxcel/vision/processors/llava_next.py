"""LLaVA-NeXT (v1.6) any-resolution preprocessing, equal to transformers' `LlavaNextImageProcessorPil`,
and the `<image>` placeholder count `LlavaNextProcessor` expands to.

Per image: pick the grid pinpoint that keeps most of the image (select_best_resolution), resize to
fit it keeping the aspect ratio, zero-pad (black, centred, the odd pixel on the bottom/right) to the
pinpoint, cut crop-sized tiles row by row; the first tile is the whole image squashed to a square.
Every tile then runs the CLIP chain (clip.py). Images with fewer tiles are zero-padded (after
normalisation) to the batch's largest tile count; `patch_counts` says how many are real."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from mlxcel.errors import ConfigIssue
from mlxcel.vision.images import VisionInputError
from mlxcel.vision.processors.clip import (
    ClipImageConfig,
    apply_clip_steps,
    check_token_args,
    parse_clip_fields,
)
from mlxcel.vision.processors.common import (
    apply_convert_rgb,
    apply_resize,
    is_positive_int,
    make_issue,
    parse_bool,
)

DEFAULT_GRID_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


@dataclass(frozen=True)
class LlavaNextImageConfig(ClipImageConfig):
    """A CLIP config plus the any-res grid; defaults are LlavaNextImageProcessorPil's class defaults."""

    image_grid_pinpoints: tuple[tuple[int, int], ...] = DEFAULT_GRID_PINPOINTS  # (height, width) each
    do_pad: bool = True

    @classmethod
    def parse_fields(cls, raw: dict[str, Any], issues: list[ConfigIssue]) -> dict[str, Any]:
        values = parse_clip_fields(raw, issues)
        values["image_grid_pinpoints"] = parse_pinpoints(raw.get("image_grid_pinpoints"), issues)
        values["do_pad"] = parse_bool(raw, "do_pad", True, issues)
        return values

    @property
    def base_size(self) -> tuple[int, int]:
        """The square (or exact) size the whole-image tile is squashed to."""
        if self.size.shortest_edge:
            return (self.size.shortest_edge, self.size.shortest_edge)
        return (self.size.height, self.size.width)

    @property
    def tile_size(self) -> int:
        """The side of the square tiles the padded image is cut into: transformers' patch_size, the crop height."""
        return self.crop_size[0]


@dataclass(frozen=True)
class LlavaNextBatch:
    pixel_values: np.ndarray  # [n_images, max_patches, 3, H, W] float32
    image_sizes: np.ndarray  # [n_images, 2] int64: original (height, width)
    patch_counts: list[int]  # real tiles per image (base tile included); the rest is zero padding


def parse_pinpoints(value: object, issues: list[ConfigIssue]) -> tuple[tuple[int, int], ...]:
    if value is None:
        return DEFAULT_GRID_PINPOINTS
    valid = isinstance(value, (list, tuple)) and len(value) > 0
    valid = valid and all(isinstance(p, (list, tuple)) and len(p) == 2 and all(map(is_positive_int, p)) for p in value)
    if not valid:
        issues.append(
            make_issue(
                "image_grid_pinpoints", "must be a non-empty list of [height, width] pairs of positive ints", value
            )
        )
        return DEFAULT_GRID_PINPOINTS
    return tuple((p[0], p[1]) for p in value)


# --- planning (pure functions of sizes) ---


def plan_best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """transformers' select_best_resolution: most original pixels kept, then least padding; first wins ties
    (so a sliver that every pinpoint shrinks to zero pixels still gets the least wasteful one)."""
    best, best_effective, best_wasted = None, 0, float("inf")
    for pin_height, pin_width in pinpoints:
        scale = min(pin_width / width, pin_height / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = pin_width * pin_height - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (pin_height, pin_width), effective, wasted
    return best


def plan_patch_output_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """transformers' get_patch_output_size: fit inside `target` keeping the aspect ratio (ceil, capped)."""
    target_height, target_width = target
    scale_w, scale_h = target_width / width, target_height / height
    if scale_w < scale_h:
        return (min(math.ceil(height * scale_w), target_height), target_width)
    return (target_height, min(math.ceil(width * scale_h), target_width))


def plan_padding(size: tuple[int, int], target: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """((top, bottom), (left, right)): centred, the odd pixel goes to the bottom/right."""
    top, extra_y = divmod(target[0] - size[0], 2)
    left, extra_x = divmod(target[1] - size[1], 2)
    return (top, top + extra_y), (left, left + extra_x)


def plan_patch_count(height: int, width: int, config: LlavaNextImageConfig) -> int:
    """Tiles for an image of this size, the base tile included (the model's image_size_to_num_patches)."""
    best = plan_best_resolution(height, width, config.image_grid_pinpoints)
    tile = config.tile_size
    return 1 + math.ceil(best[0] / tile) * math.ceil(best[1] / tile)


# --- image steps ---


def make_image_tiles(image: np.ndarray, config: LlavaNextImageConfig, source: str | None = None) -> list[np.ndarray]:
    """[base, tile_0_0, tile_0_1, ...] as uint8 [H, W, 3] arrays, before the per-tile CLIP chain."""
    height, width = image.shape[:2]
    best = plan_best_resolution(height, width, config.image_grid_pinpoints)
    fitted = apply_resize(image, *plan_patch_output_size(height, width, best), config.resample)
    padded = np.pad(fitted, plan_padding(fitted.shape[:2], best) + ((0, 0),), mode="constant", constant_values=0)
    tile = config.tile_size
    tiles = [
        padded[top : top + tile, left : left + tile]
        for top in range(0, best[0], tile)
        for left in range(0, best[1], tile)
    ]
    base = apply_resize(image, *config.base_size, config.resample)
    return [base] + tiles


def apply_batch_padding(stacks: list[np.ndarray]) -> np.ndarray:
    """Zero tiles appended so every image has the batch's largest tile count (transformers' _pad_for_batching)."""
    max_tiles = max(len(stack) for stack in stacks)
    padded = [np.pad(stack, ((0, max_tiles - len(stack)), (0, 0), (0, 0), (0, 0))) for stack in stacks]
    return np.stack(padded)


def preprocess_images(
    images: list[Image.Image], config: LlavaNextImageConfig, sources: list[str] | None = None
) -> LlavaNextBatch:
    """Equal to LlavaNextImageProcessorPil(**config)(images): pixel_values, image_sizes, plus patch_counts.
    With do_pad false transformers returns a ragged list; its entries are pixel_values[i, :patch_counts[i]]."""
    if not images:
        raise VisionInputError("no images to preprocess")
    names = list(sources) if sources else [None] * len(images)
    stacks, sizes = [], []
    for image, name in zip(images, names):
        array = apply_convert_rgb(image, config.do_convert_rgb, name)
        tiles = make_image_tiles(array, config, name)
        stacks.append(np.stack([apply_clip_steps(tile, config, name) for tile in tiles]))
        sizes.append(array.shape[:2])
    return LlavaNextBatch(
        pixel_values=apply_batch_padding(stacks),
        image_sizes=np.array(sizes, dtype=np.int64),
        patch_counts=[len(stack) for stack in stacks],
    )


# --- <image> placeholder count ---


def count_image_tokens(
    orig_height: int,
    orig_width: int,
    config: LlavaNextImageConfig,
    *,
    patch_size: int,
    image_size: int,
    vision_feature_select_strategy: str = "default",
    num_additional_image_tokens: int = 1,
) -> int:
    """`<image>` placeholders for one image, as LlavaNextProcessor expands them: the base tile's features
    (+CLS, dropped by the "default" strategy), the unpadded any-res grid, and one newline per grid row.
    patch_size and image_size come from the vision config; llava-hf's processor_config.json sets
    num_additional_image_tokens=1."""
    check_token_args(image_size, patch_size, vision_feature_select_strategy, num_additional_image_tokens)
    best = plan_best_resolution(orig_height, orig_width, config.image_grid_pinpoints)
    side = image_size // patch_size
    grid_height, grid_width = side * (best[0] // image_size), side * (best[1] // image_size)
    unpadded_height, unpadded_width = plan_unpadded_grid(orig_height, orig_width, grid_height, grid_width)
    count = unpadded_height * unpadded_width + unpadded_height + side * side + num_additional_image_tokens
    return count - 1 if vision_feature_select_strategy == "default" else count


def plan_unpadded_grid(height: int, width: int, grid_height: int, grid_width: int) -> tuple[int, int]:
    """transformers' _get_unpadded_features: the feature grid without the rows/columns that saw only padding."""
    if width / height > grid_width / grid_height:
        new_height = int(round(height * (grid_width / width), 7))
        grid_height -= (grid_height - new_height) // 2 * 2
    else:
        new_width = int(round(width * (grid_height / height), 7))
        grid_width -= (grid_width - new_width) // 2 * 2
    return grid_height, grid_width
