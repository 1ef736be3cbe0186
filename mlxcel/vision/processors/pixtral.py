"""Pixtral / Mistral 3 image preprocessing, equal to transformers' Pillow backend
(`PixtralImageProcessorPil`; Mistral-Small-3.1 checkpoints name the same processor), and the
`[IMG]` / `[IMG_BREAK]` / `[IMG_END]` token layout `PixtralProcessor` builds per image (transformers
has no separate Mistral3 processor: Mistral-Small-3.1's processor_config.json names
PixtralProcessor with spatial_merge_size 2).

Per image, in transformers' order and dtypes: RGB conversion (alpha composited onto white), resize
so the image fits `size.longest_edge` (never enlarged) keeping its aspect ratio, each side then
rounded *up* to a multiple of the patch size (Pillow resize on uint8), optional center crop, rescale
in float64 cast to float32, normalize in float32. Every image keeps its own size: the output is one
[3, H, W] float32 array per image plus image_sizes [n, 2] (height, width); `pad_images` gives
transformers' zero-padded batch.

The patch size the resize rounds to is not always the checkpoint's: `PixtralProcessor` passes its
own `patch_size * spatial_merge_size` to the image processor (Mistral-Small-3.1: 14 * 2 = 28, so
every image is whole 2 x 2 merge windows). Call with `patch_size=` to do the same."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from mlxcel.errors import ConfigIssue
from mlxcel.vision.images import MAX_IMAGE_PIXELS as MAX_INPUT_PIXELS
from mlxcel.vision.images import VisionInputError
from mlxcel.vision.processors.clip import apply_center_crop, parse_crop_size
from mlxcel.vision.processors.common import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ImageConfig,
    apply_convert_rgb,
    apply_normalize,
    apply_rescale,
    apply_resize,
    describe_source,
    is_int,
    make_issue,
    parse_bool,
    parse_channel_floats,
    parse_resample,
    parse_rescale_factor,
)

BOOL_KEYS = ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb")
# Token names PixtralProcessor uses unless processor_config.json renames them.
IMAGE_TOKEN, IMAGE_BREAK_TOKEN, IMAGE_END_TOKEN = "[IMG]", "[IMG_BREAK]", "[IMG_END]"


@dataclass(frozen=True)
class PixtralImageConfig(ImageConfig):
    """preprocessor_config.json of a Pixtral image processor; defaults are transformers' class defaults
    (Pixtral-12B: longest edge 1024, patch 16; Mistral-Small-3.1 writes 1540 and 14)."""

    max_size: tuple[int, int] = (1024, 1024)  # (height, width) box: size.longest_edge twice, or size {height, width}
    patch_size: tuple[int, int] = (16, 16)  # (height, width)
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3
    crop_size: tuple[int, int] = (224, 224)  # only with do_center_crop (no Pixtral checkpoint sets it)
    do_resize: bool = True
    do_center_crop: bool = False
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @classmethod
    def parse_fields(cls, raw: dict[str, Any], issues: list[ConfigIssue]) -> dict[str, Any]:
        return parse_pixtral_fields(raw, issues)


# --- parsing: each parser appends ConfigIssues and returns the parsed value (or the default) ---


def parse_pixtral_fields(raw: dict[str, Any], issues: list[ConfigIssue]) -> dict[str, Any]:
    defaults = PixtralImageConfig()
    values: dict[str, Any] = {key: parse_bool(raw, key, getattr(defaults, key), issues) for key in BOOL_KEYS}
    values["max_size"] = parse_max_size(raw.get("size"), defaults.max_size, issues)
    values["patch_size"] = parse_patch_size(raw.get("patch_size"), defaults.patch_size, issues)
    values["crop_size"] = parse_crop_size(raw.get("crop_size"), defaults.crop_size, issues)
    values["resample"] = parse_resample(raw.get("resample"), defaults.resample, issues)
    values["rescale_factor"] = parse_rescale_factor(raw.get("rescale_factor"), defaults.rescale_factor, issues)
    values["image_mean"] = parse_channel_floats(raw, "image_mean", defaults.image_mean, issues, positive=False)
    values["image_std"] = parse_channel_floats(raw, "image_std", defaults.image_std, issues, positive=True)
    return values


def is_positive_int(value: object) -> bool:
    return is_int(value) and value > 0


def parse_max_size(value: object, default: tuple[int, int], issues: list[ConfigIssue]) -> tuple[int, int]:
    """The box an image must fit, as transformers' PixtralImageProcessorPil.resize reads `size`:
    {longest_edge} (checkpoints; a shortest_edge beside it is ignored), {height, width}, or an int
    (get_size_dict makes it a square)."""
    if value is None:
        return default
    if is_positive_int(value):
        return (value, value)
    if isinstance(value, dict):
        if set(value) in ({"longest_edge"}, {"shortest_edge", "longest_edge"}) and is_positive_int(
            value["longest_edge"]
        ):
            return (value["longest_edge"], value["longest_edge"])
        if set(value) == {"height", "width"} and all(map(is_positive_int, value.values())):
            return (value["height"], value["width"])
    message = "must be {longest_edge}, {height, width} or an int, with positive int values"
    issues.append(make_issue("size", message, value))
    return default


def parse_patch_size(value: object, default: tuple[int, int], issues: list[ConfigIssue]) -> tuple[int, int]:
    if value is None:
        return default
    if is_positive_int(value):
        return (value, value)
    if isinstance(value, dict) and set(value) == {"height", "width"} and all(map(is_positive_int, value.values())):
        return (value["height"], value["width"])
    issues.append(make_issue("patch_size", "must be a positive int or {height, width} with positive ints", value))
    return default


# --- sizes and the token layout ---


def get_resize_output_image_size(
    height: int, width: int, max_size: tuple[int, int], patch_size: tuple[int, int]
) -> tuple[int, int]:
    """transformers' pixtral get_resize_output_image_size: shrink (never enlarge) to fit the box,
    flooring both sides, then round each side up to a whole number of patches."""
    max_height, max_width = max_size
    patch_height, patch_width = patch_size
    ratio = max(height / max_height, width / max_width)
    if ratio > 1:
        height = int(math.floor(height / ratio))
        width = int(math.floor(width / ratio))
    return ((height - 1) // patch_height + 1) * patch_height, ((width - 1) // patch_width + 1) * patch_width


def as_pair(value: int | tuple[int, int] | list[int]) -> tuple[int, int]:
    return (value, value) if is_int(value) else (int(value[0]), int(value[1]))


def count_grid(height: int, width: int, patch_size: int, merge_size: int = 1) -> tuple[int, int]:
    """(rows, columns) of image tokens for a preprocessed image: one per merge_size x merge_size patches."""
    step = patch_size * merge_size
    return height // step, width // step


def count_image_tokens(height: int, width: int, patch_size: int, merge_size: int = 1) -> int:
    """`[IMG]` tokens (= projected features) of a preprocessed height x width image."""
    rows, cols = count_grid(height, width, patch_size, merge_size)
    return rows * cols


def expand_image_tokens(
    height: int,
    width: int,
    image_token_id: int,
    break_token_id: int,
    end_token_id: int,
    patch_size: int,
    merge_size: int = 1,
    source: str | None = None,
) -> list[int]:
    """The ids PixtralProcessor.replace_image_token puts in place of one image's `[IMG]` (Pixtral-12B:
    patch 16, merge 1; Mistral-Small-3.1: patch 14, merge 2): per row of merged patches, that many
    `[IMG]` then `[IMG_BREAK]`; the very last `[IMG_BREAK]` becomes `[IMG_END]`. `height`, `width` are
    the preprocessed image's (image_sizes). Only the `[IMG]` positions take image features."""
    rows, cols = count_grid(height, width, patch_size, merge_size)
    if rows <= 0 or cols <= 0:  # transformers fails here with an IndexError (or a row of breaks only)
        raise VisionInputError(
            f"{describe_source(source)}: {width}x{height} holds no {patch_size * merge_size}x{patch_size * merge_size} "
            "patch window, so it has no image tokens (enable do_resize or use a larger image)"
        )
    ids = ([image_token_id] * cols + [break_token_id]) * rows
    ids[-1] = end_token_id
    return ids


