"""Idefics3 / SmolVLM: preprocessing, prompt layout and connector against transformers' Pillow image
processors, Idefics3Processor / SmolVLMProcessor and Idefics3Connector (the oracle). Tiny sizes
(longest edge 112, tiles of 56) keep it fast."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from mlxcel.errors import ConfigError, MlxcelError
from mlxcel.vision.idefics3_projector import Idefics3Connector, count_tile_tokens, pixel_shuffle
from mlxcel.vision.images import VisionInputError, load_image
from mlxcel.vision.processors import idefics3
from tests.vision_fixtures import assert_config_issues

pytest.importorskip("transformers")
import mlx.core as mx
import torch
import transformers
from packaging.version import Version
from transformers import Idefics3Config, Idefics3Processor, PreTrainedTokenizerFast, SmolVLMConfig, SmolVLMProcessor
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector as TorchConnector
from transformers.models.smolvlm import processing_smolvlm
from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

IMAGE_NAMES = ["photo", "tiny", "wide", "rgba", "gray", "exif_rotated"]
# The keys an Idefics3 / SmolVLM preprocessor_config.json has, sizes shrunk: the longest edge 112 and tiles
# of 56 (Idefics3-8B: 1456 and 364); unknown keys (image_processor_type, ...) must be ignored.
SMALL = {
    "do_convert_rgb": True,
    "do_image_splitting": True,
    "do_normalize": True,
    "do_pad": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Idefics3ImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "max_image_size": {"longest_edge": 56},
    "processor_class": "Idefics3Processor",
    "resample": 1,
    "rescale_factor": 0.00392156862745098,
    "size": {"longest_edge": 112},
}
WIDE_GRID = {**SMALL, "size": {"longest_edge": 224}}  # up to 4x4 tiles
PROCESSORS = {"idefics3": Idefics3ImageProcessorPil, "smolvlm": SmolVLMImageProcessorPil}
SIZES = [
    (600, 512),
    (5, 3),
    (90, 1200),
    (131, 97),
    (100, 150),
    (160, 90),
    (56, 56),
    (57, 112),
    (113, 57),
    (1000, 1000),
    (337, 2000),
    (1, 1),
    (720, 1280),
    (40, 50),
    (4000, 1),
    (1, 4000),
]
SPECIALS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)
]


def load_images(paths: dict, names=IMAGE_NAMES) -> list[Image.Image]:
    return [load_image(paths[name]) for name in names]


def assert_close(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.shape == theirs.shape
    assert ours.dtype == np.float32
    assert float(np.max(np.abs(ours - theirs.astype(np.float32)))) <= 1e-4


def run_theirs(raw: dict, images, kind: str = "idefics3"):
    return PROCESSORS[kind].from_dict(raw)(images, return_tensors="np", return_row_col_info=True)


def assert_batch_equal(ours: idefics3.Idefics3Batch, theirs) -> None:
    assert_close(ours.pixel_values, theirs["pixel_values"])
    np.testing.assert_array_equal(ours.pixel_attention_mask, theirs["pixel_attention_mask"])
    assert ours.rows == [list(r) for r in theirs["rows"]] and ours.cols == [list(c) for c in theirs["cols"]]


# --- image processor ---


@pytest.mark.parametrize("splitting", [True, False], ids=["split", "no-split"])
@pytest.mark.parametrize("kind", PROCESSORS)
def test_processor_matches_transformers_on_odd_images_in_one_call(odd_images, kind, splitting):
    raw = {**SMALL, "do_image_splitting": splitting}
    images = load_images(odd_images)
    ours = idefics3.preprocess_images(images, idefics3.Idefics3ImageConfig.from_dict(raw))
    theirs = run_theirs(raw, images, kind)
    assert_batch_equal(ours, theirs)
    if splitting:  # photo 2x2 (+ global), wide 1x2 (+ global): tiles row by row, the global view last
        assert (ours.images[0][0].rows, ours.images[0][0].cols, ours.images[0][0].n_frames) == (2, 2, 5)
        assert (ours.images[0][2].rows, ours.images[0][2].cols, ours.images[0][2].n_frames) == (1, 2, 3)
    else:
        assert ours.rows == [[0] * len(images)] and ours.frame_counts == [len(images)]
    assert ours.pixel_values.shape[2:] == (3, 56, 56)


def test_batch_padding_and_ragged_frames_match_transformers(odd_images):
    """Samples with different frame counts: zero frames pad, the mask is false on them; with do_pad false
    transformers returns each sample's frames unpadded, which are our per-image tiles."""
    photo, tiny, wide, gray = load_images(odd_images, ["photo", "tiny", "wide", "gray"])
    samples = [[wide], [photo, tiny], [gray]]
    config = idefics3.Idefics3ImageConfig.from_dict(SMALL)
    ours = idefics3.preprocess_batch(samples, config)
    assert_batch_equal(ours, run_theirs(SMALL, samples))
    assert ours.frame_counts == [3, 10, 5] and ours.pixel_values.shape[:2] == (3, 10)
    assert not ours.pixel_values[0, 3:].any() and not ours.pixel_attention_mask[0, 3:].any()
    assert ours.pixel_attention_mask[0, :3].all()
    ragged = Idefics3ImageProcessorPil.from_dict({**SMALL, "do_pad": False})(samples)["pixel_values"]
    for sample, frames in zip(ours.images, ragged):
        assert_close(np.concatenate([image.tiles for image in sample]), np.stack(frames))


