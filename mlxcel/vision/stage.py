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
6. prefills with `forward_with_embeddings`; a family that needs more per token (Qwen2-VL's
   M-RoPE ids, Gemma 3's image blocks) returns it from `model.make_prefill_extras(token_ids,
   inputs, pad)` as ({kwarg: array [..., 1, pad + L]}, decode position shift), and the engine
   batches, slices per prefill piece and passes it on.

A family is a VLM when it has `image_token_id` set and these methods; text-only prompts to it
take the ordinary path, so its vision weights stay unevaluated until an image arrives.
"""

from __future__ import annotations

import time
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
    preprocess_ms: float = 0.0  # loading + preprocessing, set by prepare_images


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


def collect_image_paths(messages: list[dict]) -> list[str]:
    """The image parts' paths, in conversation order."""
    return [
        part["path"]
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    ]


def flatten_text_parts(messages: list[dict]) -> list[dict]:
    """Content lists without images as plain strings, so text-only chat templates render them."""
    flat = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            message = {**message, "content": "".join(p["text"] for p in content)}
        flat.append(message)
    return flat


def check_images_allowed(model, model_type: str, paths: list[str]) -> None:
    if paths and not is_vision_model(model):
        raise MlxcelError(
            f"{len(paths)} image(s) given ({paths[0]}{', ...' if len(paths) > 1 else ''}), but {model_type} is a "
            "text-only model "
            "(drop the images, or use a vision-language model: Qwen2-VL, Qwen2.5-VL, LLaVA, LLaVA-NeXT, Gemma 3 4B+, "
            "Mistral 3, Idefics3, SmolVLM, Phi-4-multimodal)"
        )


def check_placeholder_count(found: int, paths: list[str]) -> None:
    """One placeholder per image, or an error naming both counts and the files."""
    if found != len(paths):
        hint = (
            "each image part needs the model's chat template (template=none: write one placeholder per image yourself)"
        )
        named = f" ({', '.join(paths)})" if paths else ""
        raise MlxcelError(f"the prompt has {found} image placeholder(s) for {len(paths)} image(s){named}: {hint}")


def prepare_images(
    model, text: str, token_ids: list[int], paths: list[str], encode
) -> tuple[list[int], ImageInputs | None]:
    """Load and preprocess a prompt's images; its token ids with each image's placeholder expanded.

    Expansion is the family's choice: by default the placeholder id is repeated token_counts[i]
    times (Qwen2-VL, LLaVA); a family with `expand_image_text(text, inputs)` rewrites the rendered
    text and `encode` tokenizes it again (Gemma 3, Idefics3: their layouts hold plain text that
    merges with its neighbours); one with `expand_image_tokens(token_ids, inputs)` rewrites the
    ids (Pixtral's [IMG]/[IMG_BREAK]/[IMG_END] rows). Either way the result must hold exactly
    sum(token_counts) image tokens, the positions the features go to."""
    from mlxcel.vision.images import load_image

    image_token = getattr(model, "image_token_id", None)
    if not hasattr(model, "expand_image_text") and not hasattr(model, "expand_image_tokens") or not paths:
        check_placeholder_count(count_placeholders(token_ids, image_token) if image_token is not None else 0, paths)
    if not paths:
        return token_ids, None
    started = time.perf_counter()
    inputs = model.preprocess_images([load_image(p) for p in paths], list(paths))
    inputs.preprocess_ms = (time.perf_counter() - started) * 1000
    if hasattr(model, "expand_image_text"):
        expanded = encode(model.expand_image_text(text, inputs, paths))
    elif hasattr(model, "expand_image_tokens"):
        expanded = model.expand_image_tokens(token_ids, inputs, paths)
    else:
        return expand_placeholders(token_ids, image_token, inputs.token_counts), inputs
    if count_placeholders(expanded, image_token) != sum(inputs.token_counts):
        raise MlxcelError(
            f"the expanded prompt holds {count_placeholders(expanded, image_token)} image tokens for "
            f"{sum(inputs.token_counts)} image features"
        )
    return expanded, inputs
