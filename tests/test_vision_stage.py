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
