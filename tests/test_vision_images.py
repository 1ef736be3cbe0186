"""Image files read as transformers' load_image reads them, and one clear error per bad file."""

from __future__ import annotations

import numpy as np
import pytest

from mlxcel.vision.images import VisionInputError, load_image

image_utils = pytest.importorskip("transformers.image_utils")


@pytest.mark.parametrize("name", ["photo", "tiny", "wide", "rgba", "gray", "exif_rotated"])
def test_images_load_as_transformers_loads_them(odd_images, name):
    ours, theirs = load_image(odd_images[name]), image_utils.load_image(str(odd_images[name]))
    assert ours.mode == "RGB" and ours.size == theirs.size
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_exif_orientation_is_applied(odd_images):
    assert load_image(odd_images["exif_rotated"]).size == (90, 160)  # stored 160x90, displayed upright


def test_bad_files_each_give_one_error_naming_the_file(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not an image")
    truncated = tmp_path / "cut.jpg"
    from PIL import Image

    Image.new("RGB", (64, 64), "red").save(tmp_path / "whole.jpg")
    truncated.write_bytes((tmp_path / "whole.jpg").read_bytes()[:200])
    cases = {
        tmp_path / "missing.png": "no such file",
        tmp_path: "not a file",
        text: "not an image Pillow can read",
        truncated: "cannot be read",
    }
    huge = tmp_path / "huge.png"
    Image.new("L", (9000, 8000)).save(huge)  # 72 megapixels, tiny on disk
    cases[huge] = "9000x8000 is 72 megapixels, over the limit of 64"
    for path, message in cases.items():
        with pytest.raises(VisionInputError, match=message) as info:
            load_image(path)
        assert str(path) in str(info.value)
