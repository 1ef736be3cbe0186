"""Phi-4-multimodal (model_type phi4_multimodal, transformers' Phi4MultimodalForCausalLM): the
Phi-4-mini language model (mlxcel/models/phi3.py) with a SigLIP image encoder and a vision LoRA.

Images (mlxcel/vision/processors/phi4_multimodal.py): each image is padded to a grid of 448x448 crops
(up to `dynamic_hd`) plus a 448x448 global view. The SigLIP tower (`feature_layer`: the second
to last layer's output, no post-norm) runs on every crop with Idefics3's masked, bucketized
position ids; 2x2 average pooling leaves 16x16 features per crop. The features are laid out as
transformers' Phi4MultimodalImageEmbedding does: the crops' grid cut to its real (unpadded) part,
each row followed by `sub_img_feature_extensor`, then `global_img_feature_extensor`, then the
global view (rows also followed by the separator), through img_projection_up -> GELU -> down.
The prompt's `<|image|>` token is repeated once per feature.

Vision LoRA: the released model adapts the language model to images with a LoRA on every
layer's qkv/o/gate_up/down projections, shipped as a PEFT adapter in `vision-lora/` next to the
weights (transformers loads it with `load_adapter`). It is read at the first image and applies
to image rows only, so a text row gives the same tokens alone or batched with images
(mlxcel/models/lora.py). A prefill whose rows all have images runs with the adapter fused into the
weights; `after_prefill` unfuses it, and decoding adds the low-rank term for the image rows.

The audio encoder is not built (audio inputs are not supported): its weights are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from mlxcel.errors import MlxcelError
from mlxcel.models import phi3
from mlxcel.models.lora import LoRAControl, load_peft_adapter, make_lora_linear
from mlxcel.vision import siglip
from mlxcel.vision.phi4_multimodal_projector import ImageEmbedding
from mlxcel.vision.processors import phi4_multimodal as processor
from mlxcel.vision.stage import ImageInputs

REQUIRED_KEYS = phi3.REQUIRED_KEYS
# Phi4MultimodalVisionConfig's defaults where they differ from SiglipVisionArgs'
VISION_DEFAULTS = {
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "image_size": 448,
    "patch_size": 14,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
DEFAULT_IMAGE_TOKEN_ID = 200010
DEFAULT_FEATURE_LAYER = -2
LORA_TARGETS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
ADAPTER_FOLDER = "vision-lora"
VISION_PREFIX = "model.embed_tokens_extend.image_embed."
AUDIO_PREFIX = "model.embed_tokens_extend.audio_embed."


@dataclass
class ModelArgs:
    text: phi3.ModelArgs
    vision: siglip.SiglipVisionArgs = field(
        default_factory=siglip.SiglipVisionArgs
    )  # num_hidden_layers: the layers run
    image_token_id: int = DEFAULT_IMAGE_TOKEN_ID
    crop_size: int = 448

    @classmethod
    def from_config(cls, config: dict, **overrides: Any) -> ModelArgs:
        """`overrides` go to the language model's args (the top level of config.json)."""
        raw = {**VISION_DEFAULTS, **{k: v for k, v in (config.get("vision_config") or {}).items() if v is not None}}
        vision = siglip.SiglipVisionArgs.from_config(raw)
        layers = count_feature_layers(vision.num_hidden_layers, raw.get("feature_layer", DEFAULT_FEATURE_LAYER))
        crop = raw.get("crop_size", vision.image_size)
        if crop != vision.image_size:
            raise MlxcelError(
                f"vision_config.crop_size {crop} differs from image_size {vision.image_size} (the processor's "
                "crops are the tower's input)"
            )
        text = phi3.ModelArgs.from_config(config, **overrides)
        return cls(
            text=text,
            vision=replace(vision, num_hidden_layers=layers),
            image_token_id=raw.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID),
            crop_size=crop,
        )


