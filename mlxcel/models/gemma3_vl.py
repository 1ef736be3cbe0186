"""Gemma 3 with images (model_type gemma3, Gemma3ForConditionalGeneration): the SigLIP tower
(mlxcel/vision/siglip.py), Gemma 3's projector (mlxcel/vision/gemma3_projector.py: average pool to
mm_tokens_per_image, RMSNorm, matmul) and the gemma3 text family as the language model.

The Model is the gemma3 text Model with `vision_tower` and `multi_modal_projector` added, so the
engine, the decoders, the caches and the sliding windows see exactly the text model; a text
prompt runs as it does on the text family (the vision weights stay unread until an image comes).
`model.args` is the language model's ModelArgs; the multimodal settings are in `model.vl_args`.

Prompt layout (mlxcel/vision/processors/gemma3.py): the chat template writes `<start_of_image>`
per image; `expand_image_text` rewrites it as Gemma3Processor does (`\\n\\n<start_of_image>` +
`<image_soft_token>` x mm_tokens_per_image + `<end_of_image>\\n\\n`, pan-and-scan crops after the
image) and the pipeline tokenizes it again. The features replace the soft tokens
(image_token_index); the text embeddings are scaled by sqrt(hidden) at lookup and the features
are written unscaled, as in transformers.

Attention over images (transformers' token_type_ids masks, prefill only): each unbroken run of
soft tokens is one block whose tokens see each other in both directions. Full-attention layers:
key <= query, or both in the same block. Sliding layers: key > query - window, and (key <= query
or same block). `image_blocks(token_ids)` gives a row's block ids (-1 outside images); the engine
passes them as `forward_with_embeddings(..., image_blocks=[B, L])` and, because a block must not
be cut between prefill pieces, prefills image prompts in one piece (`prefill_in_one_piece`).
Decode steps use the plain causal / sliding masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxcel.errors import MlxcelError
from mlxcel.models import gemma3
from mlxcel.vision import gemma3_projector, siglip
from mlxcel.vision.processors import gemma3 as gemma3_processor
from mlxcel.vision.stage import ImageInputs

REQUIRED_KEYS = ("model_type",)


@dataclass
class ModelArgs:
    text: gemma3.ModelArgs
    config: dict = field(default_factory=dict)  # the whole config.json (the projector reads it)
    vision_config: dict = field(default_factory=dict)
    image_token_id: int = gemma3_processor.Gemma3ImageTokens.image_id
    boi_token_id: int = gemma3_processor.Gemma3ImageTokens.boi_id
    eoi_token_id: int = gemma3_processor.Gemma3ImageTokens.eoi_id
    mm_tokens_per_image: int = 256

    @property
    def model_type(self) -> str:
        return "gemma3"

    @classmethod
    def from_config(cls, config: dict, **overrides: Any) -> ModelArgs:
        """`overrides` go to the language model's args."""
        text_config = gemma3.normalize_config({**config, "text_config": config.get("text_config") or {}})
        missing = [key for key in gemma3.REQUIRED_KEYS if key not in text_config]
        if missing:
            raise MlxcelError(f"text_config: missing required key(s) {', '.join(missing)}")
        tokens = config.get("mm_tokens_per_image")
        return cls(
            text=gemma3.ModelArgs.from_config(text_config, **overrides),
            config={**config, "text_config": text_config},
            vision_config=dict(config.get("vision_config") or {}),
            image_token_id=config.get("image_token_index", config.get("image_token_id", cls.image_token_id)),
            boi_token_id=config.get("boi_token_index", cls.boi_token_id),
            eoi_token_id=config.get("eoi_token_index", cls.eoi_token_id),
            mm_tokens_per_image=256 if tokens is None else tokens,
        )


def find_image_blocks(token_ids: list[int], image_token_id: int) -> list[int]:
    """transformers' get_block_sequence_ids_for_mask: each unbroken run of soft tokens one block
    (0, 1, ...), -1 elsewhere."""
    blocks, current, previous = [], -1, False
    for token in token_ids:
        is_image = token == image_token_id
        if is_image and not previous:
            current += 1
        blocks.append(current if is_image else -1)
        previous = is_image
    return blocks


def make_block_mask(length: int, cache, image_blocks: mx.array) -> mx.array:
    """[B, 1, L, S] boolean mask of `length` new queries (block ids `image_blocks` [B, L]) against
    what the layer's cache returns: causal (and windowed) with same-block pairs opened, left
    padding hidden. Keys from earlier pieces are outside every block."""
    offset, window, left_pad = cache.offset, getattr(cache, "window", None), cache.left_pad
    start = cache.piece_start() if window is not None else 0
    key_pos = mx.arange(start, offset + length)
    query_pos = mx.arange(offset, offset + length)
    earlier = offset - start
    B = image_blocks.shape[0]
    key_blocks = (
        mx.concatenate([mx.full((B, earlier), -1, dtype=image_blocks.dtype), image_blocks], axis=1)
        if earlier
        else image_blocks
    )
    same = (image_blocks[:, :, None] == key_blocks[:, None, :]) & (image_blocks[:, :, None] >= 0)  # [B, L, S]
    mask = (key_pos[None, :] <= query_pos[:, None])[None] | same
    if window is not None:
        mask = mask & (key_pos[None, :] > query_pos[:, None] - window)[None]
    mask = mask[:, None]
    if left_pad is not None:
        visible = (key_pos[None, :] >= left_pad[:, None])[:, None, None, :]
        is_self = (key_pos[None, :] == query_pos[:, None])[None, None]
        mask = mask & (visible | is_self)
    return mask


