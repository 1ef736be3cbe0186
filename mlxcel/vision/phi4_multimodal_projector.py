"""Phi-4-multimodal's image embedding (transformers' `Phi4MultimodalImageEmbedding`, names kept so
the weights load as they are): the SigLIP tower over every crop, 2x2 average pooling, the crops laid
out in prompt order with their separators, then img_projection_up -> GELU -> img_projection_down.
transformers keeps tower and projector in this one module, so we do too."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx import nn

from mlxcel.vision import siglip
from mlxcel.vision.processors import phi4_multimodal as processor


def pool_features(features: mx.array, side: int) -> mx.array:
    """[F, side*side, D] -> [F, ceil(side/2), ceil(side/2), D]: 2x2 average pooling, an odd grid
    first reflection-padded by one row and column (transformers' ReflectionPad2d((0, 1, 0, 1)))."""
    grid = features.reshape(features.shape[0], side, side, -1)
    if side % 2:
        grid = mx.concatenate([grid, grid[:, side - 2 : side - 1]], axis=1)
        grid = mx.concatenate([grid, grid[:, :, side - 2 : side - 1]], axis=2)
        side += 1
    half = side // 2
    return grid.reshape(grid.shape[0], half, 2, half, 2, grid.shape[-1]).mean(axis=(2, 4))


class ImageEmbedding(nn.Module):
    """transformers' Phi4MultimodalImageEmbedding (names kept, so weights load as they are)."""

    def __init__(self, vision: siglip.SiglipVisionArgs, text_hidden: int):
        super().__init__()
        self.vision = vision
        self.img_processor = siglip.SiglipVisionModel(vision)
        self.img_processor.embeddings = siglip.MaskedEmbeddings(vision)
        del self.img_processor.post_layernorm  # the features are an inner layer's output
        dim = vision.hidden_size
        self.img_projection_up = nn.Linear(dim, text_hidden)
        self.img_projection_down = nn.Linear(text_hidden, text_hidden)
        self.global_img_feature_extensor = mx.zeros((1, 1, dim))
        self.sub_img_feature_extensor = mx.zeros((1, 1, 1, dim))

    def encode_crops(self, pixel_values: np.ndarray, patch_mask: np.ndarray) -> mx.array:
        """[F, 3, S, S] crops and their [F, S/p, S/p] patch masks -> pooled [F, base, base, D]."""
        tower = self.img_processor
        hidden = tower.embeddings(mx.array(pixel_values), patch_mask)
        hidden = tower.encoder(hidden, mx.array(patch_mask.reshape(patch_mask.shape[0], -1)))
        return pool_features(hidden, self.vision.patches_per_side)

    def arrange_image(self, pooled: mx.array, image: processor.Phi4Image) -> mx.array:
        """One image's pooled crops (global view first) -> its features in prompt order, before projection."""
        base, dim = pooled.shape[1], pooled.shape[-1]
        separator = self.sub_img_feature_extensor.reshape(1, 1, dim)
        rows, cols = image.rows, image.cols
        tiles = pooled[1 : 1 + rows * cols].reshape(rows, cols, base, base, dim).transpose(0, 2, 1, 3, 4)
        tiles = tiles.reshape(rows * base, cols * base, dim)[: image.useful_rows, : image.useful_cols]
        tiles = mx.concatenate([tiles, mx.broadcast_to(separator, (image.useful_rows, 1, dim))], axis=1)
        glob = mx.concatenate([pooled[0], mx.broadcast_to(separator, (base, 1, dim))], axis=1)
        parts = [tiles.reshape(-1, dim), self.global_img_feature_extensor.reshape(1, dim), glob.reshape(-1, dim)]
        return mx.concatenate(parts, axis=0)

    def project(self, features: mx.array) -> mx.array:
        return self.img_projection_down(nn.gelu(self.img_projection_up(features)))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Names relative to this module: the tower's unused parts (pooling head, post-norm,
        layers past the feature layer) are dropped."""
        tower = {k.removeprefix("img_processor."): v for k, v in weights.items() if k.startswith("img_processor.")}
        kept = {}
        for name, value in self.img_processor.sanitize(tower).items():
            if name.startswith("post_layernorm."):
                continue
            if name.startswith("encoder.layers.") and int(name.split(".")[2]) >= self.vision.num_hidden_layers:
                continue
            kept[f"img_processor.{name}"] = value
        return {**{k: v for k, v in weights.items() if not k.startswith("img_processor.")}, **kept}