def count_feature_layers(num_layers: int, feature_layer: object) -> int:
    """How many encoder layers produce hidden_states[feature_layer] (index 0 is the embeddings)."""
    if not (isinstance(feature_layer, int) and not isinstance(feature_layer, bool)):
        raise MlxcelError(f"vision_config.feature_layer must be an int (got {feature_layer!r})")
    index = feature_layer if feature_layer >= 0 else num_layers + 1 + feature_layer
    if not 1 <= index <= num_layers:
        raise MlxcelError(
            f"vision_config.feature_layer {feature_layer} selects no encoder layer of {num_layers} (legal: "
            f"1..{num_layers} or -{num_layers}..-1)"
        )
    return index


def find_target(layer: nn.Module, path: str) -> nn.Module:
    """A decoder layer's projection named by a LORA_TARGETS path ("self_attn.qkv_proj")."""
    parent, name = path.split(".")
    return getattr(getattr(layer, parent), name)


class Model(phi3.Model):
    # evaluated at the first image, not at load (loader.read_language_parameters)
    vision_modules = ("image_embed",)

    def __init__(self, args: ModelArgs):
        super().__init__(args.text)
        self.model_type = "phi4_multimodal"
        self.phi4_args = args
        self.image_token_id = args.image_token_id
        self.lora_control = LoRAControl()
        for layer in self.model.layers:
            for path in LORA_TARGETS:
                parent, name = path.split(".")
                old = find_target(layer, path)
                out_dims, in_dims = old.weight.shape
                setattr(
                    getattr(layer, parent), name, make_lora_linear(in_dims, out_dims, "bias" in old, self.lora_control)
                )
        self.image_embed = ImageEmbedding(args.vision, args.text.hidden_size)
        self._folder: Path | None = None
        self._image_config: processor.Phi4ImageConfig | None = None
        self._lora_loaded = False

    @property
    def supports_compiled_decode(self) -> bool:
        return False  # which rows take the vision LoRA is decided on the host at every call

    # ---- the vision stage (mlxcel/vision/stage.py) ----------------------------------------------

    def attach_preprocessor(self, folder: str | Path) -> None:
        self._folder = Path(folder)
        self._image_config = None
        self._lora_loaded = False

    def image_config(self) -> processor.Phi4ImageConfig:
        if self._image_config is None:
            folder = self._folder
            if folder is None:
                raise MlxcelError(
                    "this phi4_multimodal model has no image processor (load it from a checkpoint folder to use images)"
                )
            path = folder / "preprocessor_config.json"
            if not path.is_file():
                raise MlxcelError(
                    f"{folder}: no preprocessor_config.json, which images need (copy it from the original checkpoint)"
                )
            config = processor.Phi4ImageConfig.load(path)
            vision = self.phi4_args.vision
            if (config.size, config.patch_size) != (vision.image_size, vision.patch_size):
                raise MlxcelError(
                    f"{path}: crops of {config.size} px in {config.patch_size} px patches, but the vision tower takes "
                    f"{vision.image_size} px in {vision.patch_size} px patches (vision_config.image_size / patch_size)"
                )
            self._image_config = config
        return self._image_config

    def load_vision_lora(self) -> None:
        """The vision LoRA adapter (`vision-lora/` beside the weights), read once."""
        if self._lora_loaded:
            return
        layers = {
            f"model.layers.{i}.{path}": find_target(layer, path)
            for i, layer in enumerate(self.model.layers)
            for path in LORA_TARGETS
        }
        if self._folder is None:
            raise MlxcelError(
                "phi4_multimodal: images need the vision LoRA adapter, but the model was not loaded from a folder"
            )
        load_peft_adapter(self._folder / ADAPTER_FOLDER, layers, self.model.norm.weight.dtype)
        self._lora_loaded = True

    def preprocess_images(self, images: list, sources: list[str]) -> ImageInputs:
        """Each image's crops (global view first) concatenated; extras: the patch masks and each
        image's crop grid."""
        config = self.image_config()
        self.load_vision_lora()
        prepared = [processor.preprocess_image(image, config, source) for image, source in zip(images, sources)]
        pixels = np.concatenate([p.pixel_values for p in prepared])
        masks = np.concatenate([p.patch_mask for p in prepared])
        return ImageInputs(pixels, [p.num_tokens for p in prepared], {"patch_mask": masks, "images": prepared})

    def encode_images(self, inputs: ImageInputs) -> mx.array:
        """[sum(token_counts), hidden]: each image's crops through the tower (one image at a time:
        up to dynamic_hd + 1 crops of 1024 patches), arranged and projected."""
        embed, out, start = self.image_embed, [], 0
        for image in inputs.extras["images"]:
            stop = start + image.pixel_values.shape[0]
            pooled = embed.encode_crops(inputs.pixel_values[start:stop], inputs.extras["patch_mask"][start:stop])
            out.append(embed.arrange_image(pooled, image))
            start = stop
        features = embed.project(mx.concatenate(out, axis=0))
        if features.shape[0] != sum(inputs.token_counts):
            raise MlxcelError(f"{features.shape[0]} image features for {sum(inputs.token_counts)} image tokens")
        return features

    # ---- the language model with the vision LoRA -------------------------------------------------

    def make_prefill_extras(
        self, token_ids: list[int], inputs: ImageInputs | None, pad: int
    ) -> tuple[dict[str, mx.array], int]:
        """Whether the row takes the vision LoRA, at every position of it [1, pad + L]; no position shift."""
        return {"vision_rows": mx.full((1, pad + len(token_ids)), inputs is not None, dtype=mx.bool_)}, 0

    def forward_with_embeddings(
        self,
        embeddings: mx.array,
        cache: list,
        mask: Any = None,
        logits_at: int | None = None,
        vision_rows: mx.array | None = None,
    ) -> mx.array:
        first = cache[0]
        if hasattr(first, "table"):  # a paged cache: the scheduler sets lora_control per call
            return super().forward_with_embeddings(embeddings, cache, mask, logits_at)
        if vision_rows is not None and not hasattr(
            first, "vision_lora_rows"
        ):  # the first prefill piece of an image batch
            flags = vision_rows[:, 0].tolist()  # built on the host: a tiny read
            dtype = self.model.norm.weight.dtype  # the compute dtype: no cast in every adapted layer's decode step
            first.vision_lora_rows = mx.array(flags, dtype=dtype).reshape(-1, 1, 1) if any(flags) else None
            self.lora_control.fused = all(flags)
        control = self.lora_control
        control.rows = getattr(first, "vision_lora_rows", None)  # the request's rows, kept on its cache for decoding
        if control.rows is None:
            control.fused = False
        return super().forward_with_embeddings(embeddings, cache, mask, logits_at)

    def after_prefill(self) -> None:
        """Decoding adds the low-rank term per row instead of merging the adapter at every step."""
        self.lora_control.fused = False

    # ---- weights ---------------------------------------------------------------------------------

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        language, vision = {}, {}
        for key, value in weights.items():
            if key.startswith(AUDIO_PREFIX):
                continue  # audio inputs are not supported
            if ".base_layer." in key or ".lora_A." in key or ".lora_B." in key:
                raise MlxcelError(
                    f"weight {key}: LoRA tensors inside the checkpoint (the original remote-code layout) are not "
                    "supported; "
                    "use the transformers-format checkpoint, whose adapters are in vision-lora/ and speech-lora/"
                )
            if key.startswith(VISION_PREFIX):
                vision[key[len(VISION_PREFIX) :]] = value
            else:
                language[key] = value
        return {
            **super().sanitize(language),
            **{f"image_embed.{k}": v for k, v in self.image_embed.sanitize(vision).items()},
        }
