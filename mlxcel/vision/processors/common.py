"""What the image processors share: config parsing that reports every bad key at once (as
`preprocessor_config.KEY: message (got VALUE)`), and the Pillow/NumPy steps in transformers'
order and dtypes: RGB composite, uint8 Pillow resize, rescale in float64 cast to float32,
normalize in float32."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mlxcel.errors import ConfigError, ConfigIssue
from mlxcel.vision.images import VisionInputError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
CONFIG_PREFIX = "preprocessor_config"


def make_issue(key: str, message: str, value: object) -> ConfigIssue:
    return ConfigIssue(f"{CONFIG_PREFIX}.{key}", message, value)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive_int(value: object) -> bool:
    return is_int(value) and value > 0


def parse_positive_int(raw: dict[str, Any], key: str, default: int | None, issues: list[ConfigIssue]) -> int | None:
    value = raw.get(key)
    if value is None:
        return default
    if not is_positive_int(value):
        issues.append(make_issue(key, "must be a positive int", value))
        return default
    return value


def is_finite_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_bool(raw: dict[str, Any], key: str, default: bool, issues: list[ConfigIssue]) -> bool:
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        issues.append(make_issue(key, "must be true or false", value))
        return default
    return value


def parse_resample(value: object, default: int, issues: list[ConfigIssue]) -> int:
    if value is None:
        return default
    if not (is_int(value) and value in RESAMPLE_NAMES):
        legal = ", ".join(f"{k} ({v})" for k, v in RESAMPLE_NAMES.items())
        issues.append(make_issue("resample", f"must be a Pillow filter id: {legal}", value))
        return default
    return value


def parse_rescale_factor(value: object, default: float, issues: list[ConfigIssue]) -> float:
    if value is None:
        return default
    if not (is_finite_number(value) and value > 0):
        issues.append(make_issue("rescale_factor", "must be a finite number > 0 (usually 1/255)", value))
        return default
    return float(value)


def parse_channel_floats(
    raw: dict[str, Any], key: str, default: tuple, issues: list[ConfigIssue], positive: bool
) -> tuple:
    """Three per-channel floats; a single float applies to all channels, as transformers allows."""
    value = raw.get(key)
    if value is None:
        return default
    items = [value] * 3 if is_finite_number(value) else value
    valid = isinstance(items, (list, tuple)) and len(items) == 3 and all(map(is_finite_number, items))
    if valid and positive:
        valid = all(item > 0 for item in items)
    if not valid:
        bound = "> 0" if positive else "finite"
        issues.append(make_issue(key, f"must be a number or a list of 3 numbers (R, G, B), each {bound}", value))
        return default
    return tuple(float(item) for item in items)


def describe_source(source: str | None) -> str:
    return f"image {source}" if source else "image"


def apply_rgb_composite(image: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb: transparent pixels go onto a white background, not black."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def apply_convert_rgb(
    image: Image.Image, convert: bool, source: str | None = None, max_input_pixels: int | None = None
) -> np.ndarray:
    """The [H, W, 3] uint8 array transformers' PIL backend starts from (alpha composited onto white);
    with `max_input_pixels`, larger images are refused before any pixel work."""
    if not isinstance(image, Image.Image):
        raise VisionInputError(f"{describe_source(source)}: expected a PIL image, got {type(image).__name__}")
    if image.width == 0 or image.height == 0:
        raise VisionInputError(f"{describe_source(source)}: has no pixels ({image.width}x{image.height})")
    if max_input_pixels is not None and image.width * image.height > max_input_pixels:
        raise VisionInputError(
            f"{describe_source(source)}: {image.width}x{image.height} is {image.width * image.height / 1e6:.1f} "
            f"megapixels, above the limit of {max_input_pixels / 1e6:g}; downscale it first"
        )
    if convert:
        image = apply_rgb_composite(image)
    array = np.array(image)
    if array.ndim != 3 or array.shape[-1] != 3 or array.dtype != np.uint8:
        raise VisionInputError(
            f"{describe_source(source)}: mode {image.mode} is not 8-bit RGB; set do_convert_rgb to true or convert it"
        )
    return array


def apply_resize(image: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """Pillow resize of an [H, W, 3] uint8 array, as transformers' resize does it (no rescale around it)."""
    return np.array(Image.fromarray(image).resize((width, height), resample=resample))


def apply_rescale(image: np.ndarray, factor: float) -> np.ndarray:
    # float64 first, then float32: transformers' order, so rounding agrees bit for bit.
    return (image.astype(np.float64) * factor).astype(np.float32)


def apply_normalize(image: np.ndarray, mean: tuple, std: tuple) -> np.ndarray:
    if not np.issubdtype(image.dtype, np.floating):
        image = image.astype(np.float32)
    return (image - np.array(mean, dtype=image.dtype)) / np.array(std, dtype=image.dtype)


def read_preprocessor_json(path: str | Path) -> dict[str, Any]:
    """A preprocessor_config.json file, or the checkpoint folder holding one, as a dict."""
    path = Path(path)
    return json.loads((path / "preprocessor_config.json" if path.is_dir() else path).read_text())


class ImageConfig:
    """What the processors' frozen config dataclasses share: each family's `parse_fields(raw,
    issues)` gives the constructor's values, appending a ConfigIssue per bad key; `from_dict`
    raises them all at once (unknown keys ignored, JSON null = the default)."""

    @classmethod
    def parse_fields(cls, raw: dict[str, Any], issues: list[ConfigIssue]) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_dict(cls, raw: dict[str, Any]):
        issues: list[ConfigIssue] = []
        values = cls.parse_fields(raw, issues)
        raise_config_issues(issues)
        return cls(**values)

    @classmethod
    def load(cls, path: str | Path):
        """From a preprocessor_config.json file or the checkpoint folder holding one."""
        return cls.from_dict(read_preprocessor_json(path))

    @classmethod
    def coerce(cls, config):
        """A config, or the dict of one."""
        return config if isinstance(config, cls) else cls.from_dict(config)


def raise_config_issues(issues: list[ConfigIssue]) -> None:
    """Every bad key of a preprocessor config at once, as one ConfigError."""
    if issues:
        raise ConfigError(issues, hint="fix the checkpoint's preprocessor_config.json")
