"""Qwen2-VL image preprocessing equals transformers' Pillow backend (Qwen2VLImageProcessorPil, loaded
from the same preprocessor_config.json): same grids, same pixel values, same refusals."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
from PIL import Image

from mlxcel.errors import ConfigError
from mlxcel.vision.images import VisionInputError, load_image
from mlxcel.vision.processors.qwen2_vl import (
    Qwen2VLImageConfig,
    count_image_tokens,
    preprocess_image,
    preprocess_images,
    smart_resize,
)

transformers = pytest.importorskip("transformers")
qwen2_vl_pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

IMAGE_NAMES = ["photo", "tiny", "wide", "rgba", "gray", "exif_rotated"]
# Qwen/Qwen2-VL-2B-Instruct's preprocessor_config.json (Qwen2.5-VL's has the same values).
QWEN2_VL_2B = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}
CONFIGS = {
    "qwen2_vl_2b": QWEN2_VL_2B,
    "small_max": {**QWEN2_VL_2B, "max_pixels": 100_000},  # the photo and the wide image shrink
    # newer configs: size {shortest_edge, longest_edge}; also another filter and no normalisation
    "size_form": {
        "size": {"shortest_edge": 20_000, "longest_edge": 60_000},
        "resample": 2,
        "do_normalize": False,
        "image_processor_type": "Qwen2VLImageProcessor",
    },
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def configured(request, tmp_path_factory):
    """(raw config dict, transformers' Pillow-backend processor loaded from it as a checkpoint folder)."""
    folder = tmp_path_factory.mktemp(request.param)
    (folder / "preprocessor_config.json").write_text(json.dumps(CONFIGS[request.param]))
    oracle = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")
    assert type(oracle).__name__ == "Qwen2VLImageProcessorPil"
    return Qwen2VLImageConfig.load(folder), oracle


def run_oracle(oracle, images):
    out = oracle(images, return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def assert_same(ours, theirs):
    (values, grids), (ref_values, ref_grids) = ours, theirs
    np.testing.assert_array_equal(grids, ref_grids)
    assert values.dtype == np.float32 and values.shape == ref_values.shape
    assert np.abs(values - ref_values).max() <= 1e-4


@pytest.mark.parametrize("name", IMAGE_NAMES)
def test_each_image_matches_transformers(configured, odd_images, name):
    config, oracle = configured
    image = load_image(odd_images[name])
    assert_same(preprocess_images([image], config), run_oracle(oracle, [image]))


def test_photo_is_bit_identical(odd_images):
    """Same order of operations and dtypes as transformers (uint8 resize, float64 rescale cast to float32,
    float32 normalize), so not merely close: equal. Normalising in float64 would pass the 1e-4 check above."""
    image = load_image(odd_images["photo"])
    oracle = qwen2_vl_pil.Qwen2VLImageProcessorPil(**QWEN2_VL_2B)
    np.testing.assert_array_equal(preprocess_images([image], QWEN2_VL_2B)[0], run_oracle(oracle, [image])[0])


def test_several_images_of_different_sizes_in_one_call(configured, odd_images):
    config, oracle = configured
    images = [load_image(odd_images[name]) for name in IMAGE_NAMES]
    values, grids = preprocess_images(images, config)
    assert_same((values, grids), run_oracle(oracle, images))
    assert len({tuple(g) for g in grids.tolist()}) > 3  # really different sizes
    assert values.shape[0] == sum(math.prod(g) for g in grids.tolist())


def test_raw_pil_inputs_convert_as_transformers_does(odd_images):
    """Images not read by load_image: RGBA goes onto white (not black), L and P expand to RGB."""
    oracle = qwen2_vl_pil.Qwen2VLImageProcessorPil(**QWEN2_VL_2B)
    photo = Image.open(odd_images["photo"]).convert("RGB").resize((90, 70))
    rgba = photo.convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize(rgba.size))
    images = [rgba, photo.convert("L"), photo.convert("P"), Image.new("RGBA", (60, 60), (0, 0, 0, 0))]
    ours = preprocess_images(images, QWEN2_VL_2B)
    assert_same(ours, run_oracle(oracle, images))


def test_patch_rows_are_merge_windows_of_repeated_frames():
    """Row order and flattening: patches of one merge window are consecutive; each row is C x T x P x P."""
    config = Qwen2VLImageConfig(min_pixels=1, do_rescale=False, do_normalize=False, do_resize=False)
    pixels = np.tile(np.arange(84, dtype=np.uint8)[None, :, None], (56, 1, 3))  # value = column index
    values, grid = preprocess_image(Image.fromarray(pixels), config)
    assert grid == (1, 4, 6) and values.shape == (24, 3 * 2 * 14 * 14)
    row = values.reshape(24, 3, 2, 14, 14)
    np.testing.assert_array_equal(row[:, :, 0], row[:, :, 1])  # the still image fills both frames
    first_columns = row[:, 0, 0, 0, 0]
    np.testing.assert_array_equal(first_columns[:4], [0, 14, 0, 14])  # window (0,0): (0,0) (0,1) (1,0) (1,1)
    np.testing.assert_array_equal(first_columns[4:8], [28, 42, 28, 42])  # then the next window to the right


def test_smart_resize_equals_transformers_on_many_sizes():
    rng = random.Random(0)
    sizes = [(rng.randint(1, 3000), rng.randint(1, 3000)) for _ in range(400)]
    sizes += [(1, 1), (3, 5), (90, 1200), (2, 400), (2, 402), (28, 5600), (5600, 28), (14, 14), (4000, 4000)]
    for min_pixels, max_pixels in [(3136, 12845056), (3136, 100_000), (20_000, 60_000), (1, 784)]:
        for height, width in sizes:
            try:
                expected = qwen2_vl_pil.smart_resize(height, width, 28, min_pixels, max_pixels)
            except ValueError:
                with pytest.raises(VisionInputError, match="aspect ratio"):
                    smart_resize(height, width, 28, min_pixels, max_pixels)
                continue
            assert smart_resize(height, width, 28, min_pixels, max_pixels) == expected, (height, width)


def test_refusals_match_transformers_and_name_the_image():
    oracle = qwen2_vl_pil.Qwen2VLImageProcessorPil(**QWEN2_VL_2B)
    too_wide = Image.new("RGB", (402, 2))  # aspect ratio 201
    with pytest.raises(ValueError, match="aspect ratio"):
        oracle(too_wide)
    with pytest.raises(VisionInputError, match=r"image strip\.png: 402x2 has aspect ratio 201\.0"):
        preprocess_images([Image.new("RGB", (10, 10)), too_wide], QWEN2_VL_2B, sources=["ok.png", "strip.png"])
    with pytest.raises(ZeroDivisionError):  # transformers fails without a message; we say what is wrong
        oracle(Image.new("RGB", (0, 5)))
    with pytest.raises(VisionInputError, match="image empty.png: has no pixels"):
        preprocess_image(Image.new("RGB", (0, 5)), QWEN2_VL_2B, source="empty.png")
    assert_same(
        preprocess_images([Image.new("RGB", (400, 2))], QWEN2_VL_2B), run_oracle(oracle, [Image.new("RGB", (400, 2))])
    )


def test_input_larger_than_the_limit_is_refused(odd_images):
    image = load_image(odd_images["photo"])  # 512x600 = 0.3 MP
    with pytest.raises(
        VisionInputError, match=r"image grace\.jpg: 512x600 is 0\.3 megapixels, above the limit of 0\.2"
    ):
        preprocess_image(image, QWEN2_VL_2B, source="grace.jpg", max_input_pixels=200_000)
    assert preprocess_image(image, QWEN2_VL_2B, max_input_pixels=600 * 512)[1] == (1, 42, 36)


def test_unresized_image_must_be_whole_merge_windows():
    config = {**QWEN2_VL_2B, "do_resize": False}
    with pytest.raises(VisionInputError, match="image a.png: 50x56 is not a multiple of 28"):
        preprocess_image(Image.new("RGB", (50, 56)), config, source="a.png")


def test_image_token_count_matches_transformers(configured, odd_images):
    config, oracle = configured
    for name in IMAGE_NAMES:
        image = load_image(odd_images[name])
        values, grid = preprocess_image(image, config)
        patches = oracle.get_number_of_image_patches(image.height, image.width)
        assert count_image_tokens(grid, config.merge_size) == patches // 4 == values.shape[0] // 4
    assert count_image_tokens((1, 42, 36), 2) == 378


def test_pixel_bounds_resolve_as_transformers_resolves_them():
    cases = [
        {},
        {"min_pixels": 1000, "max_pixels": 50_000},
        {"size": {"shortest_edge": 1000, "longest_edge": 50_000}},
        {"size": {"shortest_edge": 1000, "longest_edge": 50_000}, "max_pixels": 20_000},  # top level wins
    ]
    for raw in cases:
        oracle = qwen2_vl_pil.Qwen2VLImageProcessorPil(**json.loads(json.dumps(raw)))
        config = Qwen2VLImageConfig.from_dict(raw)
        assert (config.min_pixels, config.max_pixels) == (oracle.size.shortest_edge, oracle.size.longest_edge), raw
    legacy = Qwen2VLImageConfig.from_dict({"size": {"min_pixels": 1000, "max_pixels": 50_000}})  # transformers 4.x form
    assert (legacy.min_pixels, legacy.max_pixels) == (1000, 50_000)


def test_bad_config_values_are_all_reported_with_key_value_and_range():
    raw = {
        "patch_size": 0,
        "merge_size": 2.5,
        "temporal_patch_size": True,
        "min_pixels": 5000,
        "max_pixels": 4000,
        "image_mean": [0.5, 0.5],
        "image_std": [0.2, 0.0, 0.2],
        "rescale_factor": -1,
        "resample": 7,
        "do_resize": "yes",
    }
    with pytest.raises(ConfigError) as info:
        Qwen2VLImageConfig.from_dict(raw)
    lines = str(info.value).splitlines()
    expected = [
        "preprocessor_config.do_resize: must be true or false (got 'yes')",
        "preprocessor_config.patch_size: must be an integer >= 1 (got 0)",
        "preprocessor_config.temporal_patch_size: must be an integer >= 1 (got True)",
        "preprocessor_config.merge_size: must be an integer >= 1 (got 2.5)",
        "preprocessor_config.max_pixels: max_pixels (or size.longest_edge) must be >= min_pixels 5000 (got 4000)",
        (
            "preprocessor_config.resample: must be a Pillow filter id: 0 (nearest), 1 (lanczos), 2 (bilinear), "
            "3 (bicubic), 4 (box), 5 (hamming) (got 7)"
        ),
        "preprocessor_config.rescale_factor: must be a finite number > 0 (usually 1/255) (got -1)",
        (
            "preprocessor_config.image_mean: must be a number or a list of 3 numbers (R, G, B), each finite "
            "(got [0.5, 0.5])"
        ),
        (
            "preprocessor_config.image_std: must be a number or a list of 3 numbers (R, G, B), each > 0 "
            "(got [0.2, 0.0, 0.2])"
        ),
    ]
    assert lines[: len(expected)] == expected
    assert "preprocessor_config.json" in lines[-1]


def test_bad_size_forms_are_reported():
    with pytest.raises(
        ConfigError, match=r"preprocessor_config.size.shortest_edge: is required unless min_pixels is set"
    ):
        Qwen2VLImageConfig.from_dict({"size": {"longest_edge": 50_000}})
    with pytest.raises(ConfigError, match=r"preprocessor_config.size.longest_edge: must be an integer >= 1 \(got -3\)"):
        Qwen2VLImageConfig.from_dict({"size": {"shortest_edge": 10, "longest_edge": -3}})
    with pytest.raises(ConfigError, match=r"preprocessor_config.size: must be \{shortest_edge, longest_edge\}"):
        Qwen2VLImageConfig.from_dict({"size": 448})
    scalar = Qwen2VLImageConfig.from_dict({"image_mean": 0.5, "image_std": None, "do_resize": None})
    assert (
        scalar.image_mean == (0.5, 0.5, 0.5) and scalar.image_std == Qwen2VLImageConfig().image_std and scalar.do_resize
    )
