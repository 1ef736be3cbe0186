"""SigLIP vision transformer (transformers' `SiglipVisionModel`), as Gemma 3 uses it: conv patch
embedding, learned position embeddings, pre-LN encoder layers (attention with biases, tanh-GELU
MLP), `post_layernorm`; the output is `last_hidden_state` [B, patches, hidden].

The attention-pooling head (`head.*`, SigLIP's `pooler_output`) is not built: Gemma 3 reads
`last_hidden_state` (its configs set `vision_use_head: false`, but a config that leaves the key
out gets transformers' default of true and saves the head's weights, which `sanitize` drops).

The encoder takes an optional patch mask so Idefics3 / SmolVLM (same layers, padded images) can
reuse it with their own embeddings."""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx import nn

from mlxcel.vision.clip_vit import EncoderLayer, VisionArgs


@dataclass
class SiglipVisionArgs(VisionArgs):
    """CLIP's fields and checks (clip_vit.VisionArgs) with SiglipVisionConfig's defaults where they differ."""

    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6


def make_key_mask(patch_mask: mx.array) -> mx.array:
    """[B, L] bool (True: a real patch) -> [B, 1, 1, L] bool for SDPA: every query attends only to
    real patches, as transformers' create_bidirectional_mask does with a 2D attention mask.
    Padded patches still get (ignored) outputs."""
    if patch_mask.ndim != 2:
        raise ValueError(f"patch mask must be [batch, patches], got shape {tuple(patch_mask.shape)}")
    return patch_mask.astype(mx.bool_)[:, None, None, :]


# SigLIP's encoder layer is CLIP's (pre-norm attention with biases, fc1/fc2 MLP): shared.


class Encoder(nn.Module):
    def __init__(self, args: SiglipVisionArgs):
        super().__init__()
        self.layers = [EncoderLayer(args) for _ in range(args.num_hidden_layers)]

    def __call__(self, x: mx.array, patch_mask: mx.array | None = None) -> mx.array:
        mask = None if patch_mask is None else make_key_mask(patch_mask)
        for layer in self.layers:
            x = layer(x, mask)
        return x


class Embeddings(nn.Module):
    def __init__(self, args: SiglipVisionArgs):
        super().__init__()
        self.args = args
        patch = args.patch_size
        self.patch_embedding = nn.Conv2d(
            args.num_channels, args.hidden_size, kernel_size=patch, stride=patch, bias=True
        )
        self.position_embedding = nn.Embedding(args.num_patches, args.hidden_size)

    def __call__(self, pixel_values: mx.array) -> mx.array:
        """NCHW pixels (what processors emit) -> [B, patches, hidden], patches row-major."""
        B, C, H, W = pixel_values.shape
        size = self.args.image_size
        if H != size or W != size or C != self.args.num_channels:
            # transformers fails too (it interpolates positions only when asked; no family here asks)
            raise ValueError(f"SigLIP tower expects {self.args.num_channels}x{size}x{size} images, got {C}x{H}x{W}")
        x = pixel_values.transpose(0, 2, 3, 1).astype(self.patch_embedding.weight.dtype)
        patches = self.patch_embedding(x).reshape(B, -1, self.args.hidden_size)  # as torch's flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


