"""Idefics3 / SmolVLM preprocessing, equal to transformers' `Idefics3ImageProcessorPil` (SmolVLM's
`SmolVLMImageProcessorPil` is the same code; SmolVLM-256M/500M ship an Idefics3ImageProcessor config),
and the `<image>` prompt layout `Idefics3Processor` / `SmolVLMProcessor` expand a placeholder to.

Per image (transformers' order, on uint8 until the rescale):
1. resize so the longest edge is `size.longest_edge` (the shorter edge keeps the aspect ratio, rounded
   down and then up to even; capped at 4096), or to exactly `size` {height, width};
2. with `do_image_splitting`: resize both edges up to multiples of the tile side
   (`max_image_size.longest_edge`), cut that into rows x cols tiles row by row, and append the whole
   image squashed to one tile (the global view); an image that is one tile already stays a single
   frame with rows = cols = 0. Without splitting: the image squashed to one tile, rows = cols = 0;
3. rescale (float64, cast to float32) and normalize every frame.
One prompt's frames (all its images, in order) form one sample; samples are zero-padded to the batch's
largest frame count and frame size, with `pixel_attention_mask` true on real pixels.

The prompt layout: an image with rows = cols = 0 becomes
`<fake_token_around_image><global-img>` + `<image>` * image_seq_len + `<fake_token_around_image>`;
a split image `<fake_token_around_image><row_{r}_col_{c}>` + `<image>` * image_seq_len per tile,
"\\n" after each row, then "\\n" and the global view as above."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from PIL import Image

from mlxcel.errors import ConfigError, ConfigIssue, MlxcelError
from mlxcel.vision.images import VisionInputError
from mlxcel.vision.processors.clip import SizeSpec
from mlxcel.vision.processors.common import (
    ImageConfig,
    apply_convert_rgb,
    apply_normalize,
    apply_rescale,
    apply_resize,
    describe_source,
    is_positive_int,
    make_issue,
    parse_bool,
    parse_channel_floats,
    parse_resample,
    parse_rescale_factor,
)

IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)
MAX_IMAGE_SIZE = 4096  # transformers' cap on the resized longest edge
DEFAULT_SIZE = SizeSpec(longest_edge=4 * 364)  # Idefics3-8B-Llama3: 4 tiles of 364 per side
BOOL_KEYS = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb", "do_image_splitting", "do_pad")


@dataclass(frozen=True)
class Idefics3ImageConfig(ImageConfig):
    """preprocessor_config.json of an Idefics3 / SmolVLM image processor; defaults are
    Idefics3ImageProcessorPil's class defaults (Idefics3-8B-Llama3's values)."""

    do_resize: bool = True
    size: SizeSpec = DEFAULT_SIZE  # longest_edge, or exact height x width
    resample: int = 1  # LANCZOS
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = IMAGENET_STANDARD_MEAN
    image_std: tuple[float, float, float] = IMAGENET_STANDARD_STD
    do_convert_rgb: bool = True
    do_image_splitting: bool = True
    max_image_size: int = 364  # the tile side: max_image_size.longest_edge
    do_pad: bool = True

    @classmethod
    def parse_fields(cls, raw: dict[str, Any], issues: list[ConfigIssue]) -> dict[str, Any]:
        """Parse the json dict; unknown keys (image_processor_type, ...) are ignored, JSON null means
        the default, bad values raise one ConfigError listing them all."""
        defaults = {f.name: f.default for f in fields(cls)}
        values: dict[str, Any] = {key: parse_bool(raw, key, defaults[key], issues) for key in BOOL_KEYS}
        values["size"] = parse_size(raw.get("size"), defaults["size"], issues)
        values["resample"] = parse_resample(raw.get("resample"), defaults["resample"], issues)
        values["rescale_factor"] = parse_rescale_factor(raw.get("rescale_factor"), defaults["rescale_factor"], issues)
        values["image_mean"] = parse_channel_floats(raw, "image_mean", defaults["image_mean"], issues, positive=False)
        values["image_std"] = parse_channel_floats(raw, "image_std", defaults["image_std"], issues, positive=True)
        values["max_image_size"] = parse_max_image_size(raw.get("max_image_size"), defaults["max_image_size"], issues)
        return values


def parse_size(value: object, default: SizeSpec, issues: list[ConfigIssue]) -> SizeSpec:
    """transformers' get_size_dict (default_to_square=True) as Idefics3's resize reads it: an int is a
    square, [height, width] or {height, width} exact, {longest_edge} keeps the aspect ratio."""
    if value is None:
        return default
    if is_positive_int(value):
        return SizeSpec(height=value, width=value)
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(map(is_positive_int, value)):
        return SizeSpec(height=value[0], width=value[1])
    if (
        isinstance(value, dict)
        and set(value) in ({"longest_edge"}, {"height", "width"})
        and all(map(is_positive_int, value.values()))
    ):
        return SizeSpec(**value)
    issues.append(
        make_issue(
            "size",
            "must be {longest_edge}, {height, width}, [height, width] or a positive int (square), "
            "with positive int values",
            value,
        )
    )
    return default


def parse_max_image_size(value: object, default: int, issues: list[ConfigIssue]) -> int:
    if value is None:
        return default
    if isinstance(value, dict) and set(value) == {"longest_edge"} and is_positive_int(value["longest_edge"]):
        return value["longest_edge"]
    issues.append(make_issue("max_image_size", "must be {longest_edge} with a positive int (the tile side)", value))
    return default


# --- planning (pure functions of sizes, transformers' arithmetic) ---


def plan_longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """transformers' get_resize_output_image_size: the longest edge to `longest`, the other by the aspect
    ratio (rounded down, then up to even, at least 1); then scaled down under MAX_IMAGE_SIZE."""
    aspect_ratio = width / height
    if width >= height:
        width = longest
        height = int(width / aspect_ratio)
        height += height % 2
    else:
        height = longest
        width = int(height * aspect_ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect_ratio = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width = MAX_IMAGE_SIZE
        height = int(width / aspect_ratio)
    elif height > width and height > MAX_IMAGE_SIZE:
        height = MAX_IMAGE_SIZE
        width = int(height * aspect_ratio)
    return max(height, 1), max(width, 1)


def plan_resize_size(height: int, width: int, size: SizeSpec) -> tuple[int, int]:
    if size.longest_edge:
        return plan_longest_edge_size(height, width, size.longest_edge)
    return (size.height, size.width)


def plan_split_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """transformers' resize_for_vision_encoder: the longer edge up to a multiple of `tile`, the other by
    the aspect ratio (rounded down), then up to a multiple of `tile` too."""
    aspect_ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = int(width / aspect_ratio)
        height = math.ceil(height / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = int(height * aspect_ratio)
        width = math.ceil(width / tile) * tile
    return height, width


def plan_grid(height: int, width: int, config: Idefics3ImageConfig) -> tuple[int, int]:
    """(rows, cols) of tiles for an image of this size, following the processing path; (0, 0): one frame."""
    if config.do_resize:
        height, width = plan_resize_size(height, width, config.size)
    if not config.do_image_splitting:
        return 0, 0
    height, width = plan_split_size(height, width, config.max_image_size)
    tile = config.max_image_size
    if height > tile or width > tile:
        return (height - tile) // tile + 1, (width - tile) // tile + 1
    return 0, 0


# --- image steps ---


@dataclass(frozen=True)
class Idefics3Image:
    """One image after preprocessing: transformers' unpadded frames for it."""

    tiles: np.ndarray  # [n_frames, 3, H, W] float32: rows x cols tiles row by row, then the global view
    rows: int  # 0 and 0: a single frame (no split)
    cols: int

    @property
    def n_frames(self) -> int:
        return self.tiles.shape[0]


