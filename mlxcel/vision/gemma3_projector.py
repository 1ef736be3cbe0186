"""Gemma 3's multimodal projector (transformers' `Gemma3MultiModalProjector`): the SigLIP patch grid
average-pooled to `mm_tokens_per_image` tokens, Gemma RMSNorm (scale 1 + w, in float32) and a
[vision_hidden, text_hidden] matmul.

Checkpoint names (what `split_vision_weights` sorts out of a whole Gemma 3 checkpoint):
- `vision_tower.*` and `multi_modal_projector.*`: transformers 5's save_pretrained (and
  transformers < 4.52, mlx-vlm);
- `vision_tower.vision_model.*`: the Hub's google/gemma-3-*-it files (transformers 4's
  SiglipVisionModel level; SiglipVisionModel.sanitize drops it);
- `model.vision_tower.*`, `model.multi_modal_projector.*`: transformers 4.52+ / 5 in memory.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxcel.errors import ConfigError, ConfigIssue
from mlxcel.vision.siglip import SiglipVisionArgs

TOWER_PREFIXES = ("model.vision_tower.", "vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def pooling_plan(patches_per_side: int, mm_tokens_per_image: int) -> tuple[int, int]:
    """(kernel, tokens) of transformers' AvgPool2d: tokens_per_side = int(sqrt(mm_tokens)), kernel =
    patches_per_side // tokens_per_side, floor-mode pooling (trailing patches dropped). A
    mm_tokens_per_image the pooling cannot produce exactly is a ConfigError (transformers would
    only fail when merging the features into the prompt)."""
    ok = isinstance(mm_tokens_per_image, int) and not isinstance(mm_tokens_per_image, bool) and mm_tokens_per_image > 0
    tokens_per_side = int(mm_tokens_per_image**0.5) if ok else 0
    if ok and 0 < tokens_per_side <= patches_per_side:
        kernel = patches_per_side // tokens_per_side
        tokens = (patches_per_side // kernel) ** 2
        if tokens == mm_tokens_per_image:
            return kernel, tokens
    side = patches_per_side
    legal = sorted({(side // (side // t)) ** 2 for t in range(1, side + 1)})
    raise ConfigError(
        ConfigIssue(
            "mm_tokens_per_image",
            f"must be a square the {side}x{side} patch grid pools to exactly: one of {legal}",
            mm_tokens_per_image,
        ),
        hint="fix the checkpoint's config.json",
    )


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), all in float32, cast back to x's dtype."""

    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = mx.zeros((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        scale = 1.0 + self.weight.astype(mx.float32)
        return mx.fast.rms_norm(x.astype(mx.float32), scale, self.eps).astype(x.dtype)


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, vision: SiglipVisionArgs, text_hidden_size: int, mm_tokens_per_image: int = 256):
        super().__init__()
        self.patches_per_side = vision.patches_per_side
        self.kernel, self.tokens_per_image = pooling_plan(self.patches_per_side, mm_tokens_per_image)
        self.mm_input_projection_weight = mx.zeros((vision.hidden_size, text_hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, eps=vision.layer_norm_eps)

    def pool(self, features: mx.array) -> mx.array:
        """[B, side*side, D] row-major patches -> [B, tokens, D]: transformers' transpose/reshape to
        [B, D, side, side], AvgPool2d(kernel, stride=kernel), flatten(2).transpose(1, 2), done
        channels-last (same patch order, same windows)."""
        B, N, D = features.shape
        side, k = self.patches_per_side, self.kernel
        if N != side * side:
            raise ValueError(f"projector expects {side * side} patches per image, got {N}")
        out = side // k
        grid = features.reshape(B, side, side, D)[:, : out * k, : out * k]
        pooled = grid.reshape(B, out, k, out, k, D).mean(axis=(2, 4))
        return pooled.reshape(B, out * out, D)

    def __call__(self, features: mx.array) -> mx.array:
        """SigLIP last_hidden_state [B, patches, vision_hidden] -> [B, tokens_per_image, text_hidden]
        in the features' dtype."""
        normed = self.mm_soft_emb_norm(self.pool(features))
        return (normed @ self.mm_input_projection_weight).astype(features.dtype)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Names relative to the projector (`mm_input_projection_weight`, `mm_soft_emb_norm.weight`);
        full checkpoint names are accepted too."""
        out = {}
        for name, w in weights.items():
            for prefix in PROJECTOR_PREFIXES:
                name = name.removeprefix(prefix)
            out[name] = w
        return out


def make_gemma3_projector(config: dict, vision: SiglipVisionArgs | None = None) -> Gemma3MultiModalProjector:
    """From a Gemma 3 config.json dict (`vision_config`, `text_config.hidden_size`, `mm_tokens_per_image`)."""
    vision = vision or SiglipVisionArgs.from_config(config.get("vision_config") or {})
    text = config.get("text_config") or {}
    hidden = text.get("hidden_size", 2304)  # Gemma3TextConfig's default
    if not (isinstance(hidden, int) and not isinstance(hidden, bool) and hidden > 0):
        raise ConfigError(ConfigIssue("text_config.hidden_size", "must be a positive int", hidden))
    tokens = config.get("mm_tokens_per_image")
    return Gemma3MultiModalProjector(vision, hidden, 256 if tokens is None else tokens)


def split_vision_weights(
    weights: dict[str, mx.array],
) -> tuple[dict[str, mx.array], dict[str, mx.array], dict[str, mx.array]]:
    """(tower, projector, rest) of a whole Gemma 3 checkpoint in any layout above: tower and
    projector names relative to their modules (pass them to their `sanitize`), the rest untouched."""
    tower, projector, rest = {}, {}, {}
    for name, w in weights.items():
        for prefixes, bucket in ((TOWER_PREFIXES, tower), (PROJECTOR_PREFIXES, projector)):
            prefix = next((p for p in prefixes if name.startswith(p)), None)
            if prefix:
                bucket[name[len(prefix) :]] = w
                break
        else:
            rest[name] = w
    return tower, projector, rest


def count_pooled_tokens(image_size: int, patch_size: int, mm_tokens_per_image: int) -> int:
    """Soft tokens one image (or pan-and-scan crop) becomes; checks the config as the projector does."""
    if not (isinstance(image_size, int) and isinstance(patch_size, int) and 0 < patch_size <= image_size):
        raise ConfigError(
            ConfigIssue("vision_config.patch_size", "must be a positive int no larger than image_size", patch_size)
        )
    return pooling_plan(image_size // patch_size, mm_tokens_per_image)[1]
