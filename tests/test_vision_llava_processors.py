"""LLaVA-1.5 (CLIP) and LLaVA-NeXT (any-res) preprocessing and <image> token counts, against
transformers' Pillow-backend image processors and Llava(Next)Processor (the oracle)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from mlxcel.errors import ConfigError, MlxcelError
from mlxcel.vision.images import VisionInputError, load_image
from mlxcel.vision.processors import clip, llava_next
from tests.vision_fixtures import assert_config_issues

pytest.importorskip("transformers")
from transformers import LlavaNextProcessor, LlavaProcessor, PreTrainedTokenizerFast
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.llava_next.image_processing_pil_llava_next import (
    LlavaNextImageProcessorPil,
)

IMAGE_NAMES = ["photo", "tiny", "wide", "rgba", "gray", "exif_rotated"]
# As llava-hf/llava-1.5-7b-hf ships it (unknown keys included: they must be ignored).
LLAVA_15 = {
    "crop_size": {"height": 336, "width": 336},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "CLIPImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "processor_class": "LlavaProcessor",
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"shortest_edge": 336},
}
# As llava-hf/llava-v1.6-mistral-7b-hf ships it.
LLAVA_NEXT = {
    **LLAVA_15,
    "aspect_ratio_setting": "anyres",
    "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
    "image_processor_type": "LlavaNextImageProcessor",
    "processor_class": "LlavaNextProcessor",
}
# Same shape of config at 1/6 scale, so many images stay fast.
SMALL_NEXT = {
    **LLAVA_NEXT,
    "size": {"shortest_edge": 56},
    "crop_size": {"height": 56, "width": 56},
    "image_grid_pinpoints": [[56, 112], [112, 56], [112, 112], [168, 56], [56, 168]],
}
SIZES = [
    (600, 512),
    (5, 3),
    (90, 1200),
    (131, 97),
    (100, 150),
    (160, 90),
    (336, 336),
    (672, 336),
    (1000, 1000),
    (337, 2000),
    (2000, 337),
    (1, 1),
    (720, 1280),
    (1080, 1920),
    (40, 50),
    (4000, 1),
    (1, 4000),
]


def load_images(paths: dict, names=IMAGE_NAMES) -> list[Image.Image]:
    return [load_image(paths[name]) for name in names]


def assert_close(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.shape == theirs.shape
    assert ours.dtype == np.float32
    assert float(np.max(np.abs(ours - theirs.astype(np.float32)))) <= 1e-4


def make_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<image>": 1, "describe": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=["<image>"])


def make_next_processor(raw: dict, strategy: str, patch_size: int = 14) -> LlavaNextProcessor:
    image_processor = LlavaNextImageProcessorPil.from_dict(raw)
    return LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=make_tokenizer(),
        patch_size=patch_size,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=1,
    )


# --- LLaVA-1.5: CLIP ---


@pytest.mark.parametrize(
    "raw",
    [LLAVA_15, {**LLAVA_15, "size": {"shortest_edge": 64}, "crop_size": {"height": 56, "width": 56}}],
    ids=["llava-1.5", "small"],
)
def test_clip_matches_transformers_on_all_odd_images_in_one_call(odd_images, raw):
    images = load_images(odd_images)
    ours = clip.preprocess_images(images, clip.ClipImageConfig.from_dict(raw))
    theirs = CLIPImageProcessorPil.from_dict(raw)(images, return_tensors="np")["pixel_values"]
    crop = raw["crop_size"]["height"]
    assert ours.shape == (len(images), 3, crop, crop)
    assert_close(ours, theirs)


CLIP_VARIANTS = {
    "int-forms": {"size": 64, "crop_size": 56},
    "list-size": {"size": [40, 72], "do_center_crop": False},
    "capped-edge": {"size": {"shortest_edge": 64, "longest_edge": 80}, "do_center_crop": False},
    "crop-pads": {"size": {"shortest_edge": 48}, "crop_size": {"height": 56, "width": 60}},
    "bilinear": {"size": 64, "crop_size": 56, "resample": 2},
    "nearest-no-rescale": {"size": 64, "crop_size": 56, "resample": 0, "do_rescale": False},
    "no-normalize": {"size": 64, "crop_size": 56, "do_normalize": False},
    "scalar-mean-std": {"size": 64, "crop_size": 56, "image_mean": 0.5, "image_std": 0.5},
}


@pytest.mark.parametrize("name", CLIP_VARIANTS)
def test_clip_config_variants_match_transformers(odd_images, name):
    raw = {**LLAVA_15, **CLIP_VARIANTS[name]}
    # Without a fixed crop the shapes differ per image: one image per call then, as transformers must.
    names = ["photo"] if not raw["do_center_crop"] else ["photo", "wide", "tiny"]
    images = load_images(odd_images, names)
    ours = clip.preprocess_images(images, clip.ClipImageConfig.from_dict(raw))
    theirs = CLIPImageProcessorPil.from_dict(raw)(images, return_tensors="np")["pixel_values"]
    assert_close(ours, theirs)


def test_unconverted_pil_modes_match_transformers(odd_images):
    """Images not read by load_image: alpha composites onto white, grayscale and palette expand to RGB."""
    rgba = Image.open(odd_images["rgba"])
    gray = Image.open(odd_images["gray"])
    palette = load_image(odd_images["photo"]).resize((70, 50)).convert("P")
    palette.info["transparency"] = 0
    images = [rgba, gray, palette]
    raw = {**LLAVA_15, "size": 64, "crop_size": 56}
    ours = clip.preprocess_images(images, clip.ClipImageConfig.from_dict(raw))
    assert_close(ours, CLIPImageProcessorPil.from_dict(raw)(images, return_tensors="np")["pixel_values"])
    # and alpha is not simply dropped: the composite differs from load_image's RGB conversion
    dropped = clip.preprocess_images([rgba.convert("RGB")], clip.ClipImageConfig.from_dict(raw))
    assert np.abs(ours[0] - dropped[0]).max() > 0.1


@pytest.mark.parametrize("strategy,expected", [("default", 576), ("full", 577)])
def test_clip_token_count_matches_llava_processor(photo_path, strategy, expected):
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil.from_dict(LLAVA_15),
        tokenizer=make_tokenizer(),
        patch_size=14,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=1,
    )
    ids = processor(text=["describe <image>"], images=[load_image(photo_path)], return_tensors="np")["input_ids"]
    ours = clip.count_image_tokens(336, 14, strategy)
    assert ours == expected == int((ids == processor.image_token_id).sum())
    assert clip.count_image_tokens(56, 8, strategy, num_additional_image_tokens=0) == 49 - (strategy == "default")


# --- LLaVA-NeXT: any-res ---


@pytest.mark.parametrize(
    "raw,names",
    [(LLAVA_NEXT, ["photo", "wide", "exif_rotated"]), (SMALL_NEXT, IMAGE_NAMES)],
    ids=["llava-v1.6-mistral", "small"],
)
def test_llava_next_matches_transformers_in_one_call(odd_images, raw, names):
    images = load_images(odd_images, names)
    ours = llava_next.preprocess_images(images, llava_next.LlavaNextImageConfig.from_dict(raw))
    theirs = LlavaNextImageProcessorPil.from_dict(raw)(images, return_tensors="np")
    crop = raw["crop_size"]["height"]
    assert ours.pixel_values.shape[0] == len(images) and ours.pixel_values.shape[2:] == (3, crop, crop)
    assert_close(ours.pixel_values, theirs["pixel_values"])
    np.testing.assert_array_equal(ours.image_sizes, theirs["image_sizes"])
    assert len(set(ours.patch_counts)) > 1, "the batch should mix tile counts so padding is exercised"
    ragged = LlavaNextImageProcessorPil.from_dict({**raw, "do_pad": False})(images)["pixel_values"]
    assert ours.patch_counts == [len(stack) for stack in ragged]
    for i, stack in enumerate(ragged):
        assert_close(ours.pixel_values[i, : ours.patch_counts[i]], np.asarray(stack))
        assert not ours.pixel_values[i, ours.patch_counts[i] :].any()  # batch padding is zeros


def test_llava_next_slivers_match_transformers():
    """Every pinpoint shrinks a 1-pixel sliver to nothing; transformers then takes the first (tie on zero)."""
    images = [Image.new("RGB", (1, 4000), (200, 10, 30)), Image.new("RGB", (4000, 1), (5, 90, 250))]
    ours = llava_next.preprocess_images(images, llava_next.LlavaNextImageConfig.from_dict(SMALL_NEXT))
    theirs = LlavaNextImageProcessorPil.from_dict(SMALL_NEXT)(images, return_tensors="np")["pixel_values"]
    assert_close(ours.pixel_values, theirs)


def test_llava_next_patch_counts_follow_the_image_size():
    config = llava_next.LlavaNextImageConfig.from_dict(LLAVA_NEXT)
    assert llava_next.plan_patch_count(600, 512, config) == 5  # 672x672 grid: 2x2 tiles + base
    assert llava_next.plan_patch_count(90, 1200, config) == 4  # 336x1008: 1x3 tiles + base
    assert llava_next.plan_best_resolution(90, 1200, config.image_grid_pinpoints) == (336, 1008)


@pytest.mark.parametrize(
    "raw,patch_size", [(LLAVA_NEXT, 14), (SMALL_NEXT, 14), (SMALL_NEXT, 8)], ids=["mistral", "small14", "small8"]
)
@pytest.mark.parametrize("strategy", ["default", "full"])
def test_llava_next_token_counts_match_processor(raw, patch_size, strategy):
    processor = make_next_processor(raw, strategy, patch_size)
    config = llava_next.LlavaNextImageConfig.from_dict(raw)
    image_size = raw["crop_size"]["height"]
    theirs = processor._get_num_multimodal_tokens(image_sizes=SIZES).num_image_tokens
    ours = [
        llava_next.count_image_tokens(
            h, w, config, patch_size=patch_size, image_size=image_size, vision_feature_select_strategy=strategy
        )
        for h, w in SIZES
    ]
    assert ours == theirs
    assert len(set(ours)) > 5  # the sizes really differ in their counts


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_llava_next_token_counts_match_expanded_prompt(odd_images, strategy):
    """End to end: the <image> placeholders LlavaNextProcessor writes into input_ids for real images."""
    processor = make_next_processor(LLAVA_NEXT, strategy)
    config = llava_next.LlavaNextImageConfig.from_dict(LLAVA_NEXT)
    images = load_images(odd_images, ["photo", "wide", "tiny"])
    ids = processor(text=["describe <image> <image> <image>"], images=images, return_tensors="np")["input_ids"]
    ours = sum(
        llava_next.count_image_tokens(
            im.height, im.width, config, patch_size=14, image_size=336, vision_feature_select_strategy=strategy
        )
        for im in images
    )
    assert ours == int((ids == processor.image_token_id).sum())
    assert llava_next.count_image_tokens(512, 600, config, patch_size=14, image_size=336) == 2536


# --- errors ---


def test_int_and_list_forms_parse_as_transformers_reads_them():
    config = clip.ClipImageConfig.from_dict({"size": 336, "crop_size": 336})
    assert config.size == clip.SizeSpec(shortest_edge=336) and config.crop_size == (336, 336)
    assert clip.ClipImageConfig.from_dict({"size": [30, 40]}).size == clip.SizeSpec(height=30, width=40)
    assert clip.ClipImageConfig.from_dict({}) == clip.ClipImageConfig()  # transformers' class defaults
    assert llava_next.LlavaNextImageConfig.from_dict({"image_grid_pinpoints": [[56, 112]]}).image_grid_pinpoints == (
        (56, 112),
    )


def test_bad_config_values_are_all_reported_with_key_value_and_range():
    raw = {
        **LLAVA_NEXT,
        "size": {"shortest_edge": 0},
        "crop_size": {"height": 336},
        "resample": 7,
        "rescale_factor": -1,
        "image_std": [0.2, 0.0, 0.3],
        "image_mean": [0.5, 0.5],
        "do_resize": "yes",
        "image_grid_pinpoints": [[336, 672], [672]],
    }
    with pytest.raises(ConfigError) as info:
        llava_next.LlavaNextImageConfig.from_dict(raw)
    assert_config_issues(
        info.value,
        {
            "preprocessor_config.size": ("positive int", "{'shortest_edge': 0}"),
            "preprocessor_config.crop_size": ("{height, width}", "{'height': 336}"),
            "preprocessor_config.resample": ("3 (bicubic)", "7"),
            "preprocessor_config.rescale_factor": ("> 0", "-1"),
            "preprocessor_config.image_std": ("each > 0", "[0.2, 0.0, 0.3]"),
            "preprocessor_config.image_mean": ("3 numbers", "[0.5, 0.5]"),
            "preprocessor_config.do_resize": ("true or false", "'yes'"),
            "preprocessor_config.image_grid_pinpoints": ("[height, width] pairs", "[[336, 672], [672]]"),
        },
    )


def test_bad_token_count_arguments_raise_config_errors():
    config = llava_next.LlavaNextImageConfig()
    with pytest.raises(ConfigError, match="vision_feature_select_strategy: must be 'default' or 'full'"):
        clip.count_image_tokens(336, 14, "cls")
    with pytest.raises(ConfigError, match="vision_config.patch_size"):
        llava_next.count_image_tokens(100, 100, config, patch_size=0, image_size=336)


def test_bad_images_raise_vision_input_errors_naming_the_source(photo_path):
    clip_config, next_config = (
        clip.ClipImageConfig.from_dict(LLAVA_15),
        llava_next.LlavaNextImageConfig.from_dict(SMALL_NEXT),
    )
    empty = Image.new("RGB", (0, 7))
    with pytest.raises(VisionInputError, match=r"image cat\.png: has no pixels \(0x7\)"):
        clip.preprocess_images([load_image(photo_path), empty], clip_config, sources=["photo.jpg", "cat.png"])
    capped = clip.ClipImageConfig.from_dict({**LLAVA_15, "size": {"shortest_edge": 64, "longest_edge": 80}})
    with pytest.raises(VisionInputError, match=r"image strip\.png: resizing 1x4000 gives 0x80"):
        clip.preprocess_images(
            [Image.new("RGB", (1, 4000))], capped, sources=["strip.png"]
        )  # PIL's ValueError in transformers
    with pytest.raises(VisionInputError, match="not 8-bit RGB"):
        clip.preprocess_images([Image.new("L", (9, 9))], clip.ClipImageConfig(do_convert_rgb=False))
    with pytest.raises(VisionInputError, match="expected a PIL image"):
        clip.preprocess_images([np.zeros((4, 4, 3), np.uint8)], clip_config)
    with pytest.raises(MlxcelError, match="no images"):
        llava_next.preprocess_images([], next_config)