VARIANTS = {
    "wide-grid": WIDE_GRID,
    "longest-not-tile-multiple": {**SMALL, "size": {"longest_edge": 100}},
    "longest-is-tile": {**SMALL, "size": {"longest_edge": 56}},  # square images stay one frame, rows = cols = 0
    "exact-size": {**SMALL, "size": {"height": 70, "width": 130}},
    "int-size": {**SMALL, "size": 90},
    "no-resize": {**SMALL, "do_resize": False},
    "bilinear": {**SMALL, "resample": 2},
    "bicubic-no-split": {**SMALL, "resample": 3, "do_image_splitting": False},
    "no-rescale": {**SMALL, "do_rescale": False, "image_mean": 127.5, "image_std": 127.5},
    "no-normalize": {**SMALL, "do_normalize": False},
    "imagenet-mean": {**SMALL, "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]},
}


@pytest.mark.parametrize("name", VARIANTS)
def test_config_variants_match_transformers(odd_images, name):
    raw = VARIANTS[name]
    images = load_images(odd_images, ["photo", "wide", "tiny"])
    if name == "no-resize":  # the original size is tiled: keep it small
        images = [image.resize((150, 100)) for image in images]
    ours = idefics3.preprocess_images(images, idefics3.Idefics3ImageConfig.from_dict(raw))
    assert_batch_equal(ours, run_theirs(raw, images))


@pytest.mark.parametrize(
    "raw",
    [SMALL, WIDE_GRID, VARIANTS["longest-not-tile-multiple"], VARIANTS["no-resize"]],
    ids=["small", "wide-grid", "longest-100", "no-resize"],
)
def test_grids_follow_the_processing_for_many_sizes(raw):
    """rows/cols from the size alone (plan_grid) equal what transformers' processing gives, so a prompt can
    be laid out before its pixels exist; frames per image = rows * cols + 1 (1 when unsplit)."""
    config = idefics3.Idefics3ImageConfig.from_dict(raw)
    processor = Idefics3ImageProcessorPil.from_dict(raw)
    sizes = SIZES if raw.get("do_resize", True) else [(h, w) for h, w in SIZES if max(h, w) <= 600]
    images = [Image.new("RGB", (w, h), (200, 100, 50)) for h, w in sizes]
    theirs = processor([[image] for image in images], return_row_col_info=True, do_pad=False)
    grids = [idefics3.plan_grid(h, w, config) for h, w in sizes]
    assert grids == [(r[0], c[0]) for r, c in zip(theirs["rows"], theirs["cols"])]
    assert [len(frames) for frames in theirs["pixel_values"]] == [r * c + 1 for r, c in grids]
    assert len(set(grids)) > 2


def test_unconverted_pil_modes_match_transformers(odd_images):
    rgba, gray = Image.open(odd_images["rgba"]), Image.open(odd_images["gray"])
    palette = load_image(odd_images["photo"]).resize((70, 50)).convert("P")
    palette.info["transparency"] = 0
    images = [rgba, gray, palette]
    ours = idefics3.preprocess_images(images, idefics3.Idefics3ImageConfig.from_dict(SMALL))
    assert_batch_equal(ours, run_theirs(SMALL, images))


# --- prompt layout ---


def make_tokenizer(merge_newlines: bool) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 / Llama-3 style) with the Idefics3 added tokens; with merge_newlines
    "\\n\\n" is one token, as in SmolLM2's and Llama 3's vocabularies."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {char: i for i, char in enumerate(sorted(ByteLevel.alphabet()))}
    merges = []
    if merge_newlines:
        vocab["ĊĊ"] = len(vocab)
        merges = [("Ċ", "Ċ")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, additional_special_tokens=SPECIALS)


