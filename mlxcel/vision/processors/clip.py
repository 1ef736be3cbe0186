"""CLIP image preprocessing (LLaVA-1.5 and every checkpoint whose preprocessor_config.json names
CLIPImageProcessor), equal to transformers' Pillow backend (`CLIPImageProcessorPil`).

The order and dtypes are transformers': RGB conversion (alpha composited onto white), Pillow
resize on uint8, center crop on uint8 (zero padding when the image is smaller than the crop),
rescale in float64 cast to float32, normalize in float32. The steps are shared with
llava_next.py, whose tiles go through the same chain."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from PIL import Image

from mlxcel.errors import ConfigError, ConfigIssue
from mlxcel.vision.images import VisionInputError
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
    is_positive_int,
    make_issue,
    parse_bool,
    parse_channel_floats,
    parse_resample,
    parse_rescale_factor,
)

BOOL_KEYS = ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb")
FEATURE_STRATEGIES = ("default", "full")


@dataclass(frozen=True)
class SizeSpec:
    """A resize target: `shortest_edge` (optionally capped by `longest_edge`) or exact `height` x `width`."""

    shortest_edge: int | None = None
    longest_edge: int | None = None
    height: int | None = None
    width: int | None = None


@dataclass(frozen=True)
class ClipImageConfig(ImageConfig):
    """preprocessor_config.json of a CLIP image processor; defaults are transformers' class defaults."""

    do_resize: bool = True
    size: SizeSpec = SizeSpec(shortest_edge=224)
    resample: int = 3
    do_center_crop: bool = True
    crop_size: tuple[int, int] = (224, 224)  # (height, width)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    do_convert_rgb: bool = True

    @classmethod
    def parse_fields(cls, raw: dict[str, Any], issues: list[ConfigIssue]) -> dict[str, Any]:
        return parse_clip_fields(raw, issues)


# --- parsing: each parser appends ConfigIssues and returns the parsed value (or the default) ---


def parse_clip_fields(raw: dict[str, Any], issues: list[ConfigIssue]) -> dict[str, Any]:
    """The ClipImageConfig fields present in `raw`; JSON null means the default, as in transformers."""
    defaults = {f.name: f.default for f in fields(ClipImageConfig)}
    values = {key: parse_bool(raw, key, defaults[key], issues) for key in BOOL_KEYS}
    values["size"] = parse_size(raw.get("size"), defaults["size"], issues)
    values["crop_size"] = parse_crop_size(raw.get("crop_size"), defaults["crop_size"], issues)
    values["resample"] = parse_resample(raw.get("resample"), defaults["resample"], issues)
    values["rescale_factor"] = parse_rescale_factor(raw.get("rescale_factor"), defaults["rescale_factor"], issues)
    values["image_mean"] = parse_channel_floats(raw, "image_mean", defaults["image_mean"], issues, positive=False)
    values["image_std"] = parse_channel_floats(raw, "image_std", defaults["image_std"], issues, positive=True)
    return values


def parse_size(value: object, default: SizeSpec, issues: list[ConfigIssue]) -> SizeSpec:
    """transformers' get_size_dict with default_to_square=False: an int is the shortest edge, [h, w] exact."""
    message = (
        "must be a positive int (shortest edge), [height, width], {shortest_edge}, "
        "{shortest_edge, longest_edge} or {height, width} with positive int values"
    )
    if value is None:
        return default
    if is_positive_int(value):
        return SizeSpec(shortest_edge=value)
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(map(is_positive_int, value)):
        return SizeSpec(height=value[0], width=value[1])
    legal = ({"shortest_edge"}, {"shortest_edge", "longest_edge"}, {"height", "width"})
    if isinstance(value, dict) and set(value) in legal and all(map(is_positive_int, value.values())):
        return SizeSpec(**value)
    issues.append(make_issue("size", message, value))
    return default


def parse_crop_size(value: object, default: tuple[int, int], issues: list[ConfigIssue]) -> tuple[int, int]:
    """transformers' get_size_dict with default_to_square=True: an int is a square crop."""
    if value is None:
        return default
    if is_positive_int(value):
        return (value, value)
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(map(is_positive_int, value)):
        return (value[0], value[1])
    if isinstance(value, dict) and set(value) == {"height", "width"} and all(map(is_positive_int, value.values())):
        return (value["height"], value["width"])
    issues.append(
        make_issue("crop_size", "must be a positive int, [height, width] or {height, width} with positive ints", value)
    )
    return default


# --- image steps, on channels-last uint8/float arrays (elementwise equal to transformers' CHW math) ---


def plan_resize_size(height: int, width: int, size: SizeSpec) -> tuple[int, int]:
    """(new_height, new_width) as transformers' PilBackend.resize computes it."""
    if size.shortest_edge and size.longest_edge:
        return plan_capped_size(height, width, size.shortest_edge, size.longest_edge)
    if size.shortest_edge:
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = size.shortest_edge, int(size.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)
    return (size.height, size.width)


