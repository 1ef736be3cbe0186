"""LLaVA-1.5 (model_type llava) and LLaVA-NeXT / v1.6 (llava_next): a CLIP vision tower
(mlxcel/vision/clip_vit.py), a two-layer projector (mlxcel/vision/llava_projector.py), and one of
mlxcel's text families as the language model, picked by `text_config.model_type` (llama: LLaVA-1.5,
NeXT-Vicuna, NeXT-34B; mistral: NeXT-Mistral, BakLLaVA, whose sliding_window may be null; qwen2:
NeXT-72B/110B).

The Model is the text family's Model with the vision parts added (a subclass built per text
family, so the engine and the segmented decoder see the same `model.layers`, `compute_logits`,
`make_masks`, caches and sliding windows as for the plain text model): `vision_tower`,
`multi_modal_projector` (linear_1, projector_hidden_act, linear_2) and, for NeXT,
`image_newline`. `model.args` is the text family's ModelArgs; the LLaVA settings are in
`model.llava_args`.

Per image, the tower's `vision_feature_layer` hidden states (an index or a list, concatenated)
go through `vision_feature_select_strategy` ("default" drops CLS) and the projector. LLaVA-1.5
gives (image_size / patch_size)^2 (+1 with "full") features per image. LLaVA-NeXT runs every
any-res tile (the whole-image base tile first), then packs as transformers' `pack_image_features`:
the base tile's features, then the tiles' grid with the rows/columns that saw only padding
removed (by the original size) and `image_newline` after each row.

Checkpoint layouts, all accepted: transformers 5's save (`language_model.model.*`,
`language_model.lm_head.*`, `vision_tower.*`, `multi_modal_projector.*`, `image_newline`), the
Hub's llava-hf files (the same with `vision_tower.vision_model.*`), and transformers' in-memory
names (`model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`,
`model.image_newline`, `lm_head.*`).

The vision stage's contract (mlxcel/vision/stage.py): `image_token_id`, `attach_preprocessor`,
`preprocess_images` (the checkpoint's preprocessor_config.json: CLIPImageProcessor for llava,
LlavaNextImageProcessor for llava_next), `encode_images`. Positions are the standard ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from mlxcel.errors import MlxcelError
from mlxcel.models.text_backbone import OverTextModel, make_text_args, read_text_config
from mlxcel.vision import clip_vit
from mlxcel.vision.llava_projector import MultiModalProjector
from mlxcel.vision.processors import clip, llava_next
from mlxcel.vision.stage import ImageInputs

REQUIRED_KEYS = ("model_type",)
# The CLIP tower has one class token: what llava-hf's processor_config.json calls
# num_additional_image_tokens=1 (the count the model's features really have).
CLS_TOKENS = 1

DEFAULT_GRID_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]  # LlavaNextConfig's
SUPPORTED_TOWERS = ("clip_vision_model",)
# checkpoint prefix -> ours, first match wins
RENAMES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.vision_tower.": "vision_tower.",
    "model.multi_modal_projector.": "multi_modal_projector.",
    "model.image_newline": "image_newline",
}


@dataclass
class ModelArgs:
    model_type: str  # llava or llava_next
    text: Any  # the language model's ModelArgs (its family's class)
    vision_config: dict = field(default_factory=dict)
    image_token_id: int = 32000
    vision_feature_layer: int | list[int] = -2
    vision_feature_select_strategy: str = "default"
    projector_hidden_act: str = "gelu"
    multimodal_projector_bias: bool = True
    image_grid_pinpoints: list[list[int]] | None = None  # llava_next only

    @property
    def text_model_type(self) -> str:
        return self.text.model_type

    @classmethod
    def from_config(cls, config: dict, **overrides: Any) -> ModelArgs:
        """`overrides` go to the language model's args."""
        text_config = read_text_config(config)
        vision_config = dict(config.get("vision_config") or {})
        tower = vision_config.get("model_type", "clip_vision_model")
        if tower not in SUPPORTED_TOWERS:
            raise MlxcelError(
                f"{config.get('model_type')}: vision tower {tower!r} is not supported yet (supported: "
                f"{', '.join(SUPPORTED_TOWERS)})"
            )
        image_token = config.get("image_token_index", config.get("image_token_id", 32000))
        is_next = config.get("model_type") == "llava_next"
        return cls(
            model_type=config.get("model_type", "llava"),
            text=make_text_args(text_config, **overrides),
            vision_config=vision_config,
            image_token_id=image_token,
            vision_feature_layer=config.get("vision_feature_layer", -2),
            vision_feature_select_strategy=config.get("vision_feature_select_strategy", "default"),
            projector_hidden_act=config.get("projector_hidden_act", "gelu"),
            multimodal_projector_bias=config.get("multimodal_projector_bias", True),
            image_grid_pinpoints=(config.get("image_grid_pinpoints") or DEFAULT_GRID_PINPOINTS) if is_next else None,
        )