class NoVideoSmolVLMProcessor(SmolVLMProcessor):
    """SmolVLMProcessor without its video processor (which needs torchvision): images only."""

    def check_argument_for_proper_class(self, name, arg):
        return None if name == "video_processor" else super().check_argument_for_proper_class(name, arg)


def make_processor(kind: str, raw: dict, tokenizer, image_seq_len: int, monkeypatch):
    image_processor = PROCESSORS[kind].from_dict(raw)
    if kind == "idefics3":
        return Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=image_seq_len)
    monkeypatch.setattr(processing_smolvlm, "num2words", str)  # video prompts only; not installed here
    return NoVideoSmolVLMProcessor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None, image_seq_len=image_seq_len
    )


@pytest.mark.parametrize("merge_newlines", [True, False], ids=["nn-merged", "nn-split"])
@pytest.mark.parametrize("splitting", [True, False], ids=["split", "no-split"])
@pytest.mark.parametrize("kind", PROCESSORS)
def test_prompt_ids_match_the_processors(odd_images, monkeypatch, kind, splitting, merge_newlines):
    """The template's text with one <image> per image, tokenized, then each placeholder expanded by
    make_image_prompt_ids: equal to the processor's input_ids (it expands the text, then tokenizes)."""
    tokenizer = make_tokenizer(merge_newlines)
    raw = {**WIDE_GRID, "do_image_splitting": splitting}
    processor = make_processor(kind, raw, tokenizer, 5, monkeypatch)
    images = load_images(odd_images, ["photo", "wide", "tiny"])
    text = "User:<image>Describe<image>\n\n<image> both.<end_of_utterance>\nAssistant:"
    theirs = processor(text=[text], images=images)["input_ids"][0]

    batch = idefics3.preprocess_images(images, idefics3.Idefics3ImageConfig.from_dict(raw))
    special = tokenizer.get_added_vocab()

    def encode(s):
        return tokenizer(s, add_special_tokens=False)["input_ids"]

    layouts = [idefics3.make_image_prompt_ids(image.rows, image.cols, 5, special, encode) for image in batch.images[0]]
    ours = idefics3.expand_image_prompts(encode(text), special["<image>"], layouts)
    assert ours == theirs
    image_id = special["<image>"]
    counts = [idefics3.count_image_tokens(image.rows, image.cols, 5) for image in batch.images[0]]
    assert sum(counts) == theirs.count(image_id) == 5 * sum(batch.frame_counts)
    if splitting:
        assert (batch.images[0][0].rows, batch.images[0][0].cols) == (4, 4)  # rows up to row_4_col_4 appear


@pytest.mark.parametrize("rows,cols", [(0, 0), (1, 1), (2, 3), (4, 1), (7, 2)])
def test_prompt_text_matches_the_processors(monkeypatch, rows, cols):
    """Rows past 6 have no added <row_r_col_c> token in Idefics3's vocabulary: the text is the same, and
    make_image_prompt_ids encodes the tag as text between the specials, as the tokenizer does."""
    tokenizer = make_tokenizer(True)
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil.from_dict(SMALL), tokenizer=tokenizer, image_seq_len=3
    )
    expected = processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
    assert idefics3.make_image_prompt(rows, cols, 3) == expected
    custom = idefics3.ImagePromptTokens(fake_image="<fake>", image="<img>", global_image="<global_image>")
    assert idefics3.make_image_prompt(rows, cols, 2, custom) == processing_smolvlm.get_image_prompt_string(
        rows, cols, 2, fake_token_around_image="<fake>", image_token="<img>", global_image_token="<global_image>"
    )
    ids = idefics3.make_image_prompt_ids(
        rows, cols, 3, tokenizer.get_added_vocab(), lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]
    )
    assert ids == tokenizer(expected, add_special_tokens=False)["input_ids"]


