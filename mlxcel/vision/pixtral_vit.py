"""The Pixtral vision transformer (transformers' `PixtralVisionModel`), the tower of Pixtral-12B and
Mistral-Small-3.1 (Mistral 3): images of any size (whole patches), each cut into patches by a
bias-free conv, RMSNorm (`ln_pre`), then blocks of RMSNorm -> attention (no biases, 2-D RoPE over
each patch's (row, column)) -> RMSNorm -> SiLU/GELU-gated MLP. Several images go through in one call:
their patches are concatenated and attention stays within each image (block-diagonal, packed per
image). Output: [sum of patches, hidden], images in order, patches row-major."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxcel.vision.clip_vit import make_activation
from mlxcel.vision.qwen2_vl_vit import Segments, make_segments, rotate_half

RMS_EPS = 1e-5  # transformers hard-codes it for every Pixtral norm


@dataclass
class PixtralVisionArgs:
    # Defaults are PixtralVisionConfig's; Mistral-Small-3.1 / Pixtral-12B hub configs set patch 14/16 and silu.
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_channels: int = 3
    image_size: int = 1024
    patch_size: int = 16
    hidden_act: str = "gelu"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        # transformers recomputes head_dim = hidden_size // num_attention_heads whatever config.json says.
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls, config: dict, **overrides: Any) -> PixtralVisionArgs:
        """From the `vision_config` dict; rope theta from transformers 5's rope_parameters or the hub's
        top-level rope_theta. Unknown keys are ignored."""
        values = {k: config[k] for k in cls.__dataclass_fields__ if k in config and k != "rope_theta"}
        rope = config.get("rope_parameters") or {}
        values["rope_theta"] = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        values.update(overrides)
        args = cls(**values)
        if args.hidden_size % args.num_attention_heads or args.head_dim % 4:
            raise ValueError(
                f"vision_config: hidden_size {args.hidden_size} / num_attention_heads {args.num_attention_heads} must "
                "give "
                "a head size divisible by 4 (2-D RoPE splits each half between rows and columns)"
            )
        return args


# ---- Geometry (host-side metadata, so numpy) -----------------------------------------------------


def make_position_ids(grids: Sequence[tuple[int, int]]) -> np.ndarray:
    """(row, col) of every patch, images in order, row-major: [N, 2]."""
    out = []
    for rows, cols in grids:
        r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        out.append(np.stack([r.reshape(-1), c.reshape(-1)], axis=-1))
    return np.concatenate(out) if out else np.zeros((0, 2), np.int64)


def make_rope_angles(positions: np.ndarray, head_dim: int, theta: float) -> np.ndarray:
    """transformers' PixtralVisionRotaryEmbedding: the head_dim / 2 frequencies alternate between rows
    (even ones) and columns (odd ones); angles [rows x even | cols x odd] repeated twice: [N, head_dim]."""
    inv_freq = (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)).astype(np.float32)
    positions = positions.astype(np.float32)
    half = np.concatenate([positions[:, :1] * inv_freq[0::2], positions[:, 1:] * inv_freq[1::2]], axis=-1)
    return np.concatenate([half, half], axis=-1)


# ---- Modules -------------------------------------------------------------------------------------


class PatchConv(nn.Module):
    """Conv2d with kernel == stride and no bias: one matmul over (C, P, P)-flattened patches."""

    def __init__(self, args: PixtralVisionArgs):
        super().__init__()
        self.patch_size = args.patch_size
        self.weight = mx.zeros((args.hidden_size, args.num_channels * args.patch_size**2))

    def __call__(self, image: mx.array) -> mx.array:
        """[C, H, W] -> [rows * cols, hidden]; a remainder under one patch is dropped, as the conv does."""
        p = self.patch_size
        channels, height, width = image.shape
        rows, cols = height // p, width // p
        patches = image[:, : rows * p, : cols * p].reshape(channels, rows, p, cols, p)
        patches = patches.transpose(1, 3, 0, 2, 4).reshape(rows * cols, channels * p * p)
        return patches.astype(self.weight.dtype) @ self.weight.T


class Attention(nn.Module):
    def __init__(self, args: PixtralVisionArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.scale = args.head_dim**-0.5
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, segments: Segments) -> mx.array:
        n = x.shape[0]
        q, k, v = (proj(x).reshape(n, self.n_heads, -1) for proj in (self.q_proj, self.k_proj, self.v_proj))
        # transformers rotates in the activations' dtype, cos/sin cast to it.
        cos, sin = cos.astype(q.dtype), sin.astype(q.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        out = mx.fast.scaled_dot_product_attention(
            segments.pack(q), segments.pack(k), segments.pack(v), scale=self.scale, mask=segments.mask
        )
        return self.o_proj(segments.unpack(out))


class FeedForward(nn.Module):
    def __init__(self, args: PixtralVisionArgs):
        super().__init__()
        self.act = make_activation(args.hidden_act)
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, args: PixtralVisionArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.hidden_size, eps=RMS_EPS)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.hidden_size, eps=RMS_EPS)
        self.feed_forward = FeedForward(args)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, segments: Segments) -> mx.array:
        h = x + self.attention(self.attention_norm(x), cos, sin, segments)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: PixtralVisionArgs):
        super().__init__()
        self.layers = [Layer(args) for _ in range(args.num_hidden_layers)]


class PixtralVisionModel(nn.Module):
    def __init__(self, args: PixtralVisionArgs):
        super().__init__()
        self.args = args
        self.patch_conv = PatchConv(args)
        self.ln_pre = nn.RMSNorm(args.hidden_size, eps=RMS_EPS)
        self.transformer = Transformer(args)

    def resolve_layer(self, feature_layer: int) -> int:
        """transformers' hidden_states index (0: after ln_pre, i: after layer i; negatives from the end)
        as a number of layers to run."""
        count = self.args.num_hidden_layers + 1
        if not (isinstance(feature_layer, int) and -count <= feature_layer < count):
            raise ValueError(f"vision_feature_layer {feature_layer!r} is out of range for {count - 1} vision layers")
        return feature_layer % count

    def __call__(self, pixel_values, image_sizes=None, feature_layer: int = -1) -> mx.array:
        """Patch features [sum of patches, hidden] of hidden state `feature_layer` (Mistral 3's
        vision_feature_layer; -1, the last layer, by default).

        pixel_values: a list of [C, H_i, W_i] images (the processor's output), or transformers' padded
        batch [n, C, H, W] with `image_sizes` [(height, width), ...] saying how much of each is image."""
        images = self.split_images(pixel_values, image_sizes)
        p = self.args.patch_size
        grids = [(image.shape[1] // p, image.shape[2] // p) for image in images]
        if any(rows * cols == 0 for rows, cols in grids):
            raise ValueError(
                f"every image needs at least one {p}x{p} patch; got sizes {[tuple(i.shape[1:]) for i in images]}"
            )
        h = self.ln_pre(mx.concatenate([self.patch_conv(image) for image in images]))
        angles = mx.array(make_rope_angles(make_position_ids(grids), self.args.head_dim, self.args.rope_theta))[
            :, None, :
        ]
        cos, sin = mx.cos(angles), mx.sin(angles)
        segments = make_segments(np.concatenate([[0], np.cumsum([rows * cols for rows, cols in grids])]))
        for layer in self.transformer.layers[: self.resolve_layer(feature_layer)]:
            h = layer(h, cos, sin, segments)
        return h

    @staticmethod
    def split_images(pixel_values, image_sizes) -> list[mx.array]:
        if isinstance(pixel_values, (list, tuple)):
            images = [mx.array(image) if not isinstance(image, mx.array) else image for image in pixel_values]
            if image_sizes is not None:
                images = [
                    image[:, : int(h), : int(w)]
                    for image, (h, w) in zip(images, np.asarray(image_sizes).reshape(-1, 2))
                ]
            return images
        batch = pixel_values if isinstance(pixel_values, mx.array) else mx.array(pixel_values)
        if batch.ndim == 3:
            batch = batch[None]
        if image_sizes is None:
            return [batch[i] for i in range(batch.shape[0])]
        sizes = np.asarray(image_sizes).reshape(-1, 2)
        if len(sizes) != batch.shape[0]:
            raise ValueError(f"{len(sizes)} image sizes for a batch of {batch.shape[0]} images")
        return [batch[i, :, : int(h), : int(w)] for i, (h, w) in enumerate(sizes)]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Names relative to the tower: transformers 5.24's save_pretrained writes `vision_tower.*`
        (in memory `model.vision_tower.*`), and they match the modules. MLX conversions (mlx-vlm) add a
        `vision_model.` level and store the conv kernel channels-last [O, P, P, C]; both are accepted.
        The conv kernel [O, C, P, P] becomes the Linear over (C, P, P)-flattened patches."""
        out = {}
        for name, w in weights.items():
            name = name.removeprefix("vision_model.")
            if "inv_freq" in name or "patch_positional_embedding" in name:
                continue
            if name == "patch_conv.weight" and w.ndim == 4:
                if w.shape[-1] == self.args.num_channels != w.shape[1]:
                    w = w.transpose(0, 3, 1, 2)  # [O, P, P, C] -> [O, C, P, P]
                w = w.reshape(w.shape[0], -1)
            out[name] = w
        return out


def make_pixtral_vision_model(vision_config: dict) -> PixtralVisionModel:
    return PixtralVisionModel(PixtralVisionArgs.from_config(vision_config))