class Model(gemma3.Model):
    # evaluated at the first image, not at load (loader.read_language_parameters)
    vision_modules = ("vision_tower", "multi_modal_projector")
    # an image block must not be cut between prefill pieces (its tokens see each other)
    prefill_in_one_piece = True

    def __init__(self, args: ModelArgs):
        super().__init__(args.text)
        self.model_type = "gemma3"
        self.vl_args = args
        self.image_token_id = args.image_token_id
        self.vision_tower = siglip.make_siglip_vision_model(args.vision_config)
        self.multi_modal_projector = gemma3_projector.make_gemma3_projector(args.config, self.vision_tower.args)
        self._preprocessor_folder: Path | None = None
        self._image_config = None

    # ---- the vision stage (mlxcel/vision/stage.py) ----------------------------------------------

    @property
    def tokens_per_image(self) -> int:
        return self.multi_modal_projector.tokens_per_image

    def attach_preprocessor(self, folder: str | Path) -> None:
        self._preprocessor_folder = Path(folder)
        self._image_config = None

    def image_config(self) -> gemma3_processor.Gemma3ImageConfig:
        if self._image_config is None:
            folder = self._preprocessor_folder
            if folder is None:
                raise MlxcelError(
                    "this gemma3 model has no image processor (load it from a checkpoint folder to use images)"
                )
            path = folder / "preprocessor_config.json"
            if not path.is_file():
                raise MlxcelError(
                    f"{folder}: no preprocessor_config.json, which images need (copy it from the original checkpoint)"
                )
            config = gemma3_processor.Gemma3ImageConfig.load(path)
            size = self.vision_tower.args.image_size
            if config.do_resize and config.size != (size, size):
                raise MlxcelError(
                    f"{path}: size {config.size} disagrees with the vision tower's {size}x{size} "
                    "(vision_config.image_size)"
                )
            self._image_config = config
        return self._image_config

    def preprocess_images(self, images: list, sources: list[str]) -> ImageInputs:
        """Pixel values (each image, then its pan-and-scan crops) and each image's soft-token count."""
        batch = gemma3_processor.preprocess_images(images, self.image_config(), sources)
        size = self.vision_tower.args.image_size
        if batch.pixel_values.shape[-2:] != (size, size):
            raise MlxcelError(
                f"images preprocess to {tuple(batch.pixel_values.shape[-2:])}, but the vision tower takes {size}x{size}"
            )
        counts = [(1 + crops) * self.tokens_per_image for crops in batch.num_crops]
        return ImageInputs(batch.pixel_values, counts, {"num_crops": batch.num_crops})

    def expand_image_text(self, text: str, inputs: ImageInputs, paths: list[str]) -> str:
        """The rendered prompt with each `<start_of_image>` as Gemma3Processor expands it."""
        return gemma3_processor.expand_prompt_text(text, inputs.extras["num_crops"], self.tokens_per_image)

    def encode_images(self, inputs: ImageInputs) -> mx.array:
        """[sum(token_counts), hidden] features in order, in the language model's dtype."""
        pixels = mx.array(inputs.pixel_values)
        projected = self.multi_modal_projector(self.vision_tower(pixels))
        features = projected.reshape(-1, projected.shape[-1])
        if features.shape[0] != sum(inputs.token_counts):
            raise MlxcelError(
                f"the vision tower gave {features.shape[0]} features for {sum(inputs.token_counts)} image tokens"
            )
        return features.astype(self.model.norm.weight.dtype)

    def image_blocks(self, token_ids: list[int]) -> list[int]:
        """Per token: its image block (bidirectional attention inside it), -1 outside images."""
        return find_image_blocks(token_ids, self.image_token_id)

    def make_prefill_extras(
        self, token_ids: list[int], inputs: ImageInputs | None, pad: int
    ) -> tuple[dict[str, mx.array], int]:
        """The engine's per-row prefill inputs: image block ids [1, pad + L] (-1 for padding and
        text rows); no position shift."""
        blocks = self.image_blocks(token_ids) if inputs is not None else [-1] * len(token_ids)
        return {"image_blocks": mx.array([[-1] * pad + blocks], dtype=mx.int32)}, 0

    # ---- the language model with image blocks ----------------------------------------------------

    def forward_with_embeddings(
        self,
        embeddings: mx.array,
        cache: list,
        mask: Any = None,
        logits_at: int | None = None,
        image_blocks: mx.array | None = None,
    ) -> mx.array:
        if image_blocks is None or mask is not None:  # all -1 (a text row's) gives the causal/sliding masks
            return super().forward_with_embeddings(embeddings, cache, mask, logits_at)
        h, length = embeddings, embeddings.shape[1]
        built: dict = {}
        masks = []
        for layer_cache in cache:
            window = getattr(layer_cache, "window", None)
            if window not in built:
                built[window] = make_block_mask(length, layer_cache, image_blocks)
            masks.append(built[window])
        for layer, layer_cache, layer_mask in zip(self.model.layers, cache, masks):
            h = layer(h, layer_mask, layer_cache)
        if logits_at is not None:
            h = h[:, logits_at : logits_at + 1, :]
        return self.compute_logits(self.model.norm(h))

    # ---- weights ---------------------------------------------------------------------------------

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        tower, projector, rest = gemma3_projector.split_vision_weights(weights)
        language = super().sanitize(rest)
        tower = {f"vision_tower.{k}": v for k, v in self.vision_tower.sanitize(tower).items()}
        projector = {f"multi_modal_projector.{k}": v for k, v in self.multi_modal_projector.sanitize(projector).items()}
        return {**language, **tower, **projector}
