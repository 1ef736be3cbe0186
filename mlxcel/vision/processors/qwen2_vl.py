"""Qwen2-VL / Qwen2.5-VL image preprocessing, equal to transformers' Pillow backend
(`Qwen2VLImageProcessorPil`; Qwen2.5-VL checkpoints name the same processor).

Per image, in transformers' order and dtypes: RGB conversion (alpha composited onto white),
`smart_resize` to a multiple of patch_size * merge_size within [min_pixels, max_pixels], Pillow
resize on uint8, rescale in float64 cast to float32, normalize in float32, then patchify: the
image is repeated temporal_patch_size times and cut into patches listed in merge-window order,
each flattened as (channel, time, row, column). Every image keeps its own size (no padding), so
the batch output is the images' patch rows concatenated plus one (t, h, w) grid per image."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from mlxcel.errors import ConfigIssue
from mlxcel.vision.images import MAX_IMAGE_PIXELS, VisionInputError
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

BOOL_KEYS = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb")
INT_KEYS = ("patch_size", "temporal_patch_size", "merge_size")
MAX_ASPECT_RATIO = 200  # smart_resize refuses longer/shorter side ratios above this
# Input images above this many pixels are refused before any work (the loader's limit, also for
# images handed over already decoded): decoding and resampling 64 MP costs seconds and ~1 GB.
MAX_INPUT_PIXELS = MAX_IMAGE_PIXELS


@dataclass(frozen=True)
class Qwen2VLImageConfig(ImageConfig):
    """preprocessor_config.json of a Qwen2-VL image processor; defaults are transformers' class defaults."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merge window of patches."""
        return self.patch_size * self.merge_size

    @classmethod
    def parse_fields(cls, raw: dict[str, Any], issues: list[ConfigIssue]) -> dict[str, Any]:
        return parse_qwen2_vl_fields(raw, issues)


# --- parsing: each parser appends ConfigIssues and returns the parsed value (or the default) ---


def parse_qwen2_vl_fields(raw: dict[str, Any], issues: list[ConfigIssue]) -> dict[str, Any]:
    defaults = Qwen2VLImageConfig()
    values: dict[str, Any] = {key: parse_bool(raw, key, getattr(defaults, key), issues) for key in BOOL_KEYS}
    for key in INT_KEYS:
        values[key] = parse_int(raw, key, getattr(defaults, key), 1, issues)
    values.update(parse_pixel_range(raw, defaults, issues))
    values["resample"] = parse_resample(raw.get("resample"), defaults.resample, issues)
    values["rescale_factor"] = parse_rescale_factor(raw.get("rescale_factor"), defaults.rescale_factor, issues)
    values["image_mean"] = parse_channel_floats(raw, "image_mean", defaults.image_mean, issues, positive=False)
    values["image_std"] = parse_channel_floats(raw, "image_std", defaults.image_std, issues, positive=True)
    return values


def parse_int(
    raw: dict[str, Any], key: str, default: int, low: int, issues: list[ConfigIssue], label: str | None = None
) -> int:
    value = raw.get(key)
    if value is None:
        return default
    if not (is_int(value) and value >= low):
        issues.append(make_issue(label or key, f"must be an integer >= {low}", value))
        return default
    return value


def parse_pixel_range(raw: dict[str, Any], defaults: Qwen2VLImageConfig, issues: list[ConfigIssue]) -> dict[str, int]:
    """min/max pixels as transformers resolves them: top-level min_pixels/max_pixels (older configs)
    override size.shortest_edge/longest_edge (newer ones); no size at all means the class defaults.
    Also accepted: size {min_pixels, max_pixels}, the form transformers 4.x wrote into `size`."""
    size = raw.get("size")
    if size is not None and not isinstance(size, dict):
        issues.append(make_issue("size", "must be {shortest_edge, longest_edge} (pixel counts)", size))
        size = None
    bounds = {}
    for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        default = getattr(defaults, key)
        if raw.get(key) is not None or size is None:
            bounds[key] = parse_int(raw, key, default, 1, issues)
            continue
        size_key = edge if edge in size else key
        if size.get(size_key) is None:  # transformers refuses a size dict missing a bound (no class default)
            issues.append(make_issue(f"size.{edge}", f"is required unless {key} is set", size))
            bounds[key] = default
        else:
            bounds[key] = parse_int(size, size_key, default, 1, issues, f"size.{size_key}")
    if bounds["max_pixels"] < bounds["min_pixels"]:
        message = f"max_pixels (or size.longest_edge) must be >= min_pixels {bounds['min_pixels']}"
        issues.append(make_issue("max_pixels", message, bounds["max_pixels"]))
    return bounds


