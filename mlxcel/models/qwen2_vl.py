"""Qwen2-VL / Qwen2.5-VL: a Qwen2 decoder whose RoPE is multimodal (M-RoPE, mlxcel/models/mrope.py)
plus the vision tower (mlxcel/vision/qwen2_vl_vit.py, patch merger included) as `visual`.
A prefill holding images takes explicit [3, B, L] position ids (`make_positions`); every other
forward (text prompts, decode) is plain RoPE at the cache's position, shifted per row after an
image prompt. The vision stage's contract (mlxcel/vision/stage.py) is `preprocess_images`,
`encode_images` and `make_positions`; video inputs are not supported.

Checkpoints come in two layouts: the Hub's (`model.*`, `visual.*`, `lm_head.*`; transformers 5
still saves this) and transformers' in-memory one (`model.language_model.*`, `model.visual.*`).
config.json keeps the text settings at the top level (Hub) or under `text_config` (newer saves).
mlx-vlm conversions say `language_model.*` and `vision_tower.*`. The tower's weights are only
read by `encode_images`, so a text prompt never touches them (the loader's final mx.eval of all
parameters still materialises them once at load).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcel.errors import MlxcelError
from mlxcel.models import llama
from mlxcel.models.mrope import MRoPE, make_mrope_positions
from mlxcel.vision.processors import qwen2_vl as processor
from mlxcel.vision.qwen2_vl_vit import QwenVisionModel, make_qwen_vision_model
from mlxcel.vision.stage import ImageInputs

REQUIRED_KEYS = ("model_type",)
DEFAULT_MROPE_SECTION = [16, 24, 24]  # Qwen2-VL-2B/7B and Qwen2.5-VL: head_dim 128
LANGUAGE_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
VISION_PREFIXES = ("model.visual.", "visual.", "vision_tower.")  # transformers in memory / Hub / mlx-vlm


def normalize_config(config: dict) -> dict:
    """The language model's settings at the top level (newer configs nest them in text_config)."""
    if "text_config" not in config:
        return config
    text = {**config["text_config"]}
    for key in ("model_type", "tie_word_embeddings", "image_token_id", "vision_start_token_id", "vision_config"):
        if key in config:
            text[key] = config[key]
    text.setdefault("eos_token_id", config.get("eos_token_id"))
    return text


def read_mrope_section(config: dict) -> list[int]:
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    return list(rope.get("mrope_section", DEFAULT_MROPE_SECTION))


@dataclass
class ModelArgs(llama.ModelArgs):
    mrope_section: list[int] = field(default_factory=lambda: list(DEFAULT_MROPE_SECTION))
    image_token_id: int | None = None
    vision_config: dict | None = None

    @classmethod
    def from_config(cls, config: dict, **overrides: Any) -> ModelArgs:
        config = normalize_config(config)
        base = llama.ModelArgs.from_config(
            config, attention_bias=True, o_proj_bias=False, rope_scaling=None, **overrides
        )
        return cls(
            **vars(base),
            mrope_section=read_mrope_section(config),
            image_token_id=config.get("image_token_id"),
            vision_config=config.get("vision_config"),
        )


def make_vision_tower(args: ModelArgs) -> QwenVisionModel:
    """The top-level model_type says which tower (Hub vision configs carry no model_type); no
    vision_config at all means transformers' defaults, which VisionArgs mirrors."""
    variant = "qwen2_5_vl" if args.model_type == "qwen2_5_vl" else "qwen2_vl"
    return make_qwen_vision_model(args.vision_config or {}, variant)


