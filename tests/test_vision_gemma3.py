"""Gemma 3's vision stage against transformers (the oracle): the SigLIP tower and the multimodal
projector (fp32, random weights read through our sanitize from what save_pretrained writes), the
Pillow image processor with and without pan-and-scan, and Gemma3Processor's prompt expansion."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from mlxcel.errors import ConfigError, MlxcelError
from mlxcel.vision import gemma3_projector, siglip
from mlxcel.vision.images import VisionInputError, load_image
from mlxcel.vision.processors import gemma3

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.gemma3.image_processing_pil_gemma3 import (  # noqa: E402 -- after importorskip
    Gemma3ImageProcessorPil,
)

TOLERANCE = 1e-4
# 56 / 14 = 4 x 4 patches, pooled 2 x 2 -> mm_tokens_per_image = 4
VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=56, patch_size=14
)
TEXT = dict(
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=24,
    vocab_size=300,
)
# google/gemma-3-4b-it's preprocessor_config.json
GEMMA3_4B = {
    "do_convert_rgb": None,
    "do_normalize": True,
    "do_pan_and_scan": None,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Gemma3ImageProcessor",
    "image_seq_length": 256,
    "image_std": [0.5, 0.5, 0.5],
    "pan_and_scan_max_num_crops": None,
    "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None,
    "processor_class": "Gemma3Processor",
    "resample": 2,
    "rescale_factor": 0.00392156862745098,
    "size": {"height": 896, "width": 896},
}
# Gemma3Processor's defaults for the null pan-and-scan keys, spelled out for transformers' image
# processor (which has no defaults of its own for them)
PAN_AND_SCAN = {
    "do_pan_and_scan": True,
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}
IMAGE_NAMES = ["photo", "tiny", "wide", "rgba", "gray", "exif_rotated"]


def randomize(model) -> None:
    """Norm weights of zero / one and zero biases would hide a swapped or missing tensor."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))


def max_diff(ours: mx.array, theirs) -> float:
    theirs = theirs.detach().numpy() if hasattr(theirs, "detach") else theirs
    return float(np.abs(np.array(ours) - theirs).max())