def feature_layers(layer: int | list[int]) -> list[int]:
    return [layer] if isinstance(layer, int) else list(layer)


def check_feature_args(args: ModelArgs, tower: clip_vit.ClipVisionModel) -> None:
    total = tower.args.num_hidden_layers + 1
    layers = feature_layers(args.vision_feature_layer)
    if not layers or any(not isinstance(i, int) or not -total <= i < total for i in layers):
        raise MlxcelError(
            f"vision_feature_layer {args.vision_feature_layer} is out of range for {total} hidden states of the vision "
            "tower"
        )
    if args.vision_feature_select_strategy not in clip.FEATURE_STRATEGIES:
        raise MlxcelError(
            f"vision_feature_select_strategy must be 'default' or 'full' (got {args.vision_feature_select_strategy!r})"
        )


class Model(OverTextModel, nn.Module):
    """Constructed as `Model(args)`, it is an instance of the subclass of both this class and the
    text family's Model (text_backbone.OverTextModel): LLaVA's methods first, then the language model's."""

    # evaluated at the first image, not at load (loader.read_language_parameters)
    vision_modules = ("vision_tower", "multi_modal_projector", "image_newline")

    def __init__(self, args: ModelArgs):
        super().__init__(args.text)  # the language model's Model: self.args, self.model, lm_head
        self.model_type = args.model_type
        self.llava_args = args
        self.image_token_id = args.image_token_id
        self.vision_tower = clip_vit.make_clip_vision_model(args.vision_config)
        check_feature_args(args, self.vision_tower)
        n_layers = len(feature_layers(args.vision_feature_layer))
        self.multi_modal_projector = MultiModalProjector(
            self.vision_tower.args.hidden_size * n_layers,
            args.text.hidden_size,
            args.projector_hidden_act,
            args.multimodal_projector_bias,
        )
        if args.model_type == "llava_next":
            self.image_newline = mx.zeros((args.text.hidden_size,))
        # Plain attributes (not parameters): set by attach_preprocessor, read on the first image.
        self._preprocessor_folder: Path | None = None
        self._image_config = None

    # ---- the vision stage (mlxcel/vision/stage.py) ----------------------------------------------

    @property
    def is_next(self) -> bool:
        return self.llava_args.model_type == "llava_next"

    def attach_preprocessor(self, folder: str | Path) -> None:
        """Remember where preprocessor_config.json lives; it is read on the first image, so a
        folder without one still loads and serves text prompts."""
        self._preprocessor_folder = Path(folder)
        self._image_config = None

    def image_config(self) -> clip.ClipImageConfig | llava_next.LlavaNextImageConfig:
        if self._image_config is None:
            self._image_config = self.read_image_config()
        return self._image_config

    def read_image_config(self) -> clip.ClipImageConfig | llava_next.LlavaNextImageConfig:
        folder = self._preprocessor_folder
        if folder is None:
            raise MlxcelError(
                f"this {self.model_type} model has no image processor (load it from a checkpoint folder to use images)"
            )
        path = folder / "preprocessor_config.json"
        if not path.is_file():
            raise MlxcelError(
                f"{folder}: no preprocessor_config.json, which images need (copy it from the original checkpoint)"
            )
        if not self.is_next:
            return clip.ClipImageConfig.load(path)
        config = llava_next.LlavaNextImageConfig.load(path)
        pinpoints = tuple(tuple(p) for p in self.llava_args.image_grid_pinpoints)
        if config.image_grid_pinpoints != pinpoints:
            raise MlxcelError(
                f"{path}: image_grid_pinpoints {[list(p) for p in config.image_grid_pinpoints]} disagree with "
                "config.json's "
                f"{[list(p) for p in pinpoints]} (the tiles would not match the features' grid)"
            )
        return config

    def check_pixels(self, pixel_values: np.ndarray) -> None:
        size = self.vision_tower.args.image_size
        if pixel_values.shape[-2:] != (size, size):
            raise MlxcelError(
                f"{self._preprocessor_folder / 'preprocessor_config.json'}: images preprocess to "
                f"{tuple(pixel_values.shape[-2:])}, "
                f"but the vision tower takes {size}x{size} (vision_config.image_size)"
            )

    def preprocess_images(self, images: list, sources: list[str]) -> ImageInputs:
        """Pixel values and each image's `<image>` count, as LlavaProcessor / LlavaNextProcessor
        expand it; NeXT's extras: image_sizes (original height, width) and patch_counts (tiles)."""
        config = self.image_config()
        vision = self.vision_tower.args
        strategy = self.llava_args.vision_feature_select_strategy
        if not self.is_next:
            pixel_values = clip.preprocess_images(images, config, sources)
            self.check_pixels(pixel_values)
            count = clip.count_image_tokens(vision.image_size, vision.patch_size, strategy, CLS_TOKENS)
            return ImageInputs(pixel_values, [count] * len(images))
        if strategy != "default":
            raise MlxcelError(
                f"LLaVA-NeXT with vision_feature_select_strategy {strategy!r} is not supported: its tiles' features"
                " do not fill the any-res grid (transformers fails on it too); use 'default'"
            )
        batch = llava_next.preprocess_images(images, config, sources)
        self.check_pixels(batch.pixel_values)
        counts = [
            llava_next.count_image_tokens(
                int(h),
                int(w),
                config,
                patch_size=vision.patch_size,
                image_size=vision.image_size,
                vision_feature_select_strategy=strategy,
                num_additional_image_tokens=CLS_TOKENS,
            )
            for h, w in batch.image_sizes
        ]
        return ImageInputs(
            batch.pixel_values, counts, {"image_sizes": batch.image_sizes, "patch_counts": batch.patch_counts}
        )

    def project_images(self, pixel_values: mx.array) -> mx.array:
        """[n, C, H, W] -> [n, features per image, hidden]: the tower's selected states, projected."""
        features = self.vision_tower.image_features(
            pixel_values, self.llava_args.vision_feature_layer, self.llava_args.vision_feature_select_strategy
        )
        return self.multi_modal_projector(features)

    def encode_images(self, inputs: ImageInputs) -> mx.array:
        """[sum(token_counts), hidden] image features in order, in the language model's dtype."""
        if self.is_next:
            counts = inputs.extras["patch_counts"]
            tiles = np.concatenate([inputs.pixel_values[i, :n] for i, n in enumerate(counts)])
            projected = self.project_images(mx.array(tiles))
            bounds = np.cumsum(counts)[:-1].tolist()
            sizes = [(int(h), int(w)) for h, w in inputs.extras["image_sizes"]]
            features = mx.concatenate([self.pack_image(p, size) for p, size in zip(mx.split(projected, bounds), sizes)])
        else:
            projected = self.project_images(mx.array(inputs.pixel_values))
            features = projected.reshape(-1, projected.shape[-1])
        if features.shape[0] != sum(inputs.token_counts):
            raise MlxcelError(
                f"the vision tower gave {features.shape[0]} features for {sum(inputs.token_counts)} image tokens"
            )
        # norm weights stay floating when the model is quantized (embed_tokens' may be uint32)
        return features.astype(self.model.norm.weight.dtype)

    def pack_image(self, features: mx.array, size: tuple[int, int]) -> mx.array:
        """One image's tiles [tiles, side * side, hidden] as transformers' pack_image_features: the
        base tile's features, then the any-res grid unpadded by the original `size` (height,
        width), `image_newline` after each row."""
        newline = self.image_newline.astype(features.dtype)
        if features.shape[0] == 1:
            return mx.concatenate([features[0], newline[None]])
        vision = self.vision_tower.args
        side = vision.image_size // vision.patch_size
        best = llava_next.plan_best_resolution(*size, self.llava_args.image_grid_pinpoints)
        rows, cols = best[0] // vision.image_size, best[1] // vision.image_size
        grid, dims = features[1:], features.shape[-1]
        if grid.shape[:2] != (rows * cols, side * side):
            raise MlxcelError(
                f"image features {tuple(grid.shape[:2])} do not fill a {rows}x{cols} grid of {side}x{side} tiles"
            )
        grid = (
            grid.reshape(rows, cols, side, side, dims).transpose(0, 2, 1, 3, 4).reshape(rows * side, cols * side, dims)
        )
        (top, bottom), (left, right) = plan_unpad(size, (rows * side, cols * side))
        grid = grid[top:bottom, left:right]
        grid = mx.concatenate([grid, mx.broadcast_to(newline, (grid.shape[0], 1, dims))], axis=1)
        return mx.concatenate([features[0], grid.reshape(-1, dims)])

    # ---- weights ---------------------------------------------------------------------------------

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        language, vision, rest = {}, {}, {}
        for key, value in weights.items():
            prefix = next((p for p in RENAMES if key.startswith(p)), None)
            key = RENAMES[prefix] + key[len(prefix) :] if prefix else key
            if key.startswith("vision_tower."):
                vision[key[len("vision_tower.") :]] = value
            elif key.startswith("multi_modal_projector.") or key == "image_newline":
                rest[key] = value
            else:
                language[key] = value
        # The tower renames its own (no vision_model level, position_ids dropped, conv layout).
        tower = {f"vision_tower.{k}": v for k, v in self.vision_tower.sanitize(vision).items()}
        return {**super().sanitize(language), **tower, **rest}


def plan_unpad(size: tuple[int, int], grid: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """transformers' unpad_image: ((top, bottom), (left, right)) of the feature grid that holds
    the image (resized to fit the pinpoint, centred in its padding)."""
    height, width = size
    grid_height, grid_width = grid
    if width / height > grid_width / grid_height:
        new_height = int(round(height * (grid_width / width), 7))
        pad = (grid_height - new_height) // 2
        return (pad, grid_height - pad), (0, grid_width)
    new_width = int(round(width * (grid_height / height), 7))
    pad = (grid_width - new_width) // 2
    return (0, grid_height), (pad, grid_width - pad)