def bucketize_position_ids(patch_mask: np.ndarray, patches_per_side: int) -> np.ndarray:
    """Idefics3 / SmolVLM's position ids (transformers' Idefics3VisionEmbeddings) for frames whose
    real patches are `patch_mask` [B, rows, cols] (True: real): each real patch's fractional
    coordinates (index / real patches along that axis) bucketized into the `patches_per_side` grid
    of the position table; padded patches get 0. Returns [B, rows * cols] int64, row-major."""
    mask = np.asarray(patch_mask, dtype=bool)
    if mask.ndim != 3:
        raise ValueError(f"patch mask must be [frames, rows, cols], got shape {mask.shape}")
    batch, rows, cols = mask.shape
    step = 1 / patches_per_side
    # torch.arange(1/n, 1.0, 1/n) in float32 (values computed in double, as torch's CPU arange)
    count = max(math.ceil((1.0 - step) / step), 0)
    boundaries = (step + np.arange(count, dtype=np.float64) * step).astype(np.float32)
    limit = np.float32(1.0 - 1e-6)

    def buckets(n_real: np.ndarray, length: int) -> np.ndarray:
        with np.errstate(divide="ignore"):
            steps = (np.float32(1.0) / n_real.astype(np.float32))[:, None]  # 1/0 = inf, as torch
        coords = np.minimum(np.arange(length, dtype=np.float32)[None, :] * steps, limit)
        coords = np.nan_to_num(coords, nan=limit)  # 0 * inf: an all-padding frame (its ids are all 0 anyway)
        return np.searchsorted(boundaries, coords, side="right")  # torch.bucketize(right=True)

    h = buckets(mask[:, :, 0].sum(axis=1), rows)
    w = buckets(mask[:, 0, :].sum(axis=1), cols)
    ids = (h[:, :, None] * patches_per_side + w[:, None, :]).reshape(batch, -1)
    return np.where(mask.reshape(batch, -1), ids, 0).astype(np.int64)


class MaskedEmbeddings(Embeddings):
    """Idefics3 / SmolVLM's embeddings (same parameters as SigLIP's): frames of any size that is a
    multiple of the patch, with their real patches' mask and bucketized position ids."""

    def __call__(self, pixel_values: mx.array, patch_mask: np.ndarray | None = None) -> mx.array:
        """NCHW pixels [B, C, H, W] and `patch_mask` [B, H / patch, W / patch] (None: all real) ->
        [B, patches, hidden]."""
        B, C, H, W = pixel_values.shape
        patch = self.args.patch_size
        if C != self.args.num_channels:
            raise ValueError(f"the vision tower expects {self.args.num_channels} channels, got {C}")
        if patch_mask is None:
            patch_mask = np.ones((B, H // patch, W // patch), dtype=bool)
        x = pixel_values.transpose(0, 2, 3, 1).astype(self.patch_embedding.weight.dtype)
        patches = self.patch_embedding(x).reshape(B, -1, self.args.hidden_size)
        ids = bucketize_position_ids(patch_mask, self.args.patches_per_side)
        return patches + self.position_embedding(mx.array(ids))


class SiglipVisionModel(nn.Module):
    """Module names follow transformers 5's SiglipVisionModel (no `vision_model.` level)."""

    def __init__(self, args: SiglipVisionArgs):
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.encoder = Encoder(args)
        self.post_layernorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, pixel_values: mx.array, patch_mask: mx.array | None = None) -> mx.array:
        """last_hidden_state [B, patches, hidden] of NCHW pixels; `patch_mask` [B, patches] (True:
        real) keeps padded patches out of every patch's attention."""
        return self.encode(self.embeddings(pixel_values), patch_mask)

    def encode(self, embeddings: mx.array, patch_mask: mx.array | None = None) -> mx.array:
        """Encoder + post_layernorm of already embedded patches (for families with their own embeddings)."""
        return self.post_layernorm(self.encoder(embeddings, patch_mask))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Names relative to the tower. The Hub's Gemma 3 / PaliGemma files (transformers 4) carry a
        `vision_model.` level that transformers 5 drops; `position_ids` is a buffer older saves
        include; `head.*` is the unused pooling head; conv weights go from torch's
        [out, C, kh, kw] to MLX's [out, kh, kw, C] (MLX conversions already are)."""
        out = {}
        channels = self.args.num_channels
        for name, w in weights.items():
            name = name.removeprefix("vision_model.")
            if name.endswith("position_ids") or name.startswith("head."):
                continue
            if name == "embeddings.patch_embedding.weight" and w.ndim == 4 and w.shape[1] == channels != w.shape[3]:
                w = w.transpose(0, 2, 3, 1)
            out[name] = w
        return out


def make_siglip_vision_model(vision_config: dict) -> SiglipVisionModel:
    return SiglipVisionModel(SiglipVisionArgs.from_config(vision_config))