# --- sizes and token counts ---


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
    source: str | None = None,
) -> tuple[int, int]:
    """transformers' smart_resize: sides become multiples of `factor`, the area lands in [min_pixels,
    max_pixels] (unless an extreme aspect ratio forces one side up to `factor`), the ratio kept closely.
    Python's round() (half to even) and float math exactly as transformers, so sizes agree everywhere."""
    if height <= 0 or width <= 0:
        raise VisionInputError(f"{describe_source(source)}: has no pixels ({width}x{height})")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise VisionInputError(
            f"{describe_source(source)}: {width}x{height} has aspect ratio {ratio:.1f}; Qwen2-VL accepts at most "
            f"{MAX_ASPECT_RATIO} (crop or pad the image)"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def count_image_tokens(grid_thw, merge_size: int) -> int:
    """`<|image_pad|>` placeholders one image expands to: its patches, merged merge_size x merge_size."""
    t, h, w = (int(n) for n in grid_thw)
    return t * h * w // merge_size**2


# --- image steps, on channels-last uint8/float arrays (elementwise equal to transformers' CHW math) ---


def apply_patchify(image: np.ndarray, config: Qwen2VLImageConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[H, W, C] -> patch rows [grid_h * grid_w, C * T * P * P] in merge-window order, and (1, grid_h, grid_w).
    A still image fills the temporal axis by repetition (one temporal patch, grid_t = 1)."""
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    height, width, channels = image.shape
    grid_h, grid_w = height // p, width // p
    patches = np.asarray(image, dtype=np.float32).reshape(grid_h // m, m, p, grid_w // m, m, p, channels)
    patches = patches.transpose(0, 3, 1, 4, 6, 2, 5)  # (gh, gw, mh, mw, C, ph, pw)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
    return patches.reshape(grid_h * grid_w, channels * t * p * p), (1, grid_h, grid_w)


def apply_qwen2_vl_steps(image: np.ndarray, config: Qwen2VLImageConfig, source: str | None = None):
    """resize -> rescale -> normalize -> patchify of one [H, W, 3] uint8 array."""
    height, width = image.shape[:2]
    if config.do_resize:
        height, width = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels, source)
        image = apply_resize(image, height, width, config.resample)
    elif height % config.factor or width % config.factor:
        raise VisionInputError(
            f"{describe_source(source)}: {width}x{height} is not a multiple of {config.factor} (patch_size * "
            "merge_size) and do_resize is false; resize it or enable do_resize"
        )
    if config.do_rescale:
        image = apply_rescale(image, config.rescale_factor)
    if config.do_normalize:
        image = apply_normalize(image, config.image_mean, config.image_std)
    return apply_patchify(image, config)


def preprocess_image(
    image: Image.Image,
    config: Qwen2VLImageConfig | dict[str, Any],
    source: str | None = None,
    max_input_pixels: int = MAX_INPUT_PIXELS,
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One image: pixel_values [t*h*w, C*T*P*P] float32 and its grid (t, h, w)."""
    config = Qwen2VLImageConfig.coerce(config)
    array = apply_convert_rgb(image, config.do_convert_rgb, source, max_input_pixels)
    return apply_qwen2_vl_steps(array, config, source)


def preprocess_images(
    images: list[Image.Image],
    config: Qwen2VLImageConfig | dict[str, Any],
    sources: list[str] | None = None,
    max_input_pixels: int = MAX_INPUT_PIXELS,
) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values [sum of patches, D] float32, grid_thw [n, 3] int64), equal to
    Qwen2VLImageProcessorPil(**config)(images). `sources` name the images in error messages."""
    config = Qwen2VLImageConfig.coerce(config)
    names = list(sources) if sources else [None] * len(images)
    results = [preprocess_image(image, config, name, max_input_pixels) for image, name in zip(images, names)]
    width = 3 * config.temporal_patch_size * config.patch_size**2
    pixel_values = np.concatenate([values for values, _ in results]) if results else np.zeros((0, width), np.float32)
    grid_thw = np.array([grid for _, grid in results], dtype=np.int64).reshape(-1, 3)
    return pixel_values, grid_thw
