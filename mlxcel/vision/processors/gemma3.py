"""Gemma 3 image preprocessing, equal to transformers' Pillow backend (`Gemma3ImageProcessorPil`),
and the prompt expansion of transformers' `Gemma3Processor`.

Per image: RGB conversion (alpha composited onto white), optional pan-and-scan (the original
image plus up to `pan_and_scan_max_num_crops` crops of a very wide or tall image, cut from the
uint8 image before any resize), then each of them: Pillow resize to size (896x896, bilinear for
the released checkpoints), rescale in float64 cast to float32, normalize (mean = std = 0.5).
No center crop: Gemma3ImageProcessorPil has none. pixel_values are [sum(1 + crops), 3, H, W],
each image followed by its crops; `num_crops[i]` is image i's crop count.

Prompt: the chat template writes `<start_of_image>` once per image; Gemma3Processor replaces it
by the *text* `\\n\\n<start_of_image>` + `<image_soft_token>` x mm_tokens_per_image +
`<end_of_image>\\n\\n` (pan-and-scan: "Here is the original image {that} and here are some crops
to help you see better {that} {that} ..."), then tokenizes. The features replace the soft tokens
(config.json's image_token_index, 262144), not `<start_of_image>` (boi_token_index 255999).
Because the newlines are text, they merge with neighbouring newlines in the tokenizer (the
template's `user\\n` before an image becomes `user` + `\\n\\n\\n`): exact ids come from expanding the
text and tokenizing it (`expand_prompt_ids`), not from splicing ids."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from PIL import Image

from mlxcel.errors import ConfigIssue, MlxcelError
from mlxcel.vision.images import VisionInputError
from mlxcel.vision.processors.common import (
    ImageConfig,
    apply_convert_rgb,
    apply_normalize,
    apply_rescale,
    apply_resize,
    is_finite_number,
    is_positive_int,
    make_issue,
    parse_bool,
    parse_channel_floats,
    parse_positive_int,
    parse_resample,
    parse_rescale_factor,
)

BOOL_KEYS = ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb", "do_pan_and_scan")
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)
# The tokenizer's boi_token / image_token / eoi_token (tokenizer_config.json of google/gemma-3-*).
BOI_TOKEN = "<start_of_image>"
IMAGE_TOKEN = "<image_soft_token>"
EOI_TOKEN = "<end_of_image>"
PAN_AND_SCAN_INTRO = "Here is the original image "
PAN_AND_SCAN_CROPS = " and here are some crops to help you see better "


@dataclass(frozen=True)
class Gemma3ImageConfig(ImageConfig):
    """preprocessor_config.json of a Gemma 3 image processor. Defaults: Gemma3ImageProcessorPil's,
    and for pan-and-scan Gemma3Processor's (the Hub files leave those keys null)."""

    do_resize: bool = True
    size: tuple[int, int] = (224, 224)  # (height, width); the released checkpoints say 896x896
    resample: int = 2  # bilinear
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = IMAGENET_STANDARD_MEAN
    image_std: tuple[float, float, float] = IMAGENET_STANDARD_STD
    do_convert_rgb: bool = True
    do_pan_and_scan: bool = False
    pan_and_scan_min_crop_size: int = 256
    pan_and_scan_max_num_crops: int = 4
    pan_and_scan_min_ratio_to_activate: float = 1.2
    image_seq_length: int | None = None  # soft tokens per image, when the file says (256)

    @classmethod
    def parse_fields(cls, raw: dict[str, Any], issues: list[ConfigIssue]) -> dict[str, Any]:
        return parse_gemma3_fields(raw, issues)


# --- parsing ---


def parse_gemma3_fields(raw: dict[str, Any], issues: list[ConfigIssue]) -> dict[str, Any]:
    defaults = {f.name: f.default for f in fields(Gemma3ImageConfig)}
    values = {key: parse_bool(raw, key, defaults[key], issues) for key in BOOL_KEYS}
    values["size"] = parse_square_size(raw.get("size"), defaults["size"], issues)
    values["resample"] = parse_resample(raw.get("resample"), defaults["resample"], issues)
    values["rescale_factor"] = parse_rescale_factor(raw.get("rescale_factor"), defaults["rescale_factor"], issues)
    values["image_mean"] = parse_channel_floats(raw, "image_mean", defaults["image_mean"], issues, positive=False)
    values["image_std"] = parse_channel_floats(raw, "image_std", defaults["image_std"], issues, positive=True)
    for key in ("pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops", "image_seq_length"):
        values[key] = parse_positive_int(raw, key, defaults[key], issues)
    ratio = raw.get("pan_and_scan_min_ratio_to_activate")
    values["pan_and_scan_min_ratio_to_activate"] = defaults["pan_and_scan_min_ratio_to_activate"]
    if ratio is not None:
        if is_finite_number(ratio) and ratio > 0:
            values["pan_and_scan_min_ratio_to_activate"] = float(ratio)
        else:
            issues.append(
                make_issue(
                    "pan_and_scan_min_ratio_to_activate",
                    "must be a finite number > 0 (width/height or height/width, e.g. 1.2)",
                    ratio,
                )
            )
    return values