# --- image steps, on channels-last uint8/float arrays (elementwise equal to transformers' CHW math) ---


def apply_pixtral_steps(
    image: np.ndarray, config: PixtralImageConfig, source: str | None = None, patch_size: tuple[int, int] | None = None
) -> np.ndarray:
    """resize -> center crop -> rescale -> normalize of one [H, W, 3] uint8 array; returns [3, H, W] float32."""
    if config.do_resize:
        height, width = get_resize_output_image_size(*image.shape[:2], config.max_size, patch_size or config.patch_size)
        if height <= 0 or width <= 0:  # transformers: "Size must contain 'height' and 'width' keys ..."
            raise VisionInputError(
                f"{describe_source(source)}: {image.shape[1]}x{image.shape[0]} shrinks to {width}x{height} to fit "
                f"{config.max_size[1]}x{config.max_size[0]}; the aspect ratio is too extreme (crop or pad the image)"
            )
        image = apply_resize(image, height, width, config.resample)
    if config.do_center_crop:
        image = apply_center_crop(image, *config.crop_size)
    if config.do_rescale:
        image = apply_rescale(image, config.rescale_factor)
    if config.do_normalize:
        image = apply_normalize(image, config.image_mean, config.image_std)
    return np.ascontiguousarray(image.transpose(2, 0, 1), dtype=np.float32)


