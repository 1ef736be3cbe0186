"""Phi-4-multimodal image preprocessing, equal (up to the HD resize, see below) to transformers'
`Phi4MultimodalImageProcessor` (a torchvision-backend processor), in NumPy and Pillow.

Per image (transformers' order):
1. RGB conversion (transparent pixels composited onto white), a uint8 [H, W, 3] array;
2. dynamic HD: a crop grid of cols x rows tiles of `size` (448) pixels: ceil(W/size) x ceil(H/size),
   or, when that is more than `dynamic_hd` crops, the grid (i, j), i * j <= dynamic_hd, whose aspect
   ratio i/j is closest to W/H (transformers' tie rule). The image is resized keeping its aspect ratio
   so that one side fills the grid (the other rounded down), and padded right/bottom with white (255)
   to the grid's size: the HD image, hd_height x hd_width (transformers' `image_sizes`). Its patch mask
   (one entry per `patch_size` pixels) is zero on the last floor(padding / patch_size) columns / rows;
3. rescale and normalize fused as torchvision does it: (float32(x) - mean / rescale_factor) /
   (std / rescale_factor), all float32;
4. the global view: the normalized HD image resized to size x size, bicubic without antialias
   (torch's upsample_bicubic2d, A = -0.75, align_corners=False; float, no clamp);
5. pixel_values = [global view, crops row by row], patch_mask likewise (global view all true).

The HD resize: transformers calls torchvision's resize (bilinear, antialias) on the uint8 tensor. On a
CPU with AVX2 that is torch's native uint8 antialiased bilinear kernel; elsewhere (Apple silicon, CUDA)
torchvision casts to float32, interpolates, rounds and casts back, so transformers' own output depends
on the machine. Here it is Pillow's BILINEAR resize (antialiased, the filter torch's kernels were
written to match), so the results are NOT identical. Measured (tests/test_vision_phi4_multimodal.py): Pillow
vs torch's native uint8 kernel differ by at most 2 uint8 levels (2 only on some upscales of a photo,
e.g. 512x600 to 896x1045); how many values are off by one depends on the scale, from none to 22.5%
(150x1900 into 106x1344); Pillow vs the float path by at most 1 level (on 13-20% of values), the same spread as
between torch's two paths. In normalized units (mean = std = 0.5) that is at most 2 / 127.5 = 0.0157 on
the crops and about 1.2 levels measured on the global view. Everything after the resize (padding,
normalize, bicubic global view, masks, token count) follows transformers to float32 rounding.

Tokens: the vision tower turns each size x size view into a base x base grid (base = ceil((size /
patch_size) / 2) after its 2x2 pooling; 16 for 448 / 14). transformers counts per image
base * base + base (global view and one separator per row) + 1 (separator between the views) +
the sub-images' useful pooled cells + one separator per useful row, from the patch mask sampled at
[0::2, 0::2] per crop and laid out over the whole HD grid (`make_downsampled_mask`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from PIL import Image

from mlxcel.errors import ConfigIssue
from mlxcel.vision.images import VisionInputError
from mlxcel.vision.processors.common import (
    ImageConfig,
    apply_convert_rgb,
    describe_source,
    is_positive_int,
    make_issue,
    parse_bool,
    parse_channel_floats,
    parse_positive_int,
    parse_rescale_factor,
)

BOOL_KEYS = ("do_rescale", "do_normalize", "do_convert_rgb")
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)
BICUBIC = 3  # Pillow's id; the only filter the global view supports (transformers' default)
CUBIC_A = -0.75  # torch's bicubic convolution constant
MIN_RESIZED_SIDE = 10  # transformers: "the aspect ratio is very extreme" below this
PAD_FILL = 255


@dataclass(frozen=True)
class Phi4ImageConfig(ImageConfig):
    """preprocessor_config.json of a Phi-4-multimodal image processor; defaults are
    Phi4MultimodalImageProcessor's class defaults (Phi-4-multimodal-instruct's values)."""

    size: int = 448  # the square crop / global view side
    patch_size: int = 14
    dynamic_hd: int = 36  # most crops per image
    resample: int = BICUBIC  # the global view's filter
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = IMAGENET_STANDARD_MEAN
    image_std: tuple[float, float, float] = IMAGENET_STANDARD_STD
    do_convert_rgb: bool = True

    @property
    def mask_size(self) -> int:
        """Patches per side of one view."""
        return self.size // self.patch_size

    @property
    def base_size(self) -> int:
        """Pooled cells per side of one view (the tower's 2x2 pooling, rounded up)."""
        return math.ceil(self.mask_size / 2)

    @classmethod
    def parse_fields(cls, raw: dict[str, Any], issues: list[ConfigIssue]) -> dict[str, Any]:
        """Parse the json dict; unknown keys (image_processor_type, audio settings, do_resize, which
        the processor ignores, ...) are ignored, JSON null means the default, bad values raise one
        ConfigError listing them all."""
        defaults = {f.name: f.default for f in fields(cls)}
        values: dict[str, Any] = {key: parse_bool(raw, key, defaults[key], issues) for key in BOOL_KEYS}
        values["size"] = parse_square_side(raw.get("size"), defaults["size"], issues)
        values["patch_size"] = parse_positive_int(raw, "patch_size", defaults["patch_size"], issues)
        values["dynamic_hd"] = parse_positive_int(raw, "dynamic_hd", defaults["dynamic_hd"], issues)
        resample = raw.get("resample")
        values["resample"] = defaults["resample"]
        if resample is not None and resample != BICUBIC:
            issues.append(make_issue("resample", f"must be {BICUBIC} (bicubic), the global view's filter", resample))
        values["rescale_factor"] = parse_rescale_factor(raw.get("rescale_factor"), defaults["rescale_factor"], issues)
        values["image_mean"] = parse_channel_floats(raw, "image_mean", defaults["image_mean"], issues, positive=False)
        values["image_std"] = parse_channel_floats(raw, "image_std", defaults["image_std"], issues, positive=True)
        if not (values["do_rescale"] or values["do_normalize"]):
            issues.append(
                make_issue(
                    "do_normalize",
                    "do_rescale and do_normalize cannot both be false (the pixels would stay uint8)",
                    raw.get("do_normalize"),
                )
            )
        if values["size"] % values["patch_size"]:
            issues.append(make_issue("patch_size", f"must divide size ({values['size']})", values["patch_size"]))
        return values


def parse_square_side(value: object, default: int, issues: list[ConfigIssue]) -> int:
    """An int, [height, width] or {height, width}; the processor only supports squares."""
    if value is None:
        return default
    if is_positive_int(value):
        return value
    sides = None
    if isinstance(value, dict) and set(value) == {"height", "width"}:
        sides = (value["height"], value["width"])
    elif isinstance(value, (list, tuple)) and len(value) == 2:
        sides = tuple(value)
    if sides is not None and all(map(is_positive_int, sides)) and sides[0] == sides[1]:
        return sides[0]
    issues.append(
        make_issue("size", "must be square: {height, width} with equal positive ints, [side, side] or an int", value)
    )
    return default


# --- planning (pure functions of sizes, transformers' arithmetic) ---


def find_closest_aspect_ratio(width: int, height: int, max_crops: int, size: int) -> tuple[int, int]:
    """(cols, rows) with cols * rows <= max_crops whose ratio is closest to width / height; on a tie the
    later grid (by crop count) wins when the image's area is over half of that grid's area."""
    aspect_ratio = width / height
    grids = sorted(
        {
            (i, j)
            for n in range(1, max_crops + 1)
            for i in range(1, n + 1)
            for j in range(1, n + 1)
            if i * j <= max_crops
        },
        key=lambda grid: grid[0] * grid[1],
    )
    best_diff, best = float("inf"), (1, 1)
    for grid in grids:
        diff = abs(aspect_ratio - grid[0] / grid[1])
        if diff < best_diff:
            best_diff, best = diff, grid
        elif diff == best_diff and width * height > 0.5 * size * size * grid[0] * grid[1]:
            best = grid
    return best


@dataclass(frozen=True)
class HDPlan:
    """Where an image goes in its HD image."""

    rows: int
    cols: int
    resized_height: int  # the image's size inside the HD image, before the white padding
    resized_width: int
    patch_mask: np.ndarray  # [rows * mask_size, cols * mask_size] bool


def plan_hd(height: int, width: int, config: Phi4ImageConfig, source: str | None = None) -> HDPlan:
    """transformers' dynamic_preprocess, without touching pixels."""
    size, patch = config.size, config.patch_size
    cols, rows = math.ceil(width / size), math.ceil(height / size)
    if cols * rows > config.dynamic_hd:
        cols, rows = find_closest_aspect_ratio(width, height, config.dynamic_hd, size)
    target_width, target_height = size * cols, size * rows
    ratio_width, ratio_height = target_width / width, target_height / height
    if ratio_width < ratio_height:
        new_width, new_height = target_width, int(height * ratio_width)
    else:
        new_width, new_height = int(width * ratio_height), target_height
    pad_width, pad_height = target_width - new_width, target_height - new_height
    mask = np.ones((rows * config.mask_size, cols * config.mask_size), dtype=bool)
    if pad_width >= patch:
        mask[:, mask.shape[1] - pad_width // patch :] = False
    if pad_height >= patch:
        mask[mask.shape[0] - pad_height // patch :, :] = False
    if min(new_height, target_height) < MIN_RESIZED_SIDE or min(new_width, target_width) < MIN_RESIZED_SIDE:
        raise VisionInputError(
            f"{describe_source(source)}: its aspect ratio is too extreme ({width}x{height} would be "
            f"resized to {new_width}x{new_height} in a {cols}x{rows} crop grid; each side needs "
            f"at least {MIN_RESIZED_SIDE} pixels)"
        )
    return HDPlan(rows, cols, new_height, new_width, mask)


def make_downsampled_mask(patch_mask: np.ndarray, rows: int, cols: int, mask_size: int) -> np.ndarray:
    """The HD patch mask sampled at [0::2, 0::2] within each crop, laid out over the HD grid:
    [rows * base, cols * base] bool (transformers' downsample_attention_mask)."""
    crops = patch_mask.reshape(rows, mask_size, cols, mask_size)[:, 0::2, :, 0::2]
    return crops.reshape(rows * crops.shape[1], cols * crops.shape[3])


def count_image_tokens(downsampled_mask: np.ndarray, base_size: int) -> int:
    """Image tokens of one image: the global view (base rows of base cells and a separator each), the
    separator between the views, and the sub-images' useful cells with a separator per useful row."""
    return int(base_size * base_size + base_size + 1 + downsampled_mask.sum() + downsampled_mask[:, 0].sum())


# --- pixels ---


def make_hd_image(image: np.ndarray, plan: HDPlan, config: Phi4ImageConfig) -> np.ndarray:
    """The uint8 [H, W, 3] image resized (Pillow bilinear, antialiased) and padded with white to the grid."""
    if (plan.resized_height, plan.resized_width) != image.shape[:2]:  # torchvision skips a no-op resize
        image = np.array(Image.fromarray(image).resize((plan.resized_width, plan.resized_height), Image.BILINEAR))
    hd = np.full((plan.rows * config.size, plan.cols * config.size, 3), PAD_FILL, dtype=np.uint8)
    hd[: image.shape[0], : image.shape[1]] = image
    return hd


def apply_rescale_normalize(image: np.ndarray, config: Phi4ImageConfig) -> np.ndarray:
    """[H, W, 3] uint8 to [3, H, W] float32 as torchvision's backend does it: rescale and normalize fused
    into one normalize with mean and std divided by the rescale factor (float32 throughout)."""
    chw = image.transpose(2, 0, 1).astype(np.float32)
    if config.do_normalize:
        mean = np.array(config.image_mean, dtype=np.float32)
        std = np.array(config.image_std, dtype=np.float32)
        if config.do_rescale:
            scale = np.float32(1.0 / config.rescale_factor)
            mean, std = mean * scale, std * scale
        return np.ascontiguousarray((chw - mean[:, None, None]) / std[:, None, None])
    return np.ascontiguousarray(chw * np.float32(config.rescale_factor))


def make_cubic_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices [4, out], weights [4, out] float32) of torch's upsample_bicubic2d along one axis,
    align_corners=False: source x = (i + 0.5) * in / out - 0.5, taps floor(x) - 1 .. floor(x) + 2
    clamped to the border, cubic convolution weights with A = -0.75 (float32 arithmetic, as torch's)."""
    f32 = np.float32
    scale = f32(in_size) / f32(out_size)
    real = scale * (np.arange(out_size, dtype=f32) + f32(0.5)) - f32(0.5)
    floor = np.floor(real)
    t = (real - floor).astype(f32)
    a = f32(CUBIC_A)

    def near(x):  # |x| <= 1
        return ((a + f32(2)) * x - (a + f32(3))) * x * x + f32(1)

    def far(x):  # 1 < |x| < 2
        return ((a * x - f32(5) * a) * x + f32(8) * a) * x - f32(4) * a

    weights = np.stack([far(t + f32(1)), near(t), near(f32(1) - t), far(f32(2) - t)]).astype(f32)
    start = floor.astype(np.int64) - 1
    indices = np.clip(start[None, :] + np.arange(4)[:, None], 0, in_size - 1)
    return indices, weights


def apply_bicubic_resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """[C, H, W] float32 resized bicubic without antialias, no clamp (torch's interpolate,
    mode="bicubic", align_corners=False): along the width, then the height, in float32."""
    if image.shape[1:] == (height, width):  # torchvision skips a no-op resize
        return image
    x_idx, x_w = make_cubic_taps(image.shape[2], width)
    y_idx, y_w = make_cubic_taps(image.shape[1], height)
    rows = sum(image[:, :, x_idx[k]] * x_w[k] for k in range(4))
    out = sum(rows[:, y_idx[k], :] * y_w[k][:, None] for k in range(4))
    return np.ascontiguousarray(out, dtype=np.float32)


@dataclass(frozen=True)
class Phi4Image:
    """One image after preprocessing: transformers' unpadded rows for it."""

    pixel_values: np.ndarray  # [1 + rows * cols, 3, S, S] float32: the global view, then crops row by row
    patch_mask: np.ndarray  # [1 + rows * cols, S / p, S / p] bool (image_attention_mask)
    rows: int  # crop grid
    cols: int
    hd_height: int  # the padded HD image (transformers' image_sizes)
    hd_width: int
    useful_rows: int  # the pooled sub-image grid's useful height / width (as the model computes them)
    useful_cols: int
    num_tokens: int  # image tokens the prompt holds for it (num_img_tokens)

    @property
    def n_frames(self) -> int:
        return self.pixel_values.shape[0]


def preprocess_image(image: Image.Image, config: Phi4ImageConfig, source: str | None = None) -> Phi4Image:
    array = apply_convert_rgb(image, config.do_convert_rgb, source)
    plan = plan_hd(array.shape[0], array.shape[1], config, source)
    hd = apply_rescale_normalize(make_hd_image(array, plan, config), config)
    size, m = config.size, config.mask_size
    global_view = apply_bicubic_resize(hd, size, size)
    crops = hd.reshape(3, plan.rows, size, plan.cols, size).transpose(1, 3, 0, 2, 4).reshape(-1, 3, size, size)
    masks = plan.patch_mask.reshape(plan.rows, m, plan.cols, m).transpose(0, 2, 1, 3).reshape(-1, m, m)
    downsampled = make_downsampled_mask(plan.patch_mask, plan.rows, plan.cols, m)
    return Phi4Image(
        pixel_values=np.ascontiguousarray(np.concatenate([global_view[None], crops]), dtype=np.float32),
        patch_mask=np.concatenate([np.ones((1, m, m), dtype=bool), masks]),
        rows=plan.rows,
        cols=plan.cols,
        hd_height=hd.shape[1],
        hd_width=hd.shape[2],
        useful_rows=int(downsampled[:, 0].sum()),
        useful_cols=int(downsampled[0, :].sum()),
        num_tokens=count_image_tokens(downsampled, config.base_size),
    )
