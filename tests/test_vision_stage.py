"""The vision stage's placeholder expansion and EmbedMerger."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.errors import MlxcelError
from mlxcel.vision.stage import expand_placeholders, merge_embeddings

IMG = 9


def test_each_placeholder_expands_to_its_images_token_count():
    assert expand_placeholders([1, IMG, 2, IMG, 3], IMG, [3, 2]) == [1, IMG, IMG, IMG, 2, IMG, IMG, 3]
    assert expand_placeholders([1, 2], IMG, []) == [1, 2]
    with pytest.raises(MlxcelError, match="1 image placeholder\\(s\\) for 2 image\\(s\\)"):
        expand_placeholders([1, IMG], IMG, [3, 2])
    with pytest.raises(MlxcelError, match="2 image placeholder\\(s\\) for 1 image\\(s\\)"):
        expand_placeholders([IMG, IMG], IMG, [3])


def test_features_replace_placeholder_positions_in_order():
    ids = [1, IMG, IMG, 2, IMG, 3]
    text = mx.array(np.arange(6 * 4, dtype=np.float32).reshape(1, 6, 4))
    features = mx.array(-np.arange(1, 13, dtype=np.float32).reshape(3, 4))
    merged = np.array(merge_embeddings(text, ids, IMG, features))
    np.testing.assert_array_equal(merged[0, [1, 2, 4]], np.array(features))
    np.testing.assert_array_equal(merged[0, [0, 3, 5]], np.array(text)[0, [0, 3, 5]])
    with pytest.raises(MlxcelError, match="2 image features for 3 placeholder positions"):
        merge_embeddings(text, ids, IMG, features[:2])


class FakeVLM:
    """A family with its own expansion: text-level (`text=True`) or id-level."""

    image_token_id = IMG

    def __init__(self, text: bool, features: int = 3):
        self.features = features
        if text:
            self.expand_image_text = lambda text, inputs, paths: text.replace("<img>", "[" + "i" * self.features + "]")
        else:
            self.expand_image_tokens = lambda ids, inputs, paths: [
                t for i in ids for t in ([7, IMG, IMG, IMG, 8] if i == IMG else [i])
            ]

    def preprocess_images(self, images, sources):
        from mlxcel.vision.stage import ImageInputs

        return ImageInputs(np.zeros((1,), np.float32), [self.features])


def test_families_expand_their_own_layouts(photo_path):
    from mlxcel.vision.stage import prepare_images

    encode = lambda text: [IMG if ch == "i" else ord(ch) for ch in text]  # noqa: E731
    ids, inputs = prepare_images(FakeVLM(text=True), "a<img>b", [97, 0, 98], [str(photo_path)], encode)
    assert ids == [97, ord("["), IMG, IMG, IMG, ord("]"), 98] and inputs.preprocess_ms > 0
    ids, _ = prepare_images(FakeVLM(text=False), "", [1, IMG, 2], [str(photo_path)], encode)
    assert ids == [1, 7, IMG, IMG, IMG, 8, 2]
    with pytest.raises(MlxcelError, match="holds 3 image tokens for 4 image features"):
        fake = FakeVLM(text=False)
        fake.preprocess_images = lambda images, sources: __import__(
            "mlxcel.vision.stage", fromlist=["ImageInputs"]
        ).ImageInputs(np.zeros(1), [4])
        prepare_images(fake, "", [1, IMG, 2], [str(photo_path)], encode)