@dataclass(frozen=True)
class Idefics3Batch:
    """Equal to the image processor's output for `samples` (one per prompt, each a list of images)."""

    pixel_values: np.ndarray  # [n_samples, max_frames, 3, H, W] float32, zero padding
    pixel_attention_mask: np.ndarray  # [n_samples, max_frames, H, W] bool: true on real pixels
    images: list[list[Idefics3Image]]  # per sample, per image

    @property
    def rows(self) -> list[list[int]]:
        return [[image.rows for image in sample] for sample in self.images]

    @property
    def cols(self) -> list[list[int]]:
        return [[image.cols for image in sample] for sample in self.images]

    @property
    def frame_counts(self) -> list[int]:
        """Real frames per sample; the rest of pixel_values[i] is padding."""
        return [sum(image.n_frames for image in sample) for sample in self.images]


def resize_checked(image: np.ndarray, height: int, width: int, resample: int, source: str | None) -> np.ndarray:
    if height <= 0 or width <= 0:  # PIL's ValueError in transformers
        raise VisionInputError(
            f"{describe_source(source)}: resizing {image.shape[1]}x{image.shape[0]} gives {width}x{height}"
        )
    return apply_resize(image, height, width, resample)


def make_image_frames(
    image: np.ndarray, config: Idefics3ImageConfig, source: str | None = None
) -> tuple[list[np.ndarray], int, int]:
    """(frames, rows, cols): uint8 [H, W, 3] frames before rescale/normalize."""
    if config.do_resize:
        image = resize_checked(image, *plan_resize_size(*image.shape[:2], config.size), config.resample, source)
    tile = config.max_image_size
    if not config.do_image_splitting:
        return [resize_checked(image, tile, tile, config.resample, source)], 0, 0
    image = resize_checked(image, *plan_split_size(*image.shape[:2], tile), config.resample, source)
    height, width = image.shape[:2]
    if height <= tile and width <= tile:
        return [image], 0, 0
    rows, cols = (height - tile) // tile + 1, (width - tile) // tile + 1
    frames = [image[r * tile : (r + 1) * tile, c * tile : (c + 1) * tile] for r in range(rows) for c in range(cols)]
    frames.append(resize_checked(image, tile, tile, config.resample, source))
    return frames, rows, cols