def parse_square_size(value: object, default: tuple[int, int], issues: list[ConfigIssue]) -> tuple[int, int]:
    """transformers' get_size_dict with default_to_square=True: an int is square, [h, w] or
    {height, width} exact. A shortest_edge size would give each image its own shape, which the
    fixed-size SigLIP tower cannot take, so it is refused here."""
    if value is None:
        return default
    if is_positive_int(value):
        return (value, value)
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(map(is_positive_int, value)):
        return (value[0], value[1])
    if isinstance(value, dict) and set(value) == {"height", "width"} and all(map(is_positive_int, value.values())):
        return (value["height"], value["width"])
    issues.append(
        make_issue(
            "size",
            "must be a positive int, [height, width] or {height, width} with positive ints (the tower's image_size)",
            value,
        )
    )
    return default


# --- image steps ---


def plan_pan_and_scan(height: int, width: int, config: Gemma3ImageConfig) -> list[tuple[int, int, int, int]]:
    """(top, left, crop_height, crop_width) of each crop, row-major, as transformers'
    Gemma3ImageProcessorPil.pan_and_scan computes them (the last crop of a row may be narrower:
    the crop size is rounded up and slicing stops at the edge; it can even be empty). [] when the image is not
    elongated enough or the crops would be smaller than pan_and_scan_min_crop_size."""
    min_crop, max_crops, min_ratio = (
        config.pan_and_scan_min_crop_size,
        config.pan_and_scan_max_num_crops,
        config.pan_and_scan_min_ratio_to_activate,
    )
    if width >= height:  # square or landscape
        if width / height < min_ratio:
            return []
        crops_w = math.floor(width / height + 0.5)  # half rounds up
        crops_w = min(math.floor(width / min_crop), crops_w)
        crops_w = min(max_crops, max(2, crops_w))
        crops_h = 1
    else:
        if height / width < min_ratio:
            return []
        crops_h = math.floor(height / width + 0.5)
        crops_h = min(math.floor(height / min_crop), crops_h)
        crops_h = min(max_crops, max(2, crops_h))
        crops_w = 1
    crop_w, crop_h = math.ceil(width / crops_w), math.ceil(height / crops_h)
    if min(crop_w, crop_h) < min_crop:
        return []
    tops, lefts = [crop_h * i for i in range(crops_h)], [crop_w * i for i in range(crops_w)]
    return [
        (top, left, max(0, min(crop_h, height - top)), max(0, min(crop_w, width - left)))
        for top, left in itertools.product(tops, lefts)
    ]


def apply_gemma3_steps(image: np.ndarray, config: Gemma3ImageConfig) -> np.ndarray:
    """resize -> rescale -> normalize of one [H, W, 3] uint8 array; returns [3, H, W] float32."""
    if config.do_resize:
        image = apply_resize(image, *config.size, config.resample)
    if config.do_rescale:
        image = apply_rescale(image, config.rescale_factor)
    if config.do_normalize:
        image = apply_normalize(image, config.image_mean, config.image_std)
    return np.ascontiguousarray(image.transpose(2, 0, 1), dtype=np.float32)


def split_pan_and_scan(image: np.ndarray, config: Gemma3ImageConfig) -> list[np.ndarray]:
    """The image, then its pan-and-scan crops (none unless do_pan_and_scan). With a tiny
    pan_and_scan_min_crop_size the last crop can be empty (9x2 in 4 crops of 3); transformers
    resizes that to a black image without complaint, and so does this."""
    if not config.do_pan_and_scan:
        return [image]
    crops = [
        image[top : top + height, left : left + width]
        for top, left, height, width in plan_pan_and_scan(*image.shape[:2], config)
    ]
    return [image, *crops]


@dataclass
class Gemma3Pixels:
    pixel_values: np.ndarray  # [sum(1 + num_crops), 3, H, W] float32
    num_crops: list[int]  # per input image


def preprocess_images(
    images: list[Image.Image], config: Gemma3ImageConfig, sources: list[str] | None = None
) -> Gemma3Pixels:
    """Equal to Gemma3ImageProcessorPil(**config)(images): pixel_values and num_crops."""
    if not images:
        raise VisionInputError("no images to preprocess")
    names = list(sources) if sources else [None] * len(images)
    processed, num_crops = [], []
    for image, name in zip(images, names):
        parts = split_pan_and_scan(apply_convert_rgb(image, config.do_convert_rgb, name), config)
        num_crops.append(len(parts) - 1)
        processed.extend(apply_gemma3_steps(part, config) for part in parts)
    shapes = {array.shape for array in processed}
    if len(shapes) > 1:  # only with do_resize false; transformers cannot stack these either
        raise VisionInputError(f"images preprocess to different shapes {sorted(shapes)}; set do_resize to true")
    return Gemma3Pixels(np.stack(processed), num_crops)