class Model(llama.Model):
    vision_modules = ("visual",)  # evaluated at the first image, not at load (loader.read_language_parameters)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        for layer in self.model.layers:
            layer.self_attn.rope = MRoPE(args.head_dim, args.rope_theta, args.mrope_section)
        self.visual = make_vision_tower(args)
        self.image_token_id = args.image_token_id  # None: the pipeline treats the model as text-only
        # Plain attributes (not parameters): set by attach_preprocessor, read on the first image.
        self._preprocessor_folder: Path | None = None
        self._image_config: processor.Qwen2VLImageConfig | None = None

    # ---- the vision stage (mlxcel/vision/stage.py) ----------------------------------------------

    def attach_preprocessor(self, folder: str | Path) -> None:
        """Remember where preprocessor_config.json lives; it is read on the first image, so a
        folder without one still loads and serves text prompts."""
        self._preprocessor_folder = Path(folder)
        self._image_config = None

    def image_config(self) -> processor.Qwen2VLImageConfig:
        if self._image_config is None:
            self._image_config = self.read_image_config()
        return self._image_config

    def read_image_config(self) -> processor.Qwen2VLImageConfig:
        folder = self._preprocessor_folder
        if folder is None:
            raise MlxcelError(
                "this Qwen2-VL model has no image processor (load it from a checkpoint folder to use images)"
            )
        path = folder / "preprocessor_config.json"
        if not path.is_file():
            raise MlxcelError(
                f"{folder}: no preprocessor_config.json, which images need (copy it from the original checkpoint)"
            )
        config = processor.Qwen2VLImageConfig.load(path)
        check_processor_matches_tower(config, self.visual, path)
        return config

    def preprocess_images(self, images: list, sources: list[str]) -> ImageInputs:
        config = self.image_config()
        pixel_values, grid_thw = processor.preprocess_images(images, config, sources)
        counts = [processor.count_image_tokens(grid, config.merge_size) for grid in grid_thw]
        return ImageInputs(pixel_values, counts, {"grid_thw": grid_thw})

    def encode_images(self, inputs: ImageInputs) -> mx.array:
        """[sum(token_counts), hidden] merged patch features, in the language model's dtype."""
        pixels = mx.array(inputs.pixel_values)  # the tower's patch embedding casts to its own dtype
        features = self.visual(pixels, inputs.extras["grid_thw"])
        if features.shape[0] != sum(inputs.token_counts):
            raise MlxcelError(
                f"the vision tower gave {features.shape[0]} features for {sum(inputs.token_counts)} image tokens"
            )
        # norm weights stay floating when the model is quantized (embed_tokens' may be uint32)
        return features.astype(self.model.norm.weight.dtype)

    def make_positions(self, token_ids: list[int], inputs: ImageInputs | None) -> tuple[mx.array, int]:
        """M-RoPE ids [3, L] int32 of the (expanded) prompt and the shift its decode continues at.
        Without images these are plain positions 0..L-1 and shift 0, so a caller may use them
        for every row alike."""
        grids = [] if inputs is None else [tuple(int(n) for n in g) for g in inputs.extras["grid_thw"]]
        image_token = -1 if self.image_token_id is None else self.image_token_id  # -1: no token is an image
        positions, shift = make_mrope_positions(token_ids, grids, image_token, self.visual.args.spatial_merge_size)
        return mx.array(positions.astype(np.int32)), shift

    prefill_extras_are_positions = True  # the scheduler slices them per piece and shifts decode by the row's shift

    def make_prefill_extras(
        self, token_ids: list[int], inputs: ImageInputs | None, pad: int
    ) -> tuple[dict[str, mx.array], int]:
        """The engine's per-row prefill inputs: M-RoPE ids [3, 1, pad + L] (padding at 0, masked
        anyway) and the row's decode shift."""
        positions, shift = self.make_positions(token_ids, inputs)
        return {"positions": mx.pad(positions, [(0, 0), (pad, 0)])[:, None]}, shift

    def forward_with_embeddings(
        self,
        embeddings: mx.array,
        cache: list,
        mask: Any = None,
        logits_at: int | None = None,
        positions: mx.array | None = None,
    ) -> mx.array:
        """As llama's; `positions` [3, B, L] rotates this piece by explicit M-RoPE ids."""
        if positions is None:
            return super().forward_with_embeddings(embeddings, cache, mask, logits_at)
        h = embeddings
        masks = self.make_masks(h.shape[1], cache) if mask is None else [mask] * len(cache)
        for layer, layer_cache, layer_mask in zip(self.model.layers, cache, masks):
            attention = layer.self_attn
            q, k, v = attention.prepare(layer.input_layernorm(h), positions)
            k, v = layer_cache.update_and_fetch(k, v)
            h = layer.finish_block(h, attention.finish(attention.attend(q, k, v, layer_mask)))
        if logits_at is not None:
            h = h[:, logits_at : logits_at + 1, :]
        return self.compute_logits(self.model.norm(h))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        language, vision = {}, {}
        for key, value in weights.items():
            prefix = next((p for p in (*LANGUAGE_PREFIXES, *VISION_PREFIXES) if key.startswith(p)), None)
            if prefix in VISION_PREFIXES:
                vision[key[len(prefix) :]] = value
            else:
                language[LANGUAGE_PREFIXES[prefix] + key[len(prefix) :] if prefix else key] = value
        # The tower renames its own (Conv3d kernel -> Linear, rotary tables dropped).
        tower = {f"visual.{k}": v for k, v in self.visual.sanitize(vision).items()}
        return {**super().sanitize(language), **tower}


def check_processor_matches_tower(config: processor.Qwen2VLImageConfig, tower: QwenVisionModel, source: Path) -> None:
    """The processor cuts patches and counts tokens; the tower must agree or features and
    placeholders no longer line up (an error here beats a shape error deep in the tower)."""
    a = tower.args
    pairs = {
        "patch_size": a.patch_size,
        "temporal_patch_size": a.temporal_patch_size,
        "merge_size": a.spatial_merge_size,
    }
    wrong = [
        f"{key} {getattr(config, key)} (vision_config: {value})"
        for key, value in pairs.items()
        if getattr(config, key) != value
    ]
    if wrong:
        raise MlxcelError(f"{source}: {', '.join(wrong)} disagree with config.json's vision tower")