def apply_frame_steps(frame: np.ndarray, config: Idefics3ImageConfig) -> np.ndarray:
    """rescale -> normalize of one [H, W, 3] uint8 frame; returns [3, H, W] float32."""
    if config.do_rescale:
        frame = apply_rescale(frame, config.rescale_factor)
    if config.do_normalize:
        frame = apply_normalize(frame, config.image_mean, config.image_std)
    return np.ascontiguousarray(frame.transpose(2, 0, 1), dtype=np.float32)


def preprocess_image(image: Image.Image, config: Idefics3ImageConfig, source: str | None = None) -> Idefics3Image:
    array = apply_convert_rgb(image, config.do_convert_rgb, source)
    frames, rows, cols = make_image_frames(array, config, source)
    return Idefics3Image(np.stack([apply_frame_steps(frame, config) for frame in frames]), rows, cols)


def apply_batch_padding(samples: list[list[Idefics3Image]]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' padding: every sample to the batch's largest frame count, every frame to the largest
    height and width (zeros at the bottom/right); the mask is true on real pixels."""
    stacks = [np.concatenate([image.tiles for image in sample]) for sample in samples]
    max_frames = max(len(stack) for stack in stacks)
    height, width = max(s.shape[2] for s in stacks), max(s.shape[3] for s in stacks)
    pixel_values = np.zeros((len(stacks), max_frames, 3, height, width), dtype=np.float32)
    mask = np.zeros((len(stacks), max_frames, height, width), dtype=bool)
    for i, sample in enumerate(samples):
        j = 0
        for image in sample:
            for frame in image.tiles:
                pixel_values[i, j, :, : frame.shape[1], : frame.shape[2]] = frame
                mask[i, j, : frame.shape[1], : frame.shape[2]] = True
                j += 1
    return pixel_values, mask


def preprocess_batch(
    samples: list[list[Image.Image]], config: Idefics3ImageConfig, sources: list[list[str]] | None = None
) -> Idefics3Batch:
    """Equal to Idefics3ImageProcessorPil(**config)(samples, return_row_col_info=True): pixel_values,
    pixel_attention_mask, rows, cols. The batch is always padded (the model needs it); with do_pad false
    transformers returns the unpadded frames instead: `images[i][k].tiles`."""
    if not samples or not any(samples):
        raise VisionInputError("no images to preprocess")
    names = sources or [[None] * len(sample) for sample in samples]
    processed = [
        [preprocess_image(image, config, name) for image, name in zip(sample, sample_names)]
        for sample, sample_names in zip(samples, names)
    ]
    if any(not sample for sample in processed):  # transformers: one sample without images cannot be padded either
        raise VisionInputError("every sample of a batch needs at least one image")
    pixel_values, mask = apply_batch_padding(processed)
    return Idefics3Batch(pixel_values, mask, processed)


def preprocess_images(
    images: list[Image.Image], config: Idefics3ImageConfig, sources: list[str] | None = None
) -> Idefics3Batch:
    """One prompt's images (one sample, as the processor takes a flat list): pixel_values [1, frames, 3, H, W]."""
    return preprocess_batch([list(images)], config, [list(sources)] if sources else None)


# --- the prompt layout ---


@dataclass(frozen=True)
class ImagePromptTokens:
    """The strings the processors write. Idefics3Processor fixes them; SmolVLMProcessor reads
    `fake_image_token`, `image_token` and `global_image_token` from the tokenizer (these defaults
    when it has none)."""

    fake_image: str = "<fake_token_around_image>"
    image: str = "<image>"
    global_image: str = "<global-img>"

    @classmethod
    def from_tokenizer_config(cls, raw: dict[str, Any]) -> ImagePromptTokens:
        """SmolVLM's: tokenizer_config.json's top-level or `extra_special_tokens` entries, else the defaults."""
        extra = raw.get("extra_special_tokens") if isinstance(raw.get("extra_special_tokens"), dict) else {}
        pick = {
            name: raw.get(key, extra.get(key))
            for name, key in (
                ("fake_image", "fake_image_token"),
                ("image", "image_token"),
                ("global_image", "global_image_token"),
            )
        }
        return cls(**{name: value for name, value in pick.items() if isinstance(value, str) and value})


def make_prompt_pieces(rows: int, cols: int, image_seq_len: int, tokens: ImagePromptTokens) -> list[tuple[str, bool]]:
    """The layout as (piece, is_marker) pairs: markers are the token strings, the rest is plain text ("\\n")."""
    check_layout_args(rows, cols, image_seq_len)
    global_view = [(tokens.fake_image, True), (tokens.global_image, True)] + [(tokens.image, True)] * image_seq_len
    global_view.append((tokens.fake_image, True))
    if rows == 0 and cols == 0:
        return global_view
    pieces: list[tuple[str, bool]] = []
    for r in range(rows):
        for c in range(cols):
            pieces += [(tokens.fake_image, True), (f"<row_{r + 1}_col_{c + 1}>", True)] + [
                (tokens.image, True)
            ] * image_seq_len
        pieces.append(("\n", False))
    return pieces + [("\n", False)] + global_view


def check_layout_args(rows: int, cols: int, image_seq_len: int) -> None:
    if not (
        isinstance(rows, (int, np.integer))
        and isinstance(cols, (int, np.integer))
        and rows >= 0
        and cols >= 0
        and (rows == 0) == (cols == 0)
    ):
        raise MlxcelError(f"image grid must be rows, cols >= 0, both 0 or both > 0 (got {rows}x{cols})")
    if not is_positive_int(image_seq_len):
        raise ConfigError(
            ConfigIssue("image_seq_len", "must be a positive int", image_seq_len),
            hint="fix the checkpoint's processor_config.json",
        )


def make_image_prompt(rows: int, cols: int, image_seq_len: int, tokens: ImagePromptTokens = ImagePromptTokens()) -> str:
    """The text one `<image>` placeholder becomes (Idefics3Processor.replace_image_token /
    SmolVLM's get_image_prompt_string)."""
    return "".join(piece for piece, _ in make_prompt_pieces(rows, cols, image_seq_len, tokens))


def make_image_prompt_ids(
    rows: int,
    cols: int,
    image_seq_len: int,
    special_tokens: dict[str, int],
    encode_text: Callable[[str], list[int]],
    tokens: ImagePromptTokens = ImagePromptTokens(),
) -> list[int]:
    """The ids the tokenizer gives `make_image_prompt(...)` inside a prompt: markers that are special
    (added) tokens are their ids; every run of text between two of them (the row newlines, "\\n\\n" before
    the global view, a `<row_r_col_c>` the vocabulary lacks) is encoded on its own, as tokenizers split
    the text at added tokens first. `encode_text` encodes without BOS/EOS."""
    ids: list[int] = []
    text = ""
    for piece, is_marker in make_prompt_pieces(rows, cols, image_seq_len, tokens):
        token_id = special_tokens.get(piece) if is_marker else None
        if token_id is None:
            text += piece
            continue
        if text:
            ids += encode_text(text)
            text = ""
        ids.append(token_id)
    return ids + (encode_text(text) if text else [])


def count_image_tokens(rows: int, cols: int, image_seq_len: int) -> int:
    """`<image>` tokens (the positions the connector's features fill) for one image."""
    check_layout_args(rows, cols, image_seq_len)
    return image_seq_len * (rows * cols + 1)


def expand_image_prompts(token_ids: list[int], image_token_id: int, layouts: list[list[int]]) -> list[int]:
    """The prompt's ids with each `<image>` placeholder (one per image, in order) replaced by its layout."""
    found = sum(1 for t in token_ids if t == image_token_id)
    if found != len(layouts):
        raise MlxcelError(f"the prompt has {found} image placeholder(s) for {len(layouts)} image(s)")
    expanded, images = [], iter(layouts)
    for token in token_ids:
        expanded.extend(next(images) if token == image_token_id else [token])
    return expanded
