"""Idefics3 (model_type idefics3) and SmolVLM (smolvlm): a SigLIP-style vision tower
(transformers' Idefics3VisionTransformer / SmolVLMVisionTransformer: SigLIP's layers with
`MaskedEmbeddings`, bucketized position ids over each frame's real patches), the connector (pixel
shuffle + a linear projection, mlxcel/vision/idefics3_projector.py) and one of mlxcel's text families
as the language model (`text_config.model_type`, llama for every released checkpoint).

As for LLaVA (mlxcel/models/llava.py), the Model is the text family's Model with the vision parts
added (a subclass per text family), so the engine and the segmented decoder see the plain text
model; `model.args` is the text family's ModelArgs, the Idefics3 settings are `model.idefics3_args`.

Images: the Idefics3 / SmolVLM image processor (mlxcel/vision/processors/idefics3.py) gives each
image rows x cols tiles plus a global view (or one frame); every frame becomes image_seq_len =
(image_size / patch_size)^2 / scale_factor^2 features. The prompt's `<image>` placeholders are
rewritten as the processors write them (`expand_image_text`): `<fake_token_around_image>`,
`<row_r_col_c>`, `<global-img>` and `<image>` * image_seq_len per frame, with newlines between tile
rows; SmolVLM reads the three token strings from its tokenizer config (Idefics3's are fixed).
Padding frames (all zero, as transformers tests) are dropped before the tower.

Checkpoint layouts: transformers' save and the Hub files (`model.text_model.*`, `model.vision_model.*`,
`model.connector.*`, `lm_head.*`) and MLX conversions (`language_model.model.*`,
`language_model.lm_head.*`, `vision_model.*`, `connector.*`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from mlxcel.errors import MlxcelError
from mlxcel.models.text_backbone import OverTextModel, make_text_args, read_text_config
from mlxcel.vision import siglip
from mlxcel.vision.idefics3_projector import Idefics3Connector, count_tile_tokens
from mlxcel.vision.processors import idefics3 as processor
from mlxcel.vision.stage import ImageInputs, check_placeholder_count

REQUIRED_KEYS = ("model_type",)
# Idefics3VisionConfig's / SmolVLMVisionConfig's defaults where they differ from SiglipVisionArgs'
VISION_DEFAULTS = {
    "hidden_size": 1152,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "image_size": 224,
    "patch_size": 32,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
DEFAULT_IMAGE_TOKEN_ID = 128257
DEFAULT_SCALE_FACTOR = 2
# checkpoint prefix -> ours, first match wins
RENAMES = {
    "model.text_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.vision_model.": "vision_model.",
    "model.connector.": "connector.",
}


@dataclass
class ModelArgs:
    model_type: str  # idefics3 or smolvlm
    text: Any  # the language model's ModelArgs
    vision: siglip.SiglipVisionArgs = field(default_factory=siglip.SiglipVisionArgs)
    image_token_id: int = DEFAULT_IMAGE_TOKEN_ID
    scale_factor: int = DEFAULT_SCALE_FACTOR

    @property
    def text_model_type(self) -> str:
        return self.text.model_type

    @property
    def image_seq_len(self) -> int:
        return count_tile_tokens(self.vision.image_size, self.vision.patch_size, self.scale_factor)

    @classmethod
    def from_config(cls, config: dict, **overrides: Any) -> ModelArgs:
        """`overrides` go to the language model's args."""
        # Idefics3Config / SmolVLMConfig build a default llama text config with rms_norm_eps 1e-5
        text_config = read_text_config(config, default_text={"rms_norm_eps": 1e-5})
        vision = siglip.SiglipVisionArgs.from_config(
            {**VISION_DEFAULTS, **{k: v for k, v in (config.get("vision_config") or {}).items() if v is not None}}
        )
        scale = config.get("scale_factor", DEFAULT_SCALE_FACTOR)
        if not (isinstance(scale, int) and not isinstance(scale, bool) and scale > 0):
            raise MlxcelError(f"scale_factor must be a positive int (got {scale!r})")
        side = vision.image_size // vision.patch_size
        if side % scale:
            raise MlxcelError(
                f"vision_config: a {side}x{side} patch grid cannot be pixel-shuffled by scale_factor {scale}"
            )
        return cls(
            model_type=config.get("model_type", "idefics3"),
            text=make_text_args(text_config, **overrides),
            vision=vision,
            image_token_id=config.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID),
            scale_factor=scale,
        )