def plan_capped_size(height: int, width: int, shortest: int, longest: int) -> tuple[int, int]:
    """transformers' get_size_with_aspect_ratio: shortest edge, unless the long edge would pass `longest`."""
    raw_size = None
    if max(height, width) / min(height, width) * shortest > longest:
        raw_size = longest * min(height, width) / max(height, width)
        shortest = round(raw_size)
    if (height <= width and height == shortest) or (width <= height and width == shortest):
        return (height, width)
    scale = raw_size if raw_size is not None else shortest
    if width < height:
        return (int(scale * height / width), shortest)
    return (shortest, int(scale * width / height))


def apply_center_crop(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' center_crop: the offset rounds down; a too-small image is zero-padded (centered, ceil) first."""
    orig_height, orig_width = image.shape[:2]
    top, left = (orig_height - height) // 2, (orig_width - width) // 2
    if top >= 0 and left >= 0:
        return image[top : top + height, left : left + width]
    new_height, new_width = max(height, orig_height), max(width, orig_width)
    padded = np.zeros((new_height, new_width) + image.shape[2:], dtype=image.dtype)
    top_pad, left_pad = math.ceil((new_height - orig_height) / 2), math.ceil((new_width - orig_width) / 2)
    padded[top_pad : top_pad + orig_height, left_pad : left_pad + orig_width] = image
    top, left = top + top_pad, left + left_pad
    return padded[max(0, top) : min(new_height, top + height), max(0, left) : min(new_width, left + width)]


def apply_clip_steps(image: np.ndarray, config: ClipImageConfig, source: str | None = None) -> np.ndarray:
    """resize -> center crop -> rescale -> normalize of one [H, W, 3] uint8 array; returns [3, H, W] float32."""
    if config.do_resize:
        height, width = plan_resize_size(*image.shape[:2], config.size)
        if height <= 0 or width <= 0:
            raise VisionInputError(
                f"{describe_source(source)}: resizing {image.shape[1]}x{image.shape[0]} gives {width}x{height}"
            )
        image = apply_resize(image, height, width, config.resample)
    if config.do_center_crop:
        image = apply_center_crop(image, *config.crop_size)
    if config.do_rescale:
        image = apply_rescale(image, config.rescale_factor)
    if config.do_normalize:
        image = apply_normalize(image, config.image_mean, config.image_std)
    return np.ascontiguousarray(image.transpose(2, 0, 1), dtype=np.float32)


def preprocess_images(
    images: list[Image.Image], config: ClipImageConfig, sources: list[str] | None = None
) -> np.ndarray:
    """pixel_values [n, 3, H, W] float32, equal to CLIPImageProcessorPil(**config)(images)."""
    if not images:
        raise VisionInputError("no images to preprocess")
    names = list(sources) if sources else [None] * len(images)
    arrays = [apply_convert_rgb(image, config.do_convert_rgb, name) for image, name in zip(images, names)]
    processed = [apply_clip_steps(array, config, name) for array, name in zip(arrays, names)]
    shapes = {array.shape for array in processed}
    if len(shapes) > 1:  # only without resize/crop to a fixed size; transformers cannot stack these either
        raise VisionInputError(
            f"images preprocess to different shapes {sorted(shapes)}; enable do_center_crop or a fixed size"
        )
    return np.stack(processed)


def count_image_tokens(
    image_size: int,
    patch_size: int,
    vision_feature_select_strategy: str = "default",
    num_additional_image_tokens: int = 1,
) -> int:
    """`<image>` placeholders per image, as LlavaProcessor expands them: one per vision patch, plus the CLS
    token (llava-hf's processor_config.json sets num_additional_image_tokens=1) unless the "default"
    strategy drops it."""
    check_token_args(image_size, patch_size, vision_feature_select_strategy, num_additional_image_tokens)
    count = (image_size // patch_size) ** 2 + num_additional_image_tokens
    return count - 1 if vision_feature_select_strategy == "default" else count


def check_token_args(image_size: int, patch_size: int, strategy: str, num_additional: int) -> None:
    issues = []
    if not is_positive_int(image_size):
        issues.append(ConfigIssue("vision_config.image_size", "must be a positive int", image_size))
    if not (is_positive_int(patch_size) and (not is_positive_int(image_size) or patch_size <= image_size)):
        issues.append(
            ConfigIssue("vision_config.patch_size", "must be a positive int no larger than image_size", patch_size)
        )
    if strategy not in FEATURE_STRATEGIES:
        issues.append(ConfigIssue("vision_feature_select_strategy", "must be 'default' or 'full'", strategy))
    if not (is_int(num_additional) and num_additional >= 0):
        issues.append(ConfigIssue("num_additional_image_tokens", "must be an int >= 0", num_additional))
    if issues:
        raise ConfigError(issues, hint="fix the checkpoint's config.json / processor_config.json")
