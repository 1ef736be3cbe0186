"""Idefics3 / SmolVLM connector: transformers' `Idefics3Connector` (SmolVLM's `SmolVLMConnector` is
the same): pixel shuffle by `scale_factor` (each s x s block of vision patches becomes one token of
s^2 times the width) then `modality_projection.proj`, a linear layer without bias, to the language
model's width. A tile of (image_size / patch_size)^2 patches gives image_seq_len =
(image_size / patch_size)^2 / s^2 tokens.

Checkpoint names (transformers 5.24's save_pretrained of Idefics3ForConditionalGeneration and
SmolVLMForConditionalGeneration, and the Hub files): `model.connector.modality_projection.proj.weight`;
converted MLX checkpoints drop the `model.` level (`connector.modality_projection.proj.*`, with
`scales`/`biases` when quantized). `sanitize` takes either and returns names relative to the connector."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn

from mlxcel.errors import ConfigError, ConfigIssue, MlxcelError

# Idefics3Config's / SmolVLMConfig's defaults (Idefics3VisionConfig.hidden_size, LlamaConfig.hidden_size)
DEFAULT_SCALE_FACTOR = 2
DEFAULT_VISION_HIDDEN = 1152
DEFAULT_TEXT_HIDDEN = 4096
CHECKPOINT_PREFIXES = ("model.connector.", "connector.")


def pixel_shuffle(x: mx.array, scale_factor: int) -> mx.array:
    """[B, seq, D] -> [B, seq / s^2, D * s^2], transformers' reshape/permute sequence (row-major
    semantics, so MLX's reshape of a transposed array matches torch's reshape)."""
    batch, seq, dims = x.shape
    side = int(seq**0.5)
    s = scale_factor
    if side * side != seq or side % s:
        raise MlxcelError(
            f"pixel shuffle by {s} needs a square patch grid with a side divisible by {s} (got {seq} patches)"
        )
    x = x.reshape(batch, side, side, dims)
    x = x.reshape(batch, side, side // s, dims * s)
    x = x.transpose(0, 2, 1, 3)
    x = x.reshape(batch, side // s, side // s, dims * s * s)
    x = x.transpose(0, 2, 1, 3)
    return x.reshape(batch, seq // (s * s), dims * s * s)


class ModalityProjection(nn.Module):
    """transformers' Idefics3SimpleMLP: one linear layer, no bias."""

    def __init__(self, input_size: int, output_size: int):
        super().__init__()
        self.proj = nn.Linear(input_size, output_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.proj(x)


class Idefics3Connector(nn.Module):
    def __init__(self, vision_hidden_size: int, text_hidden_size: int, scale_factor: int = DEFAULT_SCALE_FACTOR):
        super().__init__()
        self.scale_factor = scale_factor
        self.modality_projection = ModalityProjection(vision_hidden_size * scale_factor**2, text_hidden_size)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Idefics3Connector:
        """From an Idefics3 / SmolVLM config.json (scale_factor, vision_config.hidden_size,
        text_config.hidden_size; transformers' defaults where absent)."""
        vision, text = config.get("vision_config") or {}, config.get("text_config") or {}
        values = {
            "scale_factor": config.get("scale_factor", DEFAULT_SCALE_FACTOR),
            "vision_config.hidden_size": vision.get("hidden_size", DEFAULT_VISION_HIDDEN),
            "text_config.hidden_size": text.get("hidden_size", DEFAULT_TEXT_HIDDEN),
        }
        issues = [
            ConfigIssue(key, "must be a positive int", value)
            for key, value in values.items()
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0)
        ]
        if issues:
            raise ConfigError(issues, hint="fix the checkpoint's config.json")
        return cls(values["vision_config.hidden_size"], values["text_config.hidden_size"], values["scale_factor"])

    def __call__(self, image_hidden_states: mx.array) -> mx.array:
        """[tiles, patches, vision hidden] (the tower's post-layernormed last hidden state) ->
        [tiles, patches / s^2, text hidden]."""
        return self.modality_projection(pixel_shuffle(image_hidden_states, self.scale_factor))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The connector's weights, named relative to it, from a whole checkpoint's (or already relative) names."""
        out = {}
        for name, w in weights.items():
            prefix = next((p for p in CHECKPOINT_PREFIXES if name.startswith(p)), "")
            name = name[len(prefix) :]
            if name.startswith("modality_projection."):
                out[name] = w
        return out


def count_tile_tokens(image_size: int, patch_size: int, scale_factor: int) -> int:
    """image_seq_len: features per tile, as Idefics3Model computes it (processor_config.json's value)."""
    return int(((image_size // patch_size) ** 2) / (scale_factor**2))
