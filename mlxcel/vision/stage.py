"""The vision stage's contract between the pipeline and a VLM family, and the EmbedMerger.

Per prompt, the pipeline:
1. renders the chat template (the family's placeholder, e.g. Qwen2-VL's `<|image_pad|>` or
   LLaVA's `<image>`, once per image) and tokenizes;
2. loads the images and calls `model.preprocess_images(images, sources)` -> `ImageInputs`,
   whose `token_counts[i]` says how many placeholder tokens image i becomes;
3. expands each placeholder token to that many (`expand_placeholders`): these are the prompt's
   token ids from here on (`prompt_token_ids` in generations.jsonl);
4. calls `model.encode_images(inputs)` -> [sum(token_counts), hidden] features, in image order;
5. embeds the ids and puts the features at the placeholder positions (`merge_embeddings`);
6. prefills with `forward_with_embeddings`; families with their own position ids (Qwen2-VL's
   M-RoPE) return them from `model.make_positions(token_ids, inputs)` as ([3, L], shift).

A family is a VLM when it has `image_token_id` set and these methods; text-only prompts to it
take the ordinary path, so its vision weights stay unevaluated until an image arrives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

from mlxcel.errors import MlxcelError


@dataclass
class ImageInputs:
    """One prompt's images after preprocessing: what the tower needs, and the token count each
    image expands to."""

    pixel_values: np.ndarray
    token_counts: list[int]
    extras: dict[str, Any] = field(default_factory=dict)  # per family: grid_thw, image_sizes, ...


@runtime_checkable
class VisionLanguageModel(Protocol):
    image_token_id: int

    def preprocess_images(self, images: list, sources: list[str]) -> ImageInputs: ...
    def encode_images(self, inputs: ImageInputs) -> mx.array: ...


def is_vision_model(model) -> bool:
    return getattr(model, "image_token_id", None) is not None and isinstance(model, VisionLanguageModel)


def count_placeholders(token_ids: list[int], image_token_id: int) -> int:
    return sum(1 for t in token_ids if t == image_token_id)


def expand_placeholders(token_ids: list[int], image_token_id: int, token_counts: list[int]) -> list[int]:
    """Each placeholder token (one per image, in order) repeated as many times as its image
    has features. The counts must match the placeholders one to one."""
    found = count_placeholders(token_ids, image_token_id)
    if found != len(token_counts):
        raise MlxcelError(f"the prompt has {found} image placeholder(s) for {len(token_counts)} image(s)")
    expanded, images = [], iter(token_counts)
    for token in token_ids:
        expanded.extend([token] * next(images) if token == image_token_id else [token])
    return expanded


def merge_embeddings(embeddings: mx.array, token_ids: list[int], image_token_id: int, features: mx.array) -> mx.array:
    """[1, L, hidden] text embeddings with the image features [n, hidden] written, in order, at
    the n placeholder positions of `token_ids` (expanded)."""
    positions = np.flatnonzero(np.asarray(token_ids) == image_token_id)
    if len(positions) != features.shape[0]:
        raise MlxcelError(f"{features.shape[0]} image features for {len(positions)} placeholder positions")
    if len(positions) == 0:
        return embeddings
    merged = embeddings[0]
    merged[mx.array(positions)] = features.astype(merged.dtype)
    return merged[None]
