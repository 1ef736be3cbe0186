"""Qwen2-VL / Qwen2.5-VL: the language side. A Qwen2 decoder whose RoPE is multimodal (M-RoPE,
mlxcel/models/mrope.py): a prefill holding images takes explicit [3, B, L] position ids; every
other forward (text prompts, decode) is plain RoPE at the cache's position, shifted per row
after an image prompt.

Checkpoints come in two layouts: the Hub's (`model.*`, `visual.*`, `lm_head.*`; transformers 5
still saves this) and transformers' in-memory one (`model.language_model.*`, `model.visual.*`).
config.json keeps the text settings at the top level (Hub) or under `text_config` (newer saves).
The vision tower joins through mlxcel/vision (the `visual.*` weights); until a request carries an
image it is never evaluated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlxcel.models import llama
from mlxcel.models.mrope import MRoPE

REQUIRED_KEYS = ("model_type",)
DEFAULT_MROPE_SECTION = [16, 24, 24]  # Qwen2-VL-2B/7B and Qwen2.5-VL: head_dim 128
LANGUAGE_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.", "language_model.lm_head.": "lm_head."}
VISION_PREFIXES = {"model.visual.": "visual.", "visual.": "visual."}


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
        base = llama.ModelArgs.from_config(config, attention_bias=True, o_proj_bias=False, rope_scaling=None, **overrides)
        return cls(
            **vars(base),
            mrope_section=read_mrope_section(config),
            image_token_id=config.get("image_token_id"),
            vision_config=config.get("vision_config"),
        )


class Model(llama.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        for layer in self.model.layers:
            layer.self_attn.rope = MRoPE(args.head_dim, args.rope_theta, args.mrope_section)

    def forward_with_embeddings(
        self, embeddings: mx.array, cache: list, mask: Any = None, logits_at: int | None = None, positions: mx.array | None = None
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
        renamed = {}
        for key, value in weights.items():
            prefix = next((p for p in (*LANGUAGE_PREFIXES, *VISION_PREFIXES) if key.startswith(p)), None)
            if prefix in VISION_PREFIXES:
                continue  # the vision tower is loaded by the vision stage (not part of this module yet)
            renamed[LANGUAGE_PREFIXES[prefix] + key[len(prefix) :] if prefix else key] = value
        return super().sanitize(renamed)