def preprocess_image(
    image: Image.Image,
    config: PixtralImageConfig | dict[str, Any],
    source: str | None = None,
    patch_size: int | tuple[int, int] | None = None,
    max_input_pixels: int = MAX_INPUT_PIXELS,
) -> np.ndarray:
    """One image: pixel values [3, H, W] float32 (H, W whole patches when do_resize is on)."""
    config = PixtralImageConfig.coerce(config)
    array = apply_convert_rgb(image, config.do_convert_rgb, source, max_input_pixels)
    return apply_pixtral_steps(array, config, source, as_pair(patch_size) if patch_size is not None else None)


def preprocess_images(
    images: list[Image.Image],
    config: PixtralImageConfig | dict[str, Any],
    sources: list[str] | None = None,
    patch_size: int | tuple[int, int] | None = None,
    max_input_pixels: int = MAX_INPUT_PIXELS,
) -> tuple[list[np.ndarray], np.ndarray]:
    """([3, H_i, W_i] float32 per image, image_sizes [n, 2] int64 as (height, width)), equal to
    PixtralImageProcessorPil(**config)(images) with each image cropped out of the padded batch.
    `patch_size` overrides the config's for the resize (PixtralProcessor: patch_size * spatial_merge_size);
    `sources` name the images in error messages."""
    config = PixtralImageConfig.coerce(config)
    names = list(sources) if sources else [None] * len(images)
    pixel_values = [
        preprocess_image(image, config, name, patch_size, max_input_pixels) for image, name in zip(images, names)
    ]
    image_sizes = np.array([values.shape[1:] for values in pixel_values], dtype=np.int64).reshape(-1, 2)
    return pixel_values, image_sizes


def pad_images(pixel_values: list[np.ndarray]) -> np.ndarray:
    """transformers' padded batch [n, 3, max H, max W]: each image top-left, zeros elsewhere."""
    if not pixel_values:
        return np.zeros((0, 3, 0, 0), np.float32)
    height = max(values.shape[1] for values in pixel_values)
    width = max(values.shape[2] for values in pixel_values)
    batch = np.zeros((len(pixel_values), pixel_values[0].shape[0], height, width), dtype=np.float32)
    for out, values in zip(batch, pixel_values):
        out[:, : values.shape[1], : values.shape[2]] = values
    return batch