def test_prompt_ids_with_mlxcel_tokenizer(tmp_path):
    """The same layout through mlxcel's own tokenizer (its special_tokens and encode), as the pipeline will call it."""
    from mlxcel.tokenizer.loader import load_tokenizer

    reference = make_tokenizer(True)
    reference.save_pretrained(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    for rows, cols in [(0, 0), (2, 3), (4, 4)]:
        ids = idefics3.make_image_prompt_ids(
            rows, cols, 2, tokenizer.special_tokens, lambda s: tokenizer.encode(s, add_special_tokens=False)
        )
        assert ids == reference(idefics3.make_image_prompt(rows, cols, 2), add_special_tokens=False)["input_ids"]


def test_prompt_tokens_from_a_smolvlm_tokenizer_config():
    raw = {"extra_special_tokens": {"fake_image_token": "<fake>", "image_token": "<img>"}, "global_image_token": "<g>"}
    assert idefics3.ImagePromptTokens.from_tokenizer_config(raw) == idefics3.ImagePromptTokens("<fake>", "<img>", "<g>")
    assert idefics3.ImagePromptTokens.from_tokenizer_config({}) == idefics3.ImagePromptTokens()


@pytest.mark.parametrize("merge_newlines", [True, False], ids=["nn-merged", "nn-split"])
def test_layout_lengths_match_the_processor_token_counts(merge_newlines):
    """For many sizes: the whole expansion tokenizes as the processor's own prompt text for its own grid, and
    holds as many <image> tokens as _get_num_multimodal_tokens reports (transformers 5.25 counts only those;
    earlier releases counted the whole expansion, so the length is checked against the text instead)."""
    tokenizer = make_tokenizer(merge_newlines)
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil.from_dict(WIDE_GRID), tokenizer=tokenizer, image_seq_len=4
    )
    config = idefics3.Idefics3ImageConfig.from_dict(WIDE_GRID)
    image_id = tokenizer.convert_tokens_to_ids(processor.image_token)

    def encode(s):
        return tokenizer(s, add_special_tokens=False)["input_ids"]

    ours = [
        idefics3.make_image_prompt_ids(*idefics3.plan_grid(h, w, config), 4, tokenizer.get_added_vocab(), encode)
        for h, w in SIZES
    ]
    expected = []
    for h, w in SIZES:
        _, rows, cols = processor.image_processor.get_number_of_image_patches(h, w, {})
        expected.append(encode(processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)))
    assert ours == expected
    counts = processor._get_num_multimodal_tokens(image_sizes=SIZES).num_image_tokens
    counted_whole = Version(transformers.__version__) < Version("5.25")
    assert [len(ids) if counted_whole else ids.count(image_id) for ids in ours] == counts


# --- connector ---


def make_config(cls, scale_factor: int, vision_hidden: int = 16, text_hidden: int = 24):
    vision = {
        "hidden_size": vision_hidden,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 48,
        "patch_size": 4,
    }
    text = {
        "model_type": "llama",
        "hidden_size": text_hidden,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 64,
    }
    return cls(vision_config=vision, text_config=text, scale_factor=scale_factor)