# --- prompt expansion (Gemma3Processor) ---


@dataclass(frozen=True)
class Gemma3ImageTokens:
    """The tokenizer's image tokens: strings for text expansion, ids for the features' positions."""

    boi: str = BOI_TOKEN
    image: str = IMAGE_TOKEN
    eoi: str = EOI_TOKEN
    boi_id: int = 255_999  # Gemma3Config.boi_token_index
    image_id: int = 262_144  # Gemma3Config.image_token_index
    eoi_id: int = 256_000  # Gemma3Config.eoi_token_index


def image_sequence_text(tokens_per_image: int, tokens: Gemma3ImageTokens = Gemma3ImageTokens()) -> str:
    """Gemma3Processor.full_image_sequence."""
    return f"\n\n{tokens.boi}{tokens.image * tokens_per_image}{tokens.eoi}\n\n"


def image_replacement_text(
    num_crops: int, tokens_per_image: int, tokens: Gemma3ImageTokens = Gemma3ImageTokens()
) -> str:
    """Gemma3Processor.replace_image_token: what one `<start_of_image>` in the prompt becomes."""
    sequence = image_sequence_text(tokens_per_image, tokens)
    if not num_crops:
        return sequence
    return f"{PAN_AND_SCAN_INTRO}{sequence}{PAN_AND_SCAN_CROPS}" + " ".join([sequence] * num_crops)


def expand_prompt_text(
    text: str, num_crops: list[int], tokens_per_image: int, tokens: Gemma3ImageTokens = Gemma3ImageTokens()
) -> str:
    """The prompt with its i-th `<start_of_image>` replaced by image i's sequence, left to right
    over the original text (the replacements are not rescanned), as Gemma3Processor does."""
    pieces = text.split(tokens.boi)
    if len(pieces) - 1 != len(num_crops):
        raise MlxcelError(f"the prompt has {len(pieces) - 1} {tokens.boi} placeholder(s) for {len(num_crops)} image(s)")
    out = [pieces[0]]
    for crops, piece in zip(num_crops, pieces[1:]):
        out.append(image_replacement_text(crops, tokens_per_image, tokens))
        out.append(piece)
    return "".join(out)


def expand_prompt_ids(
    text: str,
    num_crops: list[int],
    tokens_per_image: int,
    encode: Callable[[str], list[int]],
    tokens: Gemma3ImageTokens = Gemma3ImageTokens(),
) -> list[int]:
    """Prompt ids as Gemma3Processor gives them: the text expanded, then `encode`d (the
    tokenizer, with the special tokens recognised and no BOS added twice: the chat template
    writes `<bos>`). Checks that every image got its soft tokens."""
    ids = list(encode(expand_prompt_text(text, num_crops, tokens_per_image, tokens)))
    expected = count_image_tokens(num_crops, tokens_per_image)
    found = sum(1 for t in ids if t == tokens.image_id)
    if found != expected:
        raise MlxcelError(
            f"the expanded prompt has {found} {tokens.image} tokens for {expected} image features: "
            f"the tokenizer does not map {tokens.image} to id {tokens.image_id}"
        )
    return ids


def image_token_layout(tokens_per_image: int, tokens: Gemma3ImageTokens = Gemma3ImageTokens()) -> list[int]:
    """The ids of one image's special-token core, `<start_of_image>`, the soft tokens,
    `<end_of_image>`: the part of the expansion no tokenizer merge can touch (the `\\n\\n` on each
    side is text and tokenizes with its neighbours; see expand_prompt_ids)."""
    return [tokens.boi_id, *[tokens.image_id] * tokens_per_image, tokens.eoi_id]


def count_image_tokens(num_crops: list[int], tokens_per_image: int) -> int:
    """Soft tokens (= projected feature rows) of a prompt's images: each image and each crop is one
    tower input pooled to tokens_per_image (mm_tokens_per_image)."""
    return sum(1 + crops for crops in num_crops) * tokens_per_image


def image_token_type_ids(token_ids: list[int], image_id: int = Gemma3ImageTokens.image_id) -> list[int]:
    """transformers' token_type_ids (mm_token_type_ids): 1 at the soft tokens only, 0 elsewhere
    (boi/eoi included). The language model's bidirectional image attention reads these."""
    return [int(t == image_id) for t in token_ids]
