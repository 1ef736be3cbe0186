"""Qwen2-VL and Qwen2.5-VL vision transformers (transformers' `Qwen2VisionTransformerPretrainedModel`
and `Qwen2_5_VisionTransformerPretrainedModel`), patch merger included: flattened patches
[sum patches, C*T*P*P] plus `grid_thw` [n_images, 3] -> [sum patches / merge**2, out_hidden]."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxcel.vision.clip_vit import make_activation


@dataclass
class VisionArgs:
    variant: str  # "qwen2_vl" or "qwen2_5_vl"
    depth: int
    embed_dim: int
    out_hidden_size: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0
    window_size: int = 0  # pixels; Qwen2.5-VL only
    fullatt_block_indexes: list[int] = field(default_factory=list)

    @property
    def windowed(self) -> bool:
        return self.variant == "qwen2_5_vl"

    @classmethod
    def from_config(cls, config: dict, variant: str | None = None, **overrides: Any) -> VisionArgs:
        """From the `vision_config` dict. The two families spell sizes differently: Qwen2-VL's
        `hidden_size` is the output (language model) width and `embed_dim` the tower's; Qwen2.5-VL
        uses `hidden_size` for the tower and `out_hidden_size` for the output."""
        variant = variant or infer_variant(config)
        common = dict(
            variant=variant,
            depth=config.get("depth", 32),
            num_heads=config.get("num_heads", 16),
            in_channels=config.get("in_channels", config.get("in_chans", 3)),  # hub configs say in_chans
            patch_size=config.get("patch_size", 14),
            temporal_patch_size=config.get("temporal_patch_size", 2),
            spatial_merge_size=config.get("spatial_merge_size", 2),
            rope_theta=float((config.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        )
        if variant == "qwen2_vl":
            embed = config.get("embed_dim", 1280)
            sizes = dict(
                embed_dim=embed,
                out_hidden_size=config.get("hidden_size", 3584),
                intermediate_size=int(embed * config.get("mlp_ratio", 4)),
                hidden_act=config.get("hidden_act", "quick_gelu"),
            )
        else:
            sizes = dict(
                embed_dim=config.get("hidden_size", 3584),
                out_hidden_size=config.get("out_hidden_size", 3584),
                intermediate_size=config.get("intermediate_size", 3420),
                hidden_act=config.get("hidden_act", "silu"),
                window_size=config.get("window_size", 112),
                fullatt_block_indexes=list(config.get("fullatt_block_indexes", (7, 15, 23, 31))),
            )
        return cls(**{**common, **sizes, **overrides})


def infer_variant(config: dict) -> str:
    """transformers 5 writes the vision model_type; hub configs only differ in their keys."""
    kind = config.get("model_type", "")
    if kind.startswith("qwen2_5_vl") or (not kind and "out_hidden_size" in config):
        return "qwen2_5_vl"
    return "qwen2_vl"


# ---- Geometry from grid_thw (host-side metadata, so numpy) --------------------------------------


def make_position_ids(grid_thw: np.ndarray, merge: int) -> np.ndarray:
    """(row, col) of every patch, in the processor's merge-window order: [N, 2]."""
    out = []
    for t, h, w in grid_thw:
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        block = (h // merge, merge, w // merge, merge)
        ids = [a.reshape(block).transpose(0, 2, 1, 3).reshape(-1) for a in (rows, cols)]
        out.append(np.tile(np.stack(ids, axis=-1), (t, 1)))
    return np.concatenate(out)


def make_cu_seqlens(grid_thw: np.ndarray) -> np.ndarray:
    """Segment boundaries for full attention: each frame of each image attends only to itself."""
    lengths = np.repeat(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return np.concatenate([[0], np.cumsum(lengths)])


def make_window_index(
    grid_thw: np.ndarray, merge: int, window_size: int, patch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2.5-VL's window order of merge units and the window boundaries in tokens (transformers'
    `get_vision_window_index`): windows are `window_size` pixels square, cut per image."""
    side = window_size // merge // patch_size  # window side in merge units
    unit = merge * merge
    index, cu, offset = [], [0], 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        ids = np.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = side - gh % side, side - gw % side  # a whole empty window when divisible; dropped below
        padded = np.pad(ids, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-1)
        nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
        windows = padded.reshape(t, nh, side, nw, side).transpose(0, 1, 3, 2, 4).reshape(t * nh * nw, -1)
        index.append(windows[windows >= 0] + offset)
        cu.extend((np.cumsum((windows >= 0).sum(-1)) * unit + cu[-1]).tolist())
        offset += t * gh * gw
    cu = np.asarray(cu)
    return np.concatenate(index), cu[np.r_[True, np.diff(cu) != 0]]  # empty windows removed


class Segments(NamedTuple):
    """Variable-length segments packed into a padded batch, so one attention call covers every image
    (or window) and costs sum(len * max_len) rather than a dense N x N mask."""

    gather: mx.array | None  # [S * L] token index per padded slot (None: one segment, no padding)
    scatter: mx.array | None  # [N] padded slot per token
    mask: mx.array | None  # [S, 1, 1, L] valid keys, None when nothing is padded
    count: int
    length: int

    def pack(self, x: mx.array) -> mx.array:
        """[N, heads, D] -> [S, heads, L, D]."""
        if self.gather is not None:
            x = x[self.gather]
        return x.reshape(self.count, self.length, *x.shape[1:]).transpose(0, 2, 1, 3)

    def unpack(self, x: mx.array) -> mx.array:
        """[S, heads, L, D] -> [N, heads * D]."""
        x = x.transpose(0, 2, 1, 3).reshape(self.count * self.length, -1)
        return x if self.scatter is None else x[self.scatter]


def make_segments(cu_seqlens: np.ndarray) -> Segments:
    lengths = np.diff(cu_seqlens)
    count, length = len(lengths), int(lengths.max())
    if count == 1:
        return Segments(None, None, None, 1, length)
    valid = np.arange(length)[None, :] < lengths[:, None]
    gather = np.where(valid, cu_seqlens[:-1, None] + np.arange(length), 0).reshape(-1)
    scatter = np.flatnonzero(valid.reshape(-1))
    mask = None if valid.all() else mx.array(valid[:, None, None, :])
    return Segments(mx.array(gather), mx.array(scatter), mask, count, length)


# ---- Modules -------------------------------------------------------------------------------------


def rotate_half(x: mx.array) -> mx.array:
    a, b = mx.split(x, 2, axis=-1)
    return mx.concatenate([-b, a], axis=-1)


def apply_rotary(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """[N, heads, D] rotated in float32, as transformers does, whatever the weights' dtype."""
    x32 = x.astype(mx.float32)
    return (x32 * cos + rotate_half(x32) * sin).astype(x.dtype)


class PatchEmbed(nn.Module):
    """Conv3d with kernel == stride over patches the processor already cut: one matmul."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        size = args.in_channels * args.temporal_patch_size * args.patch_size**2
        self.proj = nn.Linear(size, args.embed_dim, bias=False)

    def __call__(self, pixel_values: mx.array) -> mx.array:
        return self.proj(pixel_values.astype(self.proj.weight.dtype))


class Attention(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.n_heads = args.num_heads
        self.scale = (args.embed_dim // args.num_heads) ** -0.5
        self.qkv = nn.Linear(args.embed_dim, 3 * args.embed_dim)
        self.proj = nn.Linear(args.embed_dim, args.embed_dim)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, segments: Segments) -> mx.array:
        q, k, v = mx.split(self.qkv(x).reshape(x.shape[0], 3, self.n_heads, -1), 3, axis=1)
        q, k, v = apply_rotary(q[:, 0], cos, sin), apply_rotary(k[:, 0], cos, sin), v[:, 0]
        q, k, v = segments.pack(q), segments.pack(k), segments.pack(v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=segments.mask)
        return self.proj(segments.unpack(out))


class MLP(nn.Module):
    """Qwen2-VL: fc1 -> act -> fc2."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.act = make_activation(args.hidden_act)
        self.fc1 = nn.Linear(args.embed_dim, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.embed_dim)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(self.act(self.fc1(x)))


class GatedMLP(nn.Module):
    """Qwen2.5-VL: SwiGLU-style, with biases."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.act = make_activation(args.hidden_act)
        self.gate_proj = nn.Linear(args.embed_dim, args.intermediate_size)
        self.up_proj = nn.Linear(args.embed_dim, args.intermediate_size)
        self.down_proj = nn.Linear(args.intermediate_size, args.embed_dim)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def make_norm(args: VisionArgs, dims: int) -> nn.Module:
    return nn.RMSNorm(dims, eps=1e-6) if args.windowed else nn.LayerNorm(dims, eps=1e-6)


class Block(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.norm1 = make_norm(args, args.embed_dim)
        self.norm2 = make_norm(args, args.embed_dim)
        self.attn = Attention(args)
        self.mlp = GatedMLP(args) if args.windowed else MLP(args)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array, segments: Segments) -> mx.array:
        h = x + self.attn(self.norm1(x), cos, sin, segments)
        return h + self.mlp(self.norm2(h))


class PatchMerger(nn.Module):
    """Norm, then each merge window's merge**2 patches concatenated through a 2-layer MLP."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.hidden = args.embed_dim * args.spatial_merge_size**2
        self.ln_q = make_norm(args, args.embed_dim)
        self.mlp = [nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, args.out_hidden_size)]

    def __call__(self, x: mx.array) -> mx.array:
        x = self.ln_q(x).reshape(-1, self.hidden)
        for layer in self.mlp:
            x = layer(x)
        return x


class QwenVisionModel(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.blocks = [Block(args) for _ in range(args.depth)]
        self.merger = PatchMerger(args)
        head_dim = args.embed_dim // args.num_heads
        # Half the head rotates with the row, half with the column: head_dim // 4 frequencies each.
        self._inv_freq = 1.0 / args.rope_theta ** (np.arange(0, head_dim // 2, 2, dtype=np.float32) / (head_dim // 2))

    def rotary(self, grid_thw: np.ndarray) -> tuple[mx.array, mx.array]:
        """cos, sin [N, 1, head_dim] laid out as transformers': [rows, cols, rows, cols]."""
        positions = make_position_ids(grid_thw, self.args.spatial_merge_size)
        angles = (positions[:, :, None] * self._inv_freq).reshape(len(positions), -1)
        angles = mx.array(np.concatenate([angles, angles], axis=-1, dtype=np.float32))[:, None, :]
        return mx.cos(angles), mx.sin(angles)

    def __call__(self, pixel_values: mx.array, grid_thw: Any) -> mx.array:
        grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        h = self.patch_embed(pixel_values)
        cos, sin = self.rotary(grid)
        full = make_segments(make_cu_seqlens(grid))
        window, order = full, None
        if self.args.windowed:
            a = self.args
            index, cu_windows = make_window_index(grid, a.spatial_merge_size, a.window_size, a.patch_size)
            # Whole merge units move, so the merger below still sees each unit's patches together.
            unit = a.spatial_merge_size**2
            order = mx.array((index[:, None] * unit + np.arange(unit)).reshape(-1))
            h, cos, sin = h[order], cos[order], sin[order]
            window = make_segments(cu_windows)
        for i, block in enumerate(self.blocks):
            full_attention = not self.args.windowed or i in self.args.fullatt_block_indexes
            h = block(h, cos, sin, full if full_attention else window)
        out = self.merger(h)
        # Image order again (window order moved units only within their own image, so full
        # attention above saw each image's tokens as one contiguous run).
        return out if order is None else out[mx.array(np.argsort(index))]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Names relative to the tower (checkpoints say `visual.*`, transformers 5 in memory
        `model.visual.*`); they match the modules. The Conv3d kernel becomes the Linear over the
        processor's flattened (C, T, P, P) patches; MLX conversions store it channels-last."""
        out = {}
        for name, w in weights.items():
            if "rotary_pos_emb" in name:
                continue
            if name == "patch_embed.proj.weight" and w.ndim == 5:
                if w.shape[-1] == self.args.in_channels != w.shape[1]:
                    w = w.transpose(0, 4, 1, 2, 3)  # [E, T, P, P, C] -> [E, C, T, P, P]
                w = w.reshape(w.shape[0], -1)
            out[name] = w
        return out


def make_qwen_vision_model(vision_config: dict, variant: str | None = None) -> QwenVisionModel:
    return QwenVisionModel(VisionArgs.from_config(vision_config, variant))
