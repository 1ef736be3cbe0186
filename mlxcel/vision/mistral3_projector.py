"""Mistral 3's multimodal projector (transformers' `Mistral3MultiModalProjector`): RMSNorm over the
Pixtral tower's patch features, the patch merger (each image's spatial_merge_size x spatial_merge_size
neighbourhoods of patches concatenated as torch's `unfold` lays them out, then a bias-free linear back
to the vision width), linear_1 -> GELU -> linear_2 to the language model's width.
[sum of patches, vision hidden] + image sizes -> [sum of merged tokens, text hidden]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxcel.vision.clip_vit import make_activation


@dataclass
class Mistral3ProjectorArgs:
    vision_hidden_size: int = 1024
    text_hidden_size: int = 5120
    patch_size: int = 14
    spatial_merge_size: int = 2
    projector_hidden_act: str = "gelu"
    multimodal_projector_bias: bool = False
    rms_norm_eps: float = 1e-5

    @classmethod
    def from_config(cls, config: dict, **overrides: Any) -> Mistral3ProjectorArgs:
        """From a Mistral3 config.json dict. Defaults are Mistral3Config's (Mistral-Small-3.1); the norm's
        eps is the text model's rms_norm_eps, as in transformers (MistralConfig's 1e-6 when text_config
        leaves it out)."""
        vision = config.get("vision_config") or {}
        text = config.get("text_config")
        layer = config.get("vision_feature_layer", -1)
        if not isinstance(layer, int):
            # transformers sizes linear_1 for a list but norms and merges at the vision width, so a list
            # cannot run there either.
            raise ValueError(f"vision_feature_layer must be one int for Mistral 3 (got {layer!r})")
        values = dict(
            vision_hidden_size=vision.get("hidden_size", 1024),
            text_hidden_size=(text or {}).get("hidden_size", 5120),
            patch_size=vision.get("patch_size", 14),
            spatial_merge_size=config.get("spatial_merge_size", 2),
            projector_hidden_act=config.get("projector_hidden_act", "gelu"),
            multimodal_projector_bias=bool(config.get("multimodal_projector_bias", False)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)) if text is not None else 1e-5,
        )
        return cls(**{**values, **overrides})


def merge_patches(features: mx.array, grids: list[tuple[int, int]], merge: int) -> mx.array:
    """Per image, [rows * cols, d] -> [(rows // m) * (cols // m), d * m * m]: windows row-major, each
    window's features ordered (channel, row in window, column in window), as torch's unfold gives them.
    Rows or columns beyond whole windows are dropped, as unfold drops them."""
    out, start = [], 0
    d = features.shape[-1]
    for rows, cols in grids:
        grid = features[start : start + rows * cols].reshape(rows, cols, d)
        start += rows * cols
        gh, gw = rows // merge, cols // merge
        grid = grid[: gh * merge, : gw * merge].reshape(gh, merge, gw, merge, d)
        out.append(grid.transpose(0, 2, 4, 1, 3).reshape(gh * gw, d * merge * merge))
    return mx.concatenate(out)


class PatchMerger(nn.Module):
    def __init__(self, args: Mistral3ProjectorArgs):
        super().__init__()
        self.args = args
        self.merging_layer = nn.Linear(
            args.vision_hidden_size * args.spatial_merge_size**2, args.vision_hidden_size, bias=False
        )

    def __call__(self, features: mx.array, image_sizes) -> mx.array:
        grids = patch_grids(image_sizes, self.args.patch_size)
        if sum(rows * cols for rows, cols in grids) != features.shape[0]:
            raise ValueError(f"{features.shape[0]} patch features for image sizes {np.asarray(image_sizes).tolist()}")
        return self.merging_layer(merge_patches(features, grids, self.args.spatial_merge_size))


def patch_grids(image_sizes, patch_size: int) -> list[tuple[int, int]]:
    """(rows, cols) of patches per image from the (height, width) pixel sizes."""
    return [(int(h) // patch_size, int(w) // patch_size) for h, w in np.asarray(image_sizes).reshape(-1, 2)]


def count_merged_tokens(image_sizes, patch_size: int, merge: int) -> list[int]:
    """Projected features per image: what transformers splits Mistral3's output by."""
    return [(rows // merge) * (cols // merge) for rows, cols in patch_grids(image_sizes, patch_size)]


class Mistral3MultiModalProjector(nn.Module):
    def __init__(self, args: Mistral3ProjectorArgs):
        super().__init__()
        self.args = args
        self.norm = nn.RMSNorm(args.vision_hidden_size, eps=args.rms_norm_eps)
        self.patch_merger = PatchMerger(args)
        self.act = make_activation(args.projector_hidden_act)
        bias = args.multimodal_projector_bias
        self.linear_1 = nn.Linear(args.vision_hidden_size, args.text_hidden_size, bias=bias)
        self.linear_2 = nn.Linear(args.text_hidden_size, args.text_hidden_size, bias=bias)

    def __call__(self, features: mx.array, image_sizes) -> mx.array:
        """features [sum of patches, vision hidden] from the tower; image_sizes [(height, width), ...]
        in pixels, as the processor reports them."""
        x = self.patch_merger(self.norm(features), image_sizes)
        return self.linear_2(self.act(self.linear_1(x)))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Names relative to the projector (transformers 5.24 saves `multi_modal_projector.*`, in memory
        `model.multi_modal_projector.*`); they match the modules as they are."""
        return dict(weights)


def make_mistral3_projector(config: dict) -> Mistral3MultiModalProjector:
    return Mistral3MultiModalProjector(Mistral3ProjectorArgs.from_config(config))
