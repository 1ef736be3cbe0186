"""Mistral 3 (model_type mistral3: Mistral-Small-3.1/3.2): the Pixtral vision transformer
(mlxcel/vision/pixtral_vit.py), Mistral 3's projector with its patch merger
(mlxcel/vision/mistral3_projector.py) and one of mlxcel's text families as the language model,
picked by `text_config.model_type` (mistral, as Mistral3Config defaults to; llama also works; mistral4 in
Mistral-Small-4's folders: models/mistral4.py).

The Model is the text family's Model with `vision_tower` and `multi_modal_projector` added (a
subclass built per text family, as LLaVA's: the engine and the segmented decoder see the same
layers, caches and logits as for the plain text model). `model.args` is the text family's
ModelArgs; the Mistral 3 settings are in `model.mistral3_args`.

Images keep their own sizes: the image processor (PixtralImageProcessor, preprocessor_config.json)
resizes each to fit `size.longest_edge`, its sides rounded up to `patch_size * spatial_merge_size`
(the processor's patch size, processor_config.json), so every image is whole merge windows. The
tower gives one feature per patch, the projector one per spatial_merge_size^2 patches. In the prompt
each image's single `[IMG]` becomes, per row of merged patches, that many `[IMG]` then `[IMG_BREAK]`,
the last `[IMG_BREAK]` being `[IMG_END]` (PixtralProcessor's layout, `expand_image_tokens`); only
the `[IMG]` positions take features. The `[IMG_BREAK]` / `[IMG_END]` ids are read from the
checkpoint's tokenizer files (tokenizer.json, tokenizer_config.json) at the first image.

Checkpoint layouts, all accepted: transformers 5's save and in-memory names (`model.language_model.*`,
`model.vision_tower.*`, `model.multi_modal_projector.*`, `lm_head.*`), the Hub's files
(`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`, `multi_modal_projector.*`)
and mlx-vlm conversions (a `vision_model.` level in the tower, channels-last conv kernel).

Tied embeddings: Mistral3Config says tie_word_embeddings=true by default, but transformers only
ties when the checkpoint has no separate head (Mistral-Small-3.1 ships `language_model.lm_head`
and its config leaves the key out). So the weights decide: a head in the checkpoint is used, none
means the embeddings are tied.
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
from mlxcel.models.llava import RENAMES
from mlxcel.models.text_backbone import OverTextModel, make_text_args, read_text_config
from mlxcel.vision import mistral3_projector, pixtral_vit
from mlxcel.vision.processors import pixtral
from mlxcel.vision.stage import ImageInputs, check_placeholder_count, count_placeholders

REQUIRED_KEYS = ("model_type",)
SUPPORTED_TEXT = ("mistral", "llama", "mistral4")  # mistral4: Mistral-Small-4's released folders
SUPPORTED_TOWERS = ("pixtral",)
# Mistral3Config's sub-config defaults: used when config.json has no text_config / vision_config at all.
DEFAULT_TEXT_CONFIG = {
    "model_type": "mistral",
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 32768,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000000.0,
    "sliding_window": None,
    "vocab_size": 131072,
}
DEFAULT_VISION_CONFIG = {
    "model_type": "pixtral",
    "intermediate_size": 4096,
    "hidden_size": 1024,
    "patch_size": 14,
    "image_size": 1540,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "head_dim": 64,
    "hidden_act": "gelu",
}


@dataclass
class ModelArgs:
    model_type: str  # mistral3
    text: Any  # the language model's ModelArgs (its family's class)
    vision_config: dict = field(default_factory=dict)
    projector: mistral3_projector.Mistral3ProjectorArgs = field(
        default_factory=mistral3_projector.Mistral3ProjectorArgs
    )
    image_token_id: int = 10
    vision_feature_layer: int = -1
    spatial_merge_size: int = 2

    @property
    def text_model_type(self) -> str:
        return self.text.model_type

    @classmethod
    def from_config(cls, config: dict, **overrides: Any) -> ModelArgs:
        """`overrides` go to the language model's args."""
        text_config = read_text_config(config, DEFAULT_TEXT_CONFIG, SUPPORTED_TEXT, default_kind="mistral")
        raw_vision = config.get("vision_config")
        vision_config = dict(DEFAULT_VISION_CONFIG if raw_vision is None else raw_vision)
        tower = vision_config.get("model_type", "pixtral")
        if tower not in SUPPORTED_TOWERS:
            raise MlxcelError(
                f"mistral3: vision tower {tower!r} is not supported (supported: {', '.join(SUPPORTED_TOWERS)})"
            )
        layer = config.get("vision_feature_layer", -1)
        try:
            projector = mistral3_projector.Mistral3ProjectorArgs.from_config(
                {**config, "text_config": text_config, "vision_config": vision_config}
            )
        except ValueError as exc:
            raise MlxcelError(f"mistral3: {exc}") from exc
        return cls(
            model_type=config.get("model_type", "mistral3"),
            text=make_text_args(text_config, **overrides),
            vision_config=vision_config,
            projector=projector,
            image_token_id=config.get("image_token_index", config.get("image_token_id", 10)),
            vision_feature_layer=layer,
            spatial_merge_size=projector.spatial_merge_size,
        )