def make_vision_model(args: siglip.SiglipVisionArgs) -> siglip.SiglipVisionModel:
    tower = siglip.SiglipVisionModel(args)
    tower.embeddings = siglip.MaskedEmbeddings(args)
    return tower


def make_patch_mask(pixel_mask: np.ndarray, patch: int) -> np.ndarray:
    """[F, H, W] pixel mask -> [F, H / patch, W / patch]: a patch is real when any of its pixels is
    (transformers' unfold, which drops a remainder)."""
    frames, height, width = pixel_mask.shape
    rows, cols = height // patch, width // patch
    blocks = pixel_mask[:, : rows * patch, : cols * patch].reshape(frames, rows, patch, cols, patch)
    return blocks.any(axis=(2, 4))


class Model(OverTextModel, nn.Module):
    """Constructed as `Model(args)`, it is an instance of the subclass of both this class and the
    text family's Model (text_backbone.OverTextModel)."""

    # evaluated at the first image, not at load (loader.read_language_parameters)
    vision_modules = ("vision_model", "connector")

    def __init__(self, args: ModelArgs):
        super().__init__(args.text)
        self.model_type = args.model_type
        self.idefics3_args = args
        self.image_token_id = args.image_token_id
        self.vision_model = make_vision_model(args.vision)
        self.connector = Idefics3Connector(args.vision.hidden_size, args.text.hidden_size, args.scale_factor)
        self._preprocessor_folder: Path | None = None
        self._image_config = None
        self._prompt_tokens = None

    # ---- the vision stage (mlxcel/vision/stage.py) ----------------------------------------------

    def attach_preprocessor(self, folder: str | Path) -> None:
        """Remember the checkpoint folder; preprocessor_config.json (and, for SmolVLM, the tokenizer
        config's image token names) are read on the first image."""
        self._preprocessor_folder = Path(folder)
        self._image_config = None
        self._prompt_tokens = None

    def image_config(self) -> processor.Idefics3ImageConfig:
        if self._image_config is None:
            self._image_config = self.read_image_config()
        return self._image_config

    def read_image_config(self) -> processor.Idefics3ImageConfig:
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
        config = processor.Idefics3ImageConfig.load(path)
        size = self.idefics3_args.vision.image_size
        if config.max_image_size != size:
            raise MlxcelError(
                f"{path}: max_image_size.longest_edge {config.max_image_size} (the tile side) differs from the vision "
                "tower's "
                f"image_size {size} (vision_config.image_size)"
            )
        seq_len = self.read_processor_seq_len(folder)
        if seq_len is not None and seq_len != self.idefics3_args.image_seq_len:
            raise MlxcelError(
                f"{folder / 'processor_config.json'}: image_seq_len {seq_len} differs from the model's "
                f"{self.idefics3_args.image_seq_len} features per tile ((image_size / patch_size)^2 / scale_factor^2)"
            )
        return config

    @staticmethod
    def read_processor_seq_len(folder: Path) -> int | None:
        path = folder / "processor_config.json"
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text()).get("image_seq_len")
        except (json.JSONDecodeError, AttributeError) as exc:
            raise MlxcelError(f"{path}: invalid JSON ({exc})") from exc

    def prompt_tokens(self) -> processor.ImagePromptTokens:
        """Idefics3Processor's fixed strings; SmolVLMProcessor's come from the tokenizer (its config)."""
        if self._prompt_tokens is None:
            tokens = processor.ImagePromptTokens()
            folder = self._preprocessor_folder
            if self.model_type == "smolvlm" and folder is not None and (folder / "tokenizer_config.json").is_file():
                from mlxcel.tokenizer.hf import load_tokenizer_config

                tokens = processor.ImagePromptTokens.from_tokenizer_config(load_tokenizer_config(folder))
            self._prompt_tokens = tokens
        return self._prompt_tokens

    def preprocess_images(self, images: list, sources: list[str]) -> ImageInputs:
        """One prompt's frames ([1, frames, 3, H, W]) and each image's `<image>` count; extras: the
        pixel mask and each image's rows and cols of tiles."""
        batch = processor.preprocess_images(images, self.image_config(), sources)
        seq_len = self.idefics3_args.image_seq_len
        sample = batch.images[0]
        counts = [processor.count_image_tokens(image.rows, image.cols, seq_len) for image in sample]
        extras = {
            "pixel_attention_mask": batch.pixel_attention_mask,
            "rows": [im.rows for im in sample],
            "cols": [im.cols for im in sample],
        }
        return ImageInputs(batch.pixel_values, counts, extras)

    def expand_image_text(self, text: str, inputs: ImageInputs, paths: list[str]) -> str:
        """The rendered prompt with each `<image>` replaced by its image's layout, as the processors do."""
        tokens = self.prompt_tokens()
        pieces = text.split(tokens.image)
        check_placeholder_count(len(pieces) - 1, list(paths))
        seq_len = self.idefics3_args.image_seq_len
        layouts = [
            processor.make_image_prompt(r, c, seq_len, tokens)
            for r, c in zip(inputs.extras["rows"], inputs.extras["cols"])
        ]
        out = pieces[0]
        for layout, piece in zip(layouts, pieces[1:]):
            out += layout + piece
        return out

    def encode_frames(self, pixel_values: mx.array, patch_mask: np.ndarray) -> mx.array:
        """[F, C, H, W] frames and their [F, rows, cols] patch mask -> [F, image_seq_len, text hidden]."""
        tower = self.vision_model
        embeddings = tower.embeddings(pixel_values, patch_mask)
        hidden = tower.encode(embeddings, mx.array(patch_mask.reshape(patch_mask.shape[0], -1)))
        return self.connector(hidden)

    def encode_images(self, inputs: ImageInputs) -> mx.array:
        """[sum(token_counts), hidden] image features in order (every real frame's, tiles then global view)."""
        pixels = np.asarray(inputs.pixel_values)
        pixels = pixels.reshape(-1, *pixels.shape[-3:])
        mask = inputs.extras.get("pixel_attention_mask")
        mask = (
            np.ones((pixels.shape[0], *pixels.shape[-2:]), dtype=bool)
            if mask is None
            else np.asarray(mask).reshape(-1, *pixels.shape[-2:])
        )
        real = (pixels != 0).any(axis=(1, 2, 3))  # transformers drops all-zero (padding) frames
        pixels, mask = pixels[real], mask[real]
        patch_mask = make_patch_mask(mask, self.idefics3_args.vision.patch_size)
        features = self.encode_frames(mx.array(pixels), patch_mask)
        features = features.reshape(-1, features.shape[-1])
        if features.shape[0] != sum(inputs.token_counts):
            raise MlxcelError(f"{features.shape[0]} image features for {sum(inputs.token_counts)} image tokens")
        return features

    # ---- weights ---------------------------------------------------------------------------------

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        language, vision, connector = {}, {}, {}
        for key, value in weights.items():
            prefix = next((p for p in RENAMES if key.startswith(p)), None)
            key = RENAMES[prefix] + key[len(prefix) :] if prefix else key
            if key.startswith("vision_model."):
                vision[key[len("vision_model.") :]] = value
            elif key.startswith("connector."):
                connector[key] = value
            else:
                language[key] = value
        tower = {f"vision_model.{k}": v for k, v in self.vision_model.sanitize(vision).items()}
        projection = {f"connector.{k}": v for k, v in self.connector.sanitize(connector).items()}
        return {**super().sanitize(language), **tower, **projection}