def pixels(shape, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def make_hf_gemma3(mm_tokens_per_image: int = 4, **vision):
    config = transformers.Gemma3Config(
        text_config=TEXT, vision_config={**VISION, **vision}, mm_tokens_per_image=mm_tokens_per_image
    )
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    randomize(model)
    return model


@pytest.fixture(scope="module")
def hf_gemma3():
    return make_hf_gemma3()


@pytest.fixture(scope="module")
def saved_weights(hf_gemma3, tmp_path_factory) -> dict[str, mx.array]:
    """The tensors exactly as Gemma3ForConditionalGeneration.save_pretrained writes them."""
    folder = tmp_path_factory.mktemp("gemma3_vlm")
    hf_gemma3.save_pretrained(folder)
    return mx.load(str(folder / "model.safetensors"))


def load_stage(config: dict, weights: dict[str, mx.array]):
    """Our tower and projector with `weights` (any layout) loaded strictly through sanitize."""
    tower_weights, projector_weights, rest = gemma3_projector.split_vision_weights(weights)
    assert rest and all("language_model" in k or k.startswith("lm_head") for k in rest)
    tower = siglip.make_siglip_vision_model(config["vision_config"])
    tower.load_weights(list(tower.sanitize(tower_weights).items()), strict=True)
    projector = gemma3_projector.make_gemma3_projector(config, tower.args)
    projector.load_weights(list(projector.sanitize(projector_weights).items()), strict=True)
    mx.eval(tower.parameters(), projector.parameters())
    return tower, projector


def hf_image_features(model, x: np.ndarray):
    with torch.no_grad():
        out = model.model.get_image_features(torch.from_numpy(x), return_dict=True)
    return out.last_hidden_state, out.pooler_output


# ---- tower and projector -----------------------------------------------------------------------


def test_saved_weight_names_are_the_ones_sanitize_expects(saved_weights):
    """transformers 5.24's save_pretrained writes the pre-4.52 layout: `vision_tower.*` (SigLIP
    without a `vision_model.` level), `multi_modal_projector.*`, `language_model.model.*`."""
    prefixes = {k.split(".")[0] for k in saved_weights}
    assert prefixes == {"vision_tower", "multi_modal_projector", "language_model"}
    assert "vision_tower.embeddings.patch_embedding.weight" in saved_weights
    assert {k for k in saved_weights if k.startswith("multi_modal_projector.")} == {
        "multi_modal_projector.mm_input_projection_weight",
        "multi_modal_projector.mm_soft_emb_norm.weight",
    }
    # vision_use_head defaults to true in SiglipVisionConfig: the unused pooling head is saved
    assert any(k.startswith("vision_tower.head.") for k in saved_weights)


def test_tower_and_projector_match_transformers(hf_gemma3, saved_weights):
    x = pixels((2, 3, 56, 56))
    tower, projector = load_stage(hf_gemma3.config.to_dict(), saved_weights)
    theirs_hidden, theirs_features = hf_image_features(hf_gemma3, x)
    hidden = tower(mx.array(x))
    features = projector(hidden)
    assert hidden.shape == (2, 16, 32) == tuple(theirs_hidden.shape)
    assert features.shape == (2, 4, 48) == tuple(theirs_features.shape)
    diffs = max_diff(hidden, theirs_hidden), max_diff(features, theirs_features)
    print(f"siglip last_hidden_state max abs diff {diffs[0]:.2e}; projected features {diffs[1]:.2e}")
    assert max(diffs) <= TOLERANCE


LAYOUTS = {
    # transformers 4.52+ / 5 in memory
    "in-memory": lambda k: "model." + k if not k.startswith("language_model") else k,
    # the Hub's google/gemma-3-*-it files (transformers 4's SiglipVisionModel level)
    "hub-vision_model": lambda k: k.replace("vision_tower.", "vision_tower.vision_model.", 1),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_other_weight_layouts_load_the_same(hf_gemma3, saved_weights, layout):
    x = mx.array(pixels((1, 3, 56, 56)))
    reference_tower, reference_projector = load_stage(hf_gemma3.config.to_dict(), saved_weights)
    renamed = {LAYOUTS[layout](k): v for k, v in saved_weights.items()}
    assert renamed.keys() != saved_weights.keys()
    tower, projector = load_stage(hf_gemma3.config.to_dict(), renamed)
    assert np.array_equal(np.array(projector(tower(x))), np.array(reference_projector(reference_tower(x))))


def test_mlx_layout_patch_embedding_is_not_transposed_again(hf_gemma3, saved_weights):
    """MLX conversions store the conv as [out, kh, kw, C] already."""
    x = mx.array(pixels((1, 3, 56, 56)))
    reference, _ = load_stage(hf_gemma3.config.to_dict(), saved_weights)
    key = "vision_tower.embeddings.patch_embedding.weight"
    converted = {**saved_weights, key: saved_weights[key].transpose(0, 2, 3, 1)}
    tower, _ = load_stage(hf_gemma3.config.to_dict(), converted)
    assert np.array_equal(np.array(tower(x)), np.array(reference(x)))


@pytest.mark.parametrize(
    "vision, mm_tokens, expected",
    [
        ({}, 16, 16),  # kernel 1: no pooling
        ({}, 1, 1),  # kernel 4: one token per image
        ({"image_size": 70}, 4, 4),  # 5 x 5 patches, kernel 2: the last row/column dropped (floor mode)
        ({"image_size": 84}, 4, 4),  # 6 x 6 patches, kernel 3
    ],
    ids=["kernel1", "kernel4", "floor-mode", "kernel3"],
)
def test_projector_pooling_matches_transformers(vision, mm_tokens, expected):
    model = make_hf_gemma3(mm_tokens, **vision)
    config = model.config.to_dict()
    weights = {k: mx.array(v.numpy()) for k, v in model.model.multi_modal_projector.state_dict().items()}
    projector = gemma3_projector.make_gemma3_projector(config)
    projector.load_weights(list(projector.sanitize(weights).items()), strict=True)
    side = config["vision_config"]["image_size"] // 14
    x = pixels((2, side * side, 32), seed=2)
    with torch.no_grad():
        theirs = model.model.multi_modal_projector(torch.from_numpy(x))
    ours = projector(mx.array(x))
    assert ours.shape == (2, expected, 48) == tuple(theirs.shape)
    assert projector.tokens_per_image == expected
    diff = max_diff(ours, theirs)
    print(f"projector {side}x{side} patches -> {expected} tokens: max abs diff {diff:.2e}")
    assert diff <= TOLERANCE


def test_projector_keeps_bfloat16(hf_gemma3, saved_weights):
    tower, projector = load_stage(hf_gemma3.config.to_dict(), saved_weights)
    features = projector(tower(mx.array(pixels((1, 3, 56, 56)))).astype(mx.bfloat16))
    assert features.dtype == mx.bfloat16


def test_patch_mask_matches_transformers_encoder(hf_gemma3, saved_weights):
    """Idefics3 / SmolVLM's use: padded patches masked out as keys (a 2D mask through
    create_bidirectional_mask), fed to the same SigLIP encoder."""
    tower, _ = load_stage(hf_gemma3.config.to_dict(), saved_weights)
    embeddings = pixels((2, 16, 32), seed=3)
    keep = np.ones((2, 16), dtype=bool)
    keep[0, 10:] = False  # image 0: the last 6 patches are padding
    keep[1, [0, 5, 15]] = False
    additive = np.where(keep, 0.0, np.finfo(np.float32).min).astype(np.float32)[:, None, None, :]
    with torch.no_grad():
        encoder = hf_gemma3.model.vision_tower.encoder
        theirs = encoder(
            inputs_embeds=torch.from_numpy(embeddings), attention_mask=torch.from_numpy(additive)
        ).last_hidden_state
        theirs = hf_gemma3.model.vision_tower.post_layernorm(theirs)
    ours = tower.encode(mx.array(embeddings), mx.array(keep))
    diff = max_diff(ours, theirs)
    print(f"siglip encoder with a patch mask: max abs diff {diff:.2e}")
    assert diff <= TOLERANCE
    unmasked = tower.encode(mx.array(embeddings))
    assert max_diff(unmasked, theirs) > 1e-2  # the mask does something


def test_tower_config_defaults_and_errors():
    args = siglip.SiglipVisionArgs.from_config(
        {"image_size": 896, "patch_size": 14, "vision_use_head": False, "hidden_act": None}
    )
    assert (args.hidden_size, args.layer_norm_eps, args.hidden_act, args.num_patches) == (
        768,
        1e-6,
        "gelu_pytorch_tanh",
        4096,
    )
    with pytest.raises(ConfigError) as error:
        siglip.SiglipVisionArgs.from_config(
            {"hidden_size": 30, "num_attention_heads": 4, "patch_size": [14, 14], "hidden_act": "swish"}
        )
    message = str(error.value)
    for expected in ("vision_config.patch_size: must be a positive int", "vision_config.hidden_act", "'swish'"):
        assert expected in message
    with pytest.raises(ConfigError, match=r"vision_config.num_attention_heads: must divide hidden_size 30 \(got 4\)"):
        siglip.SiglipVisionArgs.from_config({"hidden_size": 30, "num_attention_heads": 4})
    tower = siglip.make_siglip_vision_model(VISION)
    with pytest.raises(ValueError, match="3x56x56 images, got 3x42x42"):
        tower(mx.zeros((1, 3, 42, 42)))


def test_projector_config_errors():
    with pytest.raises(ConfigError, match=r"mm_tokens_per_image: must be a square .* one of \[1, 4, 16\] \(got 5\)"):
        gemma3_projector.make_gemma3_projector({"vision_config": VISION, "text_config": TEXT, "mm_tokens_per_image": 5})
    with pytest.raises(ConfigError, match=r"mm_tokens_per_image.*\(got 64\)"):
        gemma3_projector.make_gemma3_projector({"vision_config": VISION, "mm_tokens_per_image": 64})
    assert (
        gemma3_projector.count_pooled_tokens(896, 14, 256) == 256
    )  # the released checkpoints: 64x64 patches, kernel 4


# ---- image processor ---------------------------------------------------------------------------


def load_images(paths: dict, names=IMAGE_NAMES) -> list[Image.Image]:
    return [load_image(paths[name]) for name in names]


def elongated(photo_path, sizes) -> list[Image.Image]:
    photo = load_image(photo_path)
    return [photo.resize(size) for size in sizes]


def assert_matches_transformers(images: list[Image.Image], raw: dict) -> gemma3.Gemma3Pixels:
    ours = gemma3.preprocess_images(images, gemma3.Gemma3ImageConfig.from_dict(raw))
    theirs = Gemma3ImageProcessorPil.from_dict(raw)(images, return_tensors="np")
    assert ours.pixel_values.dtype == np.float32
    assert ours.pixel_values.shape == theirs["pixel_values"].shape
    assert ours.num_crops == list(theirs["num_crops"])
    diff = float(np.max(np.abs(ours.pixel_values - theirs["pixel_values"].astype(np.float32))))
    print(f"{len(images)} image(s) -> {ours.pixel_values.shape}, crops {ours.num_crops}: max abs diff {diff:.2e}")
    assert diff <= 1e-4
    return ours


def test_released_config_matches_transformers_on_all_odd_images(odd_images):
    ours = assert_matches_transformers(load_images(odd_images), GEMMA3_4B)
    assert ours.pixel_values.shape == (6, 3, 896, 896) and ours.num_crops == [0] * 6


def test_pan_and_scan_with_released_settings_matches_transformers(odd_images, photo_path):
    """1200x300 -> 4 crops of 300x300, 300x900 -> 3, 600x500 (ratio exactly 1.2) -> 2; the photo
    (600 tall, 512 wide: ratio 1.17) and wide (90 px tall, crops under 256) get none."""
    images = elongated(photo_path, [(1200, 300), (300, 900), (600, 500)]) + load_images(odd_images, ["photo", "wide"])
    ours = assert_matches_transformers(images, {**GEMMA3_4B, **PAN_AND_SCAN})
    assert ours.num_crops == [4, 3, 2, 0, 0]
    assert ours.pixel_values.shape == (14, 3, 896, 896)


SMALL = {**GEMMA3_4B, "size": {"height": 112, "width": 112}}
PAN_AND_SCAN_VARIANTS = {
    "small-crops": {"pan_and_scan_min_crop_size": 32},  # wide: 4 crops of 300x90; gray 150x100: 2
    "max-two": {"pan_and_scan_min_crop_size": 32, "pan_and_scan_max_num_crops": 2},
    "max-one": {"pan_and_scan_min_crop_size": 32, "pan_and_scan_max_num_crops": 1},
    "ratio-1": {"pan_and_scan_min_crop_size": 40, "pan_and_scan_min_ratio_to_activate": 1.0},  # square-ish too
    "ratio-3": {"pan_and_scan_min_crop_size": 32, "pan_and_scan_min_ratio_to_activate": 3},
    "tiny-crops": {"pan_and_scan_min_crop_size": 2},  # the 3x5 image: 2 crops of 3x3 and 3x2
}


@pytest.mark.parametrize("name", PAN_AND_SCAN_VARIANTS)
def test_pan_and_scan_variants_match_transformers(odd_images, photo_path, name):
    images = load_images(odd_images) + elongated(photo_path, [(301, 97), (97, 401)])
    raw = {**SMALL, **PAN_AND_SCAN, **PAN_AND_SCAN_VARIANTS[name]}
    ours = assert_matches_transformers(images, raw)
    assert sum(ours.num_crops) > 0


PROCESSOR_VARIANTS = {
    "int-size": {"size": 64},
    "list-size": {"size": [48, 80]},
    "bicubic": {"resample": 3},
    "nearest-no-rescale": {"resample": 0, "do_rescale": False},
    "no-normalize": {"do_normalize": False},
    "clip-mean-std": {
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    },
    "scalar-mean-std": {"image_mean": 0.4, "image_std": 0.3},
}


@pytest.mark.parametrize("name", PROCESSOR_VARIANTS)
def test_config_variants_match_transformers(odd_images, name):
    assert_matches_transformers(
        load_images(odd_images, ["photo", "wide", "tiny", "rgba"]), {**SMALL, **PROCESSOR_VARIANTS[name]}
    )


def test_unconverted_pil_modes_match_transformers(odd_images):
    """Images not read by load_image: alpha composites onto white, grayscale expands to RGB. The Hub
    file's `do_convert_rgb: null` leaves transformers' image processor alone not converting;
    Gemma3Processor passes true, and null means true here."""
    images = [Image.open(odd_images["rgba"]), Image.open(odd_images["gray"])]
    assert_matches_transformers(
        images, {**SMALL, **PAN_AND_SCAN, "pan_and_scan_min_crop_size": 32, "do_convert_rgb": True}
    )
    assert gemma3.Gemma3ImageConfig.from_dict(SMALL).do_convert_rgb


def test_config_parsing_defaults_and_errors():
    config = gemma3.Gemma3ImageConfig.from_dict(GEMMA3_4B)
    assert config.size == (896, 896) and config.resample == 2 and config.image_seq_length == 256
    assert (
        config.do_pan_and_scan,
        config.pan_and_scan_min_crop_size,
        config.pan_and_scan_max_num_crops,
        config.pan_and_scan_min_ratio_to_activate,
    ) == (False, 256, 4, 1.2)
    assert gemma3.Gemma3ImageConfig.from_dict({}) == gemma3.Gemma3ImageConfig()
    bad = {
        "size": {"shortest_edge": 896},
        "resample": 9,
        "do_pan_and_scan": "yes",
        "pan_and_scan_min_crop_size": 0,
        "pan_and_scan_max_num_crops": 2.5,
        "pan_and_scan_min_ratio_to_activate": float("nan"),
        "image_std": [0.5, 0, 0.5],
        "rescale_factor": -1,
        "image_seq_length": "256",
    }
    with pytest.raises(ConfigError) as error:
        gemma3.Gemma3ImageConfig.from_dict(bad)
    message = str(error.value)
    for key, value in bad.items():
        assert f"preprocessor_config.{key}: " in message and repr(value) in message, key
    assert "fix the checkpoint's preprocessor_config.json" in message


def test_empty_pan_and_scan_crops_match_transformers():
    """9x2 in 4 crops of ceil(9 / 4) = 3 columns: the last starts at column 9 and is empty; 5x1:
    crops of 2 from columns 0, 2, 4 (1 wide), 6 (empty). transformers resizes empty crops to black; so do we."""
    images = [Image.new("RGB", (9, 2), (200, 100, 50)), Image.new("RGB", (5, 1), (10, 250, 90))]
    ours = assert_matches_transformers(images, {**SMALL, **PAN_AND_SCAN, "pan_and_scan_min_crop_size": 1})
    assert ours.num_crops == [4, 4]
    assert (
        (ours.pixel_values[4] == -1).all() and (ours.pixel_values[9] == -1).all() and (ours.pixel_values[8] != -1).any()
    )


def test_preprocess_errors(odd_images):
    no_resize = gemma3.Gemma3ImageConfig.from_dict({**SMALL, "do_resize": False})
    with pytest.raises(VisionInputError, match="different shapes"):
        gemma3.preprocess_images(load_images(odd_images, ["photo", "wide"]), no_resize)
    with pytest.raises(VisionInputError, match="no images"):
        gemma3.preprocess_images([], no_resize)


# ---- prompt expansion (Gemma3Processor) --------------------------------------------------------


SPECIALS = ["<pad>", "<eos>", "<bos>", gemma3.BOI_TOKEN, gemma3.EOI_TOKEN, gemma3.IMAGE_TOKEN]


@pytest.fixture(scope="module")
def hf_tokenizer():
    """A byte-level BPE with Gemma's image tokens as the tokenizer's boi/eoi/image tokens, trained
    so runs of newlines merge (as Gemma's "\\n\\n\\n" token does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(
        ["user\n\n\nDescribe this image.\n\nHere is the original image and here are some crops"] * 8, trainer
    )
    special = {"boi_token": gemma3.BOI_TOKEN, "eoi_token": gemma3.EOI_TOKEN, "image_token": gemma3.IMAGE_TOKEN}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", bos_token="<bos>", extra_special_tokens=special
    )


def image_tokens_of(tokenizer) -> gemma3.Gemma3ImageTokens:
    return gemma3.Gemma3ImageTokens(
        boi_id=tokenizer.boi_token_id, image_id=tokenizer.image_token_id, eoi_id=tokenizer.eoi_token_id
    )


@pytest.mark.parametrize("pan_and_scan", [False, True], ids=["plain", "pan-and-scan"])
def test_prompt_ids_match_gemma3_processor(hf_tokenizer, photo_path, pan_and_scan):
    images = elongated(photo_path, [(1200, 300), (300, 300)])
    text = (
        "<bos><start_of_turn>user\n<start_of_image>Describe this image.<start_of_image>\n\nAnd this one.<end_of_turn>\n"
    )
    image_processor = Gemma3ImageProcessorPil.from_dict(GEMMA3_4B)
    processor = transformers.Gemma3Processor(
        image_processor=image_processor, tokenizer=hf_tokenizer, image_seq_length=256
    )
    kwargs = PAN_AND_SCAN if pan_and_scan else {}
    theirs = processor(text=[text], images=[images], return_tensors="np", **kwargs)
    expected_crops = [4, 0] if pan_and_scan else [0, 0]

    config = gemma3.Gemma3ImageConfig.from_dict({**GEMMA3_4B, **kwargs})
    pixels_ = gemma3.preprocess_images(images, config)
    assert pixels_.num_crops == expected_crops
    assert np.abs(pixels_.pixel_values - theirs["pixel_values"]).max() <= 1e-4

    tokens = image_tokens_of(hf_tokenizer)

    def encode(s):  # as the processor calls it
        return hf_tokenizer(s)["input_ids"]

    ours = gemma3.expand_prompt_ids(text, pixels_.num_crops, 256, encode, tokens)
    assert ours == theirs["input_ids"][0].tolist()
    assert gemma3.image_token_type_ids(ours, tokens.image_id) == theirs["token_type_ids"][0].tolist()
    assert gemma3.count_image_tokens(pixels_.num_crops, 256) == sum(gemma3.image_token_type_ids(ours, tokens.image_id))
    assert gemma3.count_image_tokens(pixels_.num_crops, 256) == (6 if pan_and_scan else 2) * 256
    # each image (and crop) is the untouchable core boi + 256 soft tokens + eoi
    layout = gemma3.image_token_layout(256, tokens)
    starts = [i for i, t in enumerate(ours) if t == tokens.boi_id]
    assert len(starts) == sum(1 + c for c in expected_crops)
    assert all(ours[i : i + len(layout)] == layout for i in starts)
    # why ids come from tokenizing the expanded text: the "\n\n" merges with the template's "\n"
    assert encode("user\n\n\n") != encode("user\n") + encode("\n\n")


def test_expansion_text_and_errors():
    tokens = gemma3.Gemma3ImageTokens()
    one = "\n\n<start_of_image>" + "<image_soft_token>" * 3 + "<end_of_image>\n\n"
    assert gemma3.image_sequence_text(3) == one
    assert gemma3.expand_prompt_text("a<start_of_image>b", [0], 3) == f"a{one}b"
    assert gemma3.expand_prompt_text("<start_of_image>", [2], 3) == (
        f"Here is the original image {one} and here are some crops to help you see better {one} {one}"
    )
    assert gemma3.image_token_layout(2, tokens) == [255_999, 262_144, 262_144, 256_000]
    with pytest.raises(MlxcelError, match="2 <start_of_image> placeholder"):
        gemma3.expand_prompt_text("<start_of_image><start_of_image>", [0], 3)
    with pytest.raises(MlxcelError, match="0 <image_soft_token> tokens for 3 image features"):
        gemma3.expand_prompt_ids("<start_of_image>", [0], 3, lambda s: [1, 2, 3])
