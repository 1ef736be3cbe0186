"""CLIP vision transformer as LLaVA uses it: every layer's hidden states, from which the caller
picks `vision_feature_layer` and applies `vision_feature_select_strategy`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxcel.errors import ConfigError, ConfigIssue

CONFIG_PREFIX = "vision_config"


def quick_gelu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(1.702 * x)


# transformers' ACT2FN names for the activations vision towers use.
ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    "quick_gelu": quick_gelu,
    "gelu": nn.gelu,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "gelu_new": nn.gelu_approx,
    "silu": nn.silu,
    "relu": nn.relu,
}


def make_activation(name: str) -> Callable[[mx.array], mx.array]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported vision activation {name!r} (known: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


@dataclass
class VisionArgs:
    # Defaults are CLIPVisionConfig's: LLaVA config.json files often leave them out.
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    @classmethod
    def from_config(cls, config: dict, **overrides: Any):
        """From a `vision_config` dict (CLIPVisionConfig's, SiglipVisionConfig's, ...); unknown keys
        ignored, JSON null means the default, bad values raise ConfigError naming every bad
        `vision_config.KEY` at once."""
        values = {k: config[k] for k in cls.__dataclass_fields__ if config.get(k) is not None}
        values.update(overrides)
        args = cls(**values)
        args.check()
        return args

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side**2

    def check(self) -> None:
        issues = []

        def bad(key: str, message: str) -> None:
            issues.append(ConfigIssue(f"{CONFIG_PREFIX}.{key}", message, getattr(self, key)))

        for key in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_channels",
            "image_size",
            "patch_size",
        ):
            value = getattr(self, key)
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                bad(
                    key,
                    "must be a positive int"
                    + (" (non-square [h, w] sizes are not supported)" if key in ("image_size", "patch_size") else ""),
                )
        if not issues:
            if self.hidden_size % self.num_attention_heads:
                bad("num_attention_heads", f"must divide hidden_size {self.hidden_size}")
            if self.patch_size > self.image_size:
                bad("patch_size", f"must be at most image_size {self.image_size}")
        if self.hidden_act not in ACTIVATIONS:
            bad("hidden_act", f"must be one of {sorted(ACTIVATIONS)}")
        eps = self.layer_norm_eps
        if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and 0 < eps < 1):
            bad("layer_norm_eps", "must be a number in (0, 1)")
        if issues:
            raise ConfigError(issues, hint="fix the checkpoint's config.json")


class Attention(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.scale = (dim // self.n_heads) ** -0.5
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def __call__(self, x: mx.array, mask: mx.array | None = None) -> mx.array:
        B, L, _ = x.shape
        q, k, v = (
            p(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.act = make_activation(args.hidden_act)
        self.fc1 = nn.Linear(args.hidden_size, args.intermediate_size)
        self.fc2 = nn.Linear(args.intermediate_size, args.hidden_size)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.layer_norm1 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.mlp = MLP(args)
        self.layer_norm2 = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)

    def __call__(self, x: mx.array, mask: mx.array | None = None) -> mx.array:
        h = x + self.self_attn(self.layer_norm1(x), mask)
        return h + self.mlp(self.layer_norm2(h))


class Encoder(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.layers = [EncoderLayer(args) for _ in range(args.num_hidden_layers)]


class Embeddings(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        dim, patch = args.hidden_size, args.patch_size
        self.class_embedding = mx.zeros((dim,))
        self.patch_embedding = nn.Conv2d(args.num_channels, dim, kernel_size=patch, stride=patch, bias=False)
        self.position_embedding = nn.Embedding((args.image_size // patch) ** 2 + 1, dim)

    def __call__(self, pixel_values: mx.array) -> mx.array:
        """NCHW pixels (what processors emit) -> [B, 1 + patches, hidden]."""
        B, _, H, W = pixel_values.shape
        if H != self.args.image_size or W != self.args.image_size:
            raise ValueError(f"CLIP tower expects {self.args.image_size}x{self.args.image_size} images, got {H}x{W}")
        x = pixel_values.transpose(0, 2, 3, 1).astype(self.patch_embedding.weight.dtype)
        patches = self.patch_embedding(x).reshape(B, -1, self.args.hidden_size)  # row-major, as torch's flatten(2)
        cls = mx.broadcast_to(self.class_embedding.astype(patches.dtype), (B, 1, self.args.hidden_size))
        return mx.concatenate([cls, patches], axis=1) + self.position_embedding.weight


class ClipVisionModel(nn.Module):
    """Module names follow transformers 5's CLIPVisionModel (no `vision_model.` level)."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.pre_layrnorm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)  # sic: checkpoint name
        self.encoder = Encoder(args)
        self.post_layernorm = nn.LayerNorm(
            args.hidden_size, eps=args.layer_norm_eps
        )  # pooled output only; LLaVA skips it

    def __call__(self, pixel_values: mx.array, n_layers: int | None = None) -> list[mx.array]:
        """Hidden states as transformers' `output_hidden_states`: [embeddings after pre-LN, layer 1, ...].
        `n_layers` stops early: a feature layer of -2 never needs the last layer."""
        h = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [h]
        for layer in self.encoder.layers[:n_layers]:
            h = layer(h)
            states.append(h)
        return states

    def image_features(
        self, pixel_values: mx.array, feature_layer: int | list[int] = -2, strategy: str = "default"
    ) -> mx.array:
        """LLaVA's `get_image_features` up to the projector: [B, patches (+1 for "full"), hidden * n_layers]."""
        total = self.args.num_hidden_layers + 1
        layers = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
        if any(not -total <= i < total for i in layers):
            raise ValueError(f"vision_feature_layer {feature_layer} out of range for {total} hidden states")
        layers = [i % total for i in layers]  # absolute, so the states can stop at the deepest one
        return select_image_features(self(pixel_values, n_layers=max(layers)), layers, strategy)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Names relative to the tower. transformers 4 / llava-hf checkpoints carry a `vision_model.`
        level that transformers 5 drops; `position_ids` is a buffer older saves include; conv weights
        go from torch's [out, C, kh, kw] to MLX's [out, kh, kw, C] (MLX conversions already are)."""
        out = {}
        for name, w in weights.items():
            name = name.removeprefix("vision_model.")
            if name.endswith("position_ids"):
                continue
            if name == "embeddings.patch_embedding.weight" and w.shape[1] == self.args.num_channels != w.shape[3]:
                w = w.transpose(0, 2, 3, 1)
            out[name] = w
        return out


def select_image_features(states: list[mx.array], feature_layer: int | list[int], strategy: str) -> mx.array:
    """Pick `vision_feature_layer` (an index or a list, concatenated on the last axis) and apply
    `vision_feature_select_strategy`: "default" drops the CLS token, "full" keeps it."""
    if strategy not in ("default", "full"):
        raise ValueError(f"vision_feature_select_strategy must be 'default' or 'full' (got {strategy!r})")
    layers = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
    picked = [states[i] for i in layers]
    if strategy == "default":
        picked = [h[:, 1:] for h in picked]
    return picked[0] if len(picked) == 1 else mx.concatenate(picked, axis=-1)


def make_clip_vision_model(vision_config: dict) -> ClipVisionModel:
    return ClipVisionModel(VisionArgs.from_config(vision_config))