@pytest.mark.parametrize("scale_factor", [2, 3, 4])
def test_connector_matches_transformers(scale_factor):
    torch.manual_seed(0)
    config = make_config(Idefics3Config, scale_factor)
    theirs = TorchConnector(config).eval()
    features = torch.randn(3, 144, 16)  # 12x12 patches per tile (image 48 / patch 4)
    with torch.no_grad():
        expected = theirs(features).numpy()
        shuffled = theirs.pixel_shuffle(features, scale_factor).numpy()
    ours = Idefics3Connector.from_config(config.to_dict())
    ours.load_weights(list(ours.sanitize({k: mx.array(v.numpy()) for k, v in theirs.state_dict().items()}).items()))
    got = ours(mx.array(features.numpy()))
    assert got.shape == expected.shape == (3, 144 // scale_factor**2, 24)
    assert float(np.max(np.abs(np.array(got) - expected))) <= 1e-5
    np.testing.assert_array_equal(
        np.array(pixel_shuffle(mx.array(features.numpy()), scale_factor)), shuffled
    )  # a permutation: exact


@pytest.mark.parametrize("cls", [Idefics3Config, SmolVLMConfig], ids=["idefics3", "smolvlm"])
def test_connector_loads_save_pretrained_weights(tmp_path, cls):
    """The names Idefics3/SmolVLMForConditionalGeneration.save_pretrained writes: model.connector.*."""
    from safetensors.numpy import load_file
    from transformers import Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration

    torch.manual_seed(1)
    config = make_config(cls, 2)
    model_cls = Idefics3ForConditionalGeneration if cls is Idefics3Config else SmolVLMForConditionalGeneration
    model = model_cls(config).eval()
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    assert [k for k in weights if "connector" in k] == ["model.connector.modality_projection.proj.weight"]
    ours = Idefics3Connector.from_config(config.to_dict())
    loaded = ours.sanitize({k: mx.array(v) for k, v in weights.items()})
    assert list(loaded) == ["modality_projection.proj.weight"]
    ours.load_weights(list(loaded.items()))
    # MLX conversions drop the model. level
    assert list(
        ours.sanitize({"connector.modality_projection.proj.weight": loaded["modality_projection.proj.weight"]})
    ) == list(loaded)
    features = torch.randn(2, 144, 16)
    with torch.no_grad():
        expected = model.model.connector(features).numpy()
    assert float(np.max(np.abs(np.array(ours(mx.array(features.numpy()))) - expected))) <= 1e-5
    assert count_tile_tokens(48, 4, 2) == model.model.image_seq_len == 36


def test_connector_rejects_bad_grids_and_config():
    with pytest.raises(MlxcelError, match="square patch grid"):
        pixel_shuffle(mx.zeros((1, 10, 4)), 2)
    with pytest.raises(MlxcelError, match="divisible by 4"):
        pixel_shuffle(mx.zeros((1, 36, 4)), 4)
    with pytest.raises(ConfigError) as info:
        Idefics3Connector.from_config({"scale_factor": 0, "vision_config": {"hidden_size": "x"}})
    assert [i.path for i in info.value.issues] == ["scale_factor", "vision_config.hidden_size"]
    assert Idefics3Connector.from_config({}).modality_projection.proj.weight.shape == (4096, 1152 * 4)


# --- errors ---


def test_config_defaults_and_forms_parse_as_transformers_reads_them():
    assert idefics3.Idefics3ImageConfig.from_dict({}) == idefics3.Idefics3ImageConfig()
    default = Idefics3ImageProcessorPil()
    assert (default.size["longest_edge"], default.max_image_size["longest_edge"], default.resample) == (1456, 364, 1)
    config = idefics3.Idefics3ImageConfig.from_dict({"size": 90, "max_image_size": {"longest_edge": 56}})
    assert (config.size.height, config.size.width, config.max_image_size) == (90, 90, 56)
    assert idefics3.Idefics3ImageConfig.from_dict({"size": [30, 40]}).size.width == 40


def test_bad_config_values_are_all_reported_with_key_value_and_range():
    raw = {
        **SMALL,
        "size": {"shortest_edge": 100},
        "max_image_size": 364,
        "resample": 9,
        "rescale_factor": 0,
        "image_std": [0.5, 0, 0.5],
        "image_mean": [0.5],
        "do_image_splitting": "yes",
        "do_pad": 1,
    }
    with pytest.raises(ConfigError) as info:
        idefics3.Idefics3ImageConfig.from_dict(raw)
    assert_config_issues(
        info.value,
        {
            "preprocessor_config.size": ("{longest_edge}", "{'shortest_edge': 100}"),
            "preprocessor_config.max_image_size": ("{longest_edge}", "364"),
            "preprocessor_config.resample": ("1 (lanczos)", "9"),
            "preprocessor_config.rescale_factor": ("> 0", "0"),
            "preprocessor_config.image_std": ("each > 0", "[0.5, 0, 0.5]"),
            "preprocessor_config.image_mean": ("3 numbers", "[0.5]"),
            "preprocessor_config.do_image_splitting": ("true or false", "'yes'"),
            "preprocessor_config.do_pad": ("true or false", "1"),
        },
    )


def test_bad_images_and_layout_arguments_raise(photo_path):
    config = idefics3.Idefics3ImageConfig.from_dict(SMALL)
    with pytest.raises(VisionInputError, match=r"image cat\.png: has no pixels \(0x7\)"):
        idefics3.preprocess_images(
            [load_image(photo_path), Image.new("RGB", (0, 7))], config, sources=["a.jpg", "cat.png"]
        )
    with pytest.raises(VisionInputError, match="not 8-bit RGB"):
        idefics3.preprocess_images([Image.new("L", (9, 9))], idefics3.Idefics3ImageConfig(do_convert_rgb=False))
    with pytest.raises(VisionInputError, match="no images"):
        idefics3.preprocess_images([], config)
    with pytest.raises(MlxcelError, match="both 0 or both > 0"):
        idefics3.make_image_prompt(2, 0, 4)
    with pytest.raises(ConfigError, match="image_seq_len"):
        idefics3.count_image_tokens(1, 1, 0)
    with pytest.raises(MlxcelError, match="2 image placeholder"):
        idefics3.expand_image_prompts([5, 1, 1], 1, [[7]])