@dataclass(frozen=True)
class ImageSetup:
    """What images need besides the model: the image processor's config, the patch size its resize
    rounds to, and the layout token ids."""

    image_config: pixtral.PixtralImageConfig
    resize_patch: int
    break_token_id: int
    end_token_id: int


def read_json_file(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MlxcelError(f"{path}: unreadable JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise MlxcelError(f"{path}: expected a JSON object")
    return value


def read_token_ids(folder: Path) -> dict[str, int]:
    """token text -> id for the special tokens the tokenizer files name: tokenizer.json's
    added_tokens (and, for the layout tokens, its model vocab), tokenizer_config.json's
    added_tokens_decoder."""
    ids: dict[str, int] = {}
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        for key, entry in (read_json_file(config_path).get("added_tokens_decoder") or {}).items():
            if isinstance(entry, dict) and "content" in entry and str(key).isdigit():
                ids.setdefault(entry["content"], int(key))
    tokenizer_path = folder / "tokenizer.json"
    if tokenizer_path.is_file():
        raw = read_json_file(tokenizer_path)
        for entry in raw.get("added_tokens") or []:
            if isinstance(entry, dict) and "content" in entry and "id" in entry:
                ids[entry["content"]] = int(entry["id"])
        vocab = (raw.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            for name in (pixtral.IMAGE_TOKEN, pixtral.IMAGE_BREAK_TOKEN, pixtral.IMAGE_END_TOKEN):
                if name in vocab and name not in ids:
                    ids[name] = int(vocab[name])
    return ids


class Model(OverTextModel, nn.Module):
    """Constructed as `Model(args)`, it is an instance of the subclass of both this class and the
    text family's Model (text_backbone.OverTextModel): Mistral 3's methods first, then the language model's."""

    # evaluated at the first image, not at load (loader.read_language_parameters)
    vision_modules = ("vision_tower", "multi_modal_projector")

    def __init__(self, args: ModelArgs):
        super().__init__(args.text)  # the language model's Model: self.args, self.model, lm_head
        self.model_type = args.model_type
        self.mistral3_args = args
        self.image_token_id = args.image_token_id
        try:
            self.vision_tower = pixtral_vit.make_pixtral_vision_model(args.vision_config)
            self.vision_tower.resolve_layer(args.vision_feature_layer)
        except ValueError as exc:
            raise MlxcelError(f"mistral3: {exc}") from exc
        self.multi_modal_projector = mistral3_projector.Mistral3MultiModalProjector(args.projector)
        # Plain attributes (not parameters): set by attach_preprocessor, read on the first image.
        self._preprocessor_folder: Path | None = None
        self._image_setup: ImageSetup | None = None

    # ---- the vision stage (mlxcel/vision/stage.py) ----------------------------------------------

    def attach_preprocessor(self, folder: str | Path) -> None:
        """Remember the checkpoint folder; its preprocessor_config.json, processor_config.json and
        tokenizer files are read on the first image, so a folder without them still serves text."""
        self._preprocessor_folder = Path(folder)
        self._image_setup = None

    def image_setup(self) -> ImageSetup:
        if self._image_setup is None:
            self._image_setup = self.read_image_setup()
        return self._image_setup

    @property
    def model_patch(self) -> int:
        """The patch window one image token covers: the tower's patch x the projector's merge."""
        return self.vision_tower.args.patch_size * self.mistral3_args.spatial_merge_size

    def read_image_setup(self) -> ImageSetup:
        folder = self._preprocessor_folder
        if folder is None:
            raise MlxcelError(
                "this mistral3 model has no image processor (load it from a checkpoint folder to use images)"
            )
        path = folder / "preprocessor_config.json"
        if not path.is_file():
            raise MlxcelError(
                f"{folder}: no preprocessor_config.json, which images need (copy it from the original checkpoint)"
            )
        image_config = pixtral.PixtralImageConfig.load(path)  # a ConfigError (an MlxcelError) names bad keys
        names = {
            "image_token": pixtral.IMAGE_TOKEN,
            "image_break_token": pixtral.IMAGE_BREAK_TOKEN,
            "image_end_token": pixtral.IMAGE_END_TOKEN,
        }
        resize_patch = self.model_patch
        processor_path = folder / "processor_config.json"
        if processor_path.is_file():
            raw = read_json_file(processor_path)
            names.update({k: raw[k] for k in names if isinstance(raw.get(k), str)})
            # PixtralProcessor's defaults (patch 16, merge 1) when the file leaves them out
            patch, merge = raw.get("patch_size", 16), raw.get("spatial_merge_size", 1)
            if not (isinstance(patch, int) and isinstance(merge, int) and patch > 0 and merge > 0):
                raise MlxcelError(
                    f"{processor_path}: patch_size and spatial_merge_size must be positive ints (got {patch!r}, "
                    f"{merge!r})"
                )
            resize_patch = patch * merge
            if resize_patch % self.model_patch:
                raise MlxcelError(
                    f"{processor_path}: images resized to multiples of patch_size * spatial_merge_size = {patch} * "
                    f"{merge} = "
                    f"{resize_patch} px, but each image token covers {self.model_patch} px (vision_config.patch_size "
                    f"{self.vision_tower.args.patch_size} x spatial_merge_size {self.mistral3_args.spatial_merge_size} "
                    "in config.json)"
                )
        ids = read_token_ids(folder)
        if not ids:
            raise MlxcelError(
                f"{folder}: no tokenizer.json or tokenizer_config.json with added tokens, which images need "
                f"(the ids of {names['image_break_token']} and {names['image_end_token']})"
            )
        missing = [name for name in names.values() if name not in ids]
        if missing:
            raise MlxcelError(
                f"{folder}: the tokenizer files do not name {', '.join(missing)} (the image layout tokens)"
            )
        if ids[names["image_token"]] != self.image_token_id:
            raise MlxcelError(
                f"{folder}: the tokenizer's {names['image_token']} is id {ids[names['image_token']]}, but "
                f"config.json's image_token_index is {self.image_token_id}"
            )
        return ImageSetup(image_config, resize_patch, ids[names["image_break_token"]], ids[names["image_end_token"]])

    def preprocess_images(self, images: list, sources: list[str]) -> ImageInputs:
        """Pixel values (transformers' zero-padded batch [n, 3, H, W]) and each image's `[IMG]` count;
        extras: image_sizes [n, 2] (height, width of each image in the batch)."""
        setup = self.image_setup()
        values, sizes = pixtral.preprocess_images(images, setup.image_config, sources, patch_size=setup.resize_patch)
        patch, merge = self.vision_tower.args.patch_size, self.mistral3_args.spatial_merge_size
        counts = mistral3_projector.count_merged_tokens(sizes, patch, merge)
        for count, (h, w), source in zip(counts, sizes.tolist(), sources):
            if count == 0:
                raise MlxcelError(
                    f"{source}: preprocesses to {w}x{h}, which holds no {patch * merge}x{patch * merge} patch window"
                )
        return ImageInputs(pixtral.pad_images(values), counts, {"image_sizes": sizes})

    def expand_image_tokens(self, token_ids: list[int], inputs: ImageInputs, paths: list[str]) -> list[int]:
        """Each image's one `[IMG]` as its rows: `[IMG]` x columns then `[IMG_BREAK]`, the last break
        `[IMG_END]` (PixtralProcessor.replace_image_token)."""
        check_placeholder_count(count_placeholders(token_ids, self.image_token_id), paths)
        setup = self.image_setup()
        patch, merge = self.vision_tower.args.patch_size, self.mistral3_args.spatial_merge_size
        layouts = iter(
            pixtral.expand_image_tokens(
                int(h), int(w), self.image_token_id, setup.break_token_id, setup.end_token_id, patch, merge, source
            )
            for (h, w), source in zip(inputs.extras["image_sizes"], paths)
        )
        expanded: list[int] = []
        for token in token_ids:
            expanded.extend(next(layouts) if token == self.image_token_id else [token])
        return expanded

    def encode_images(self, inputs: ImageInputs) -> mx.array:
        """[sum(token_counts), hidden] image features in order, in the language model's dtype."""
        sizes = np.asarray(inputs.extras["image_sizes"]).reshape(-1, 2)
        dtype = self.model.norm.weight.dtype  # stays floating when the model is quantized
        pixels = mx.array(inputs.pixel_values).astype(dtype)
        patches = self.vision_tower(pixels, sizes, self.mistral3_args.vision_feature_layer)
        features = self.multi_modal_projector(patches, sizes)
        if features.shape[0] != sum(inputs.token_counts):
            raise MlxcelError(
                f"the vision tower gave {features.shape[0]} features for {sum(inputs.token_counts)} image tokens"
            )
        return features.astype(dtype)

    # ---- weights ---------------------------------------------------------------------------------

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        language, vision, projector = {}, {}, {}
        for key, value in weights.items():
            prefix = next((p for p in RENAMES if key.startswith(p)), None)
            key = RENAMES[prefix] + key[len(prefix) :] if prefix else key
            if key.startswith("vision_tower."):
                vision[key[len("vision_tower.") :]] = value
            elif key.startswith("multi_modal_projector."):
                projector[key[len("multi_modal_projector.") :]] = value
            else:
                language[key] = value
        self.settle_tied_head("lm_head.weight" in language)
        tower = {f"vision_tower.{k}": v for k, v in self.vision_tower.sanitize(vision).items()}
        merger = {f"multi_modal_projector.{k}": v for k, v in self.multi_modal_projector.sanitize(projector).items()}
        return {**super().sanitize(language), **tower, **merger}

    def settle_tied_head(self, has_head: bool) -> None:
        """A separate head when the checkpoint has one, tied embeddings when it has none (transformers
        unties a tied config whose checkpoint holds a different head)."""
        if has_head and self.args.tie_word_embeddings:
            self.args.tie_word_embeddings = False
            self.lm_head = nn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False)
        elif not has_head and not self.args.tie_word_embeddings:
            self.args.tie_word_embeddings = True
            if "lm_head" in self:
                del self.lm_head
