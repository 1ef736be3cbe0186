"""Pixtral / Mistral 3 vision pieces against transformers (fp32, random weights): the Pixtral tower and
Mistral 3's projector on images of different sizes in one call, the Pillow image processor, and the
[IMG] / [IMG_BREAK] / [IMG_END] layout transformers' PixtralProcessor builds."""

from __future__ import annotations

import importlib
import json
import sys
import types

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from mlxcel.errors import ConfigError
from mlxcel.vision import mistral3_projector, pixtral_vit
from mlxcel.vision.images import VisionInputError, load_image
from mlxcel.vision.processors import pixtral

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pixtral_pil = pytest.importorskip("transformers.models.pixtral.image_processing_pil_pixtral")

TOLERANCE = 1e-4
VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=14, image_size=112
)
TEXT = dict(
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    vocab_size=64,
    rms_norm_eps=1e-5,
)
# (height, width) in pixels. "even": whole 2 x 2 merge windows (what the processor produces);
# "odd": 3 x 5 patches, whose last row and column the merger drops as torch's unfold does.
SIZES = {"even": [(112, 84), (56, 98)], "odd": [(112, 84), (42, 70)], "three": [(28, 112), (112, 56), (84, 84)]}


# ---- Tower and projector ------------------------------------------------------------------------


def randomize(model) -> None:
    """Norm weights of one would hide a swapped or missing tensor."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))


@pytest.fixture(scope="module", params=["silu", "gelu"])
def mistral3(request):
    config = transformers.Mistral3Config(
        vision_config=transformers.PixtralVisionConfig(**VISION, hidden_act=request.param),
        text_config=transformers.MistralConfig(**TEXT),
        spatial_merge_size=2,
    )
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    randomize(model)
    return model


def to_mlx(state_dict: dict, prefix: str) -> dict[str, mx.array]:
    return {k.removeprefix(prefix): mx.array(v.detach().numpy()) for k, v in state_dict.items() if k.startswith(prefix)}


def load(module, weights: dict[str, mx.array]):
    module.load_weights(list(module.sanitize(weights).items()), strict=True)
    mx.eval(module.parameters())
    return module


def make_ours(model):
    config = model.config.to_dict()
    tower = load(
        pixtral_vit.make_pixtral_vision_model(config["vision_config"]),
        to_mlx(model.state_dict(), "model.vision_tower."),
    )
    projector = load(
        mistral3_projector.make_mistral3_projector(config), to_mlx(model.state_dict(), "model.multi_modal_projector.")
    )
    return tower, projector


def padded_pixels(sizes, seed: int = 1) -> np.ndarray:
    """transformers' padded batch: random pixels inside each image, zeros outside."""
    rng = np.random.default_rng(seed)
    batch = np.zeros((len(sizes), 3, max(h for h, _ in sizes), max(w for _, w in sizes)), np.float32)
    for image, (h, w) in zip(batch, sizes):
        image[:, :h, :w] = rng.standard_normal((3, h, w))
    return batch


def max_diff(ours: mx.array, theirs) -> float:
    return float(np.abs(np.array(ours) - theirs.detach().numpy()).max())


@pytest.mark.parametrize("sizes_name", list(SIZES))
def test_tower_and_projector_match_transformers(mistral3, sizes_name):
    sizes = SIZES[sizes_name]
    x = padded_pixels(sizes)
    with torch.no_grad():
        tower_ref = mistral3.model.vision_tower(torch.from_numpy(x), image_sizes=torch.tensor(sizes)).last_hidden_state[
            0
        ]
        pooled = mistral3.model.get_image_features(torch.from_numpy(x), image_sizes=torch.tensor(sizes)).pooler_output
    tower, projector = make_ours(mistral3)
    features = tower(mx.array(x), sizes)
    projected = projector(features, sizes)
    n_patches = sum((h // 14) * (w // 14) for h, w in sizes)
    assert features.shape == tuple(tower_ref.shape) == (n_patches, 32)
    counts = mistral3_projector.count_merged_tokens(sizes, 14, 2)
    assert counts == [p.shape[0] for p in pooled] and projected.shape == (sum(counts), 48)
    tower_diff, projector_diff = max_diff(features, tower_ref), max_diff(projected, torch.cat(pooled))
    act = mistral3.config.vision_config.hidden_act
    print(f"pixtral {act} {sizes_name} {sizes}: tower max abs diff {tower_diff:.2e}, projector {projector_diff:.2e}")
    assert tower_diff <= TOLERANCE and projector_diff <= TOLERANCE


def test_feature_layer_selects_transformers_hidden_state(mistral3):
    sizes = SIZES["even"]
    x = padded_pixels(sizes)
    with torch.no_grad():
        hidden = mistral3.model.vision_tower(
            torch.from_numpy(x), image_sizes=torch.tensor(sizes), output_hidden_states=True
        ).hidden_states
    tower, _ = make_ours(mistral3)
    assert len(hidden) == VISION["num_hidden_layers"] + 1
    for layer in (0, -2, 1, 2, -1):  # 0: after ln_pre
        diff = max_diff(tower(mx.array(x), sizes, feature_layer=layer), hidden[layer][0])
        assert diff <= TOLERANCE, (layer, diff)
    with pytest.raises(ValueError, match="out of range"):
        tower(mx.array(x), sizes, feature_layer=3)


def test_attention_stays_within_each_image(mistral3):
    """Per-image lists (the processor's output) equal the padded batch, and an image's features do not
    depend on what other images share the call."""
    sizes = SIZES["three"]
    x = padded_pixels(sizes)
    tower, _ = make_ours(mistral3)
    together = np.array(tower(mx.array(x), sizes))
    images = [x[i, :, :h, :w] for i, (h, w) in enumerate(sizes)]
    np.testing.assert_allclose(np.array(tower(images)), together, atol=1e-5)
    start = (28 // 14) * (112 // 14)
    alone = np.array(tower([images[1]]))
    np.testing.assert_allclose(alone, together[start : start + len(alone)], atol=1e-5)


def test_saved_checkpoint_names_load_after_the_prefix(tmp_path, mistral3):
    """What Mistral3ForConditionalGeneration.save_pretrained writes in transformers 5.24: `vision_tower.*`
    and `multi_modal_projector.*` (the language model under `language_model.model.*`)."""
    from safetensors.numpy import load_file

    mistral3.save_pretrained(tmp_path)
    saved = {}
    for f in tmp_path.glob("*.safetensors"):
        saved.update(load_file(str(f)))
    prefixes = {k.split(".")[0] for k in saved}
    assert prefixes == {"vision_tower", "multi_modal_projector", "language_model"}
    config = json.loads((tmp_path / "config.json").read_text())
    tower = pixtral_vit.make_pixtral_vision_model(config["vision_config"])
    projector = mistral3_projector.make_mistral3_projector(config)
    load(
        tower, {k.removeprefix("vision_tower."): mx.array(v) for k, v in saved.items() if k.startswith("vision_tower.")}
    )
    load(
        projector,
        {
            k.removeprefix("multi_modal_projector."): mx.array(v)
            for k, v in saved.items()
            if k.startswith("multi_modal_projector.")
        },
    )
    assert tower.args.rope_theta == 10000.0 and projector.args.rms_norm_eps == 1e-5
    # mlx-vlm conversions: a vision_model level and a channels-last conv kernel
    theirs = to_mlx(mistral3.state_dict(), "model.vision_tower.")
    converted = {
        ("vision_model." + k): (v.transpose(0, 2, 3, 1) if k == "patch_conv.weight" else v) for k, v in theirs.items()
    }
    x = mx.array(padded_pixels(SIZES["even"]))
    reference, _ = make_ours(mistral3)
    other = load(pixtral_vit.make_pixtral_vision_model(config["vision_config"]), converted)
    assert np.array_equal(np.array(other(x, SIZES["even"])), np.array(reference(x, SIZES["even"])))


def test_hub_style_configs():
    """Mistral-Small-3.1's config.json: rope_theta at the vision level, head_dim (ignored, recomputed)."""
    hub = {
        "vision_config": {
            "hidden_act": "silu",
            "hidden_size": 1024,
            "head_dim": 64,
            "image_size": 1540,
            "intermediate_size": 4096,
            "model_type": "pixtral",
            "num_attention_heads": 16,
            "num_hidden_layers": 24,
            "patch_size": 14,
            "rope_theta": 10000.0,
        },
        "text_config": {"hidden_size": 5120, "rms_norm_eps": 1e-05},
        "spatial_merge_size": 2,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": False,
        "vision_feature_layer": -1,
    }
    args = pixtral_vit.PixtralVisionArgs.from_config(hub["vision_config"])
    assert (args.head_dim, args.patch_size, args.hidden_act, args.rope_theta) == (64, 14, "silu", 10000.0)
    proj = mistral3_projector.Mistral3ProjectorArgs.from_config(hub)
    assert (proj.vision_hidden_size, proj.text_hidden_size, proj.patch_size, proj.rms_norm_eps) == (
        1024,
        5120,
        14,
        1e-5,
    )
    with pytest.raises(ValueError, match="vision_feature_layer"):
        mistral3_projector.Mistral3ProjectorArgs.from_config({**hub, "vision_feature_layer": [-1, -2]})


# ---- Image processor ----------------------------------------------------------------------------

IMAGE_NAMES = ["photo", "tiny", "wide", "rgba", "gray", "exif_rotated"]
MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
CONFIGS = {
    # mistral-community/pixtral-12b
    "pixtral_12b": {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": MEAN,
        "image_std": STD,
        "image_processor_type": "PixtralImageProcessor",
        "patch_size": {"height": 16, "width": 16},
        "processor_class": "PixtralProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"longest_edge": 1024},
    },
    # mistralai/Mistral-Small-3.1-24B-Instruct-2503 (nulls mean the class defaults)
    "mistral_small_3_1": {
        "crop_size": None,
        "do_center_crop": None,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": MEAN,
        "image_std": STD,
        "image_processor_type": "PixtralImageProcessorFast",
        "patch_size": 14,
        "processor_class": "PixtralProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"longest_edge": 1540},
    },
    # the photo and the wide image shrink; another filter, a box instead of a longest edge
    "small_box": {
        "size": {"height": 200, "width": 150},
        "patch_size": 14,
        "resample": 2,
        "image_processor_type": "PixtralImageProcessor",
    },
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def configured(request, tmp_path_factory):
    """(our config, transformers' Pillow-backend processor loaded from the same preprocessor_config.json)."""
    folder = tmp_path_factory.mktemp(request.param)
    (folder / "preprocessor_config.json").write_text(json.dumps(CONFIGS[request.param]))
    oracle = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")
    assert type(oracle).__name__ == "PixtralImageProcessorPil"
    return pixtral.PixtralImageConfig.load(folder), oracle


def assert_same(ours, oracle_out):
    values, sizes = ours
    np.testing.assert_array_equal(sizes, oracle_out["image_sizes"])
    batch = oracle_out["pixel_values"]
    for image, reference, (h, w) in zip(values, batch, sizes):
        assert image.dtype == np.float32 and image.shape == (3, h, w)
        assert np.abs(image - reference[:, :h, :w]).max() <= 1e-4
    assert pixtral.pad_images(values).shape == batch.shape
    assert np.abs(pixtral.pad_images(values) - batch).max() <= 1e-4  # padding zeros in the same places


@pytest.mark.parametrize("name", IMAGE_NAMES)
def test_each_image_matches_transformers(configured, odd_images, name):
    config, oracle = configured
    image = load_image(odd_images[name])
    assert_same(pixtral.preprocess_images([image], config), oracle([image], return_tensors="np"))


def test_several_images_of_different_sizes_in_one_call(configured, odd_images):
    """Also with the patch size PixtralProcessor passes (patch_size * spatial_merge_size)."""
    config, oracle = configured
    images = [load_image(odd_images[name]) for name in IMAGE_NAMES]
    for patch in (None, 28):
        extra = {} if patch is None else {"patch_size": patch}
        values, sizes = pixtral.preprocess_images(images, config, patch_size=patch)
        assert_same((values, sizes), oracle(images, return_tensors="np", **extra))
        assert len({tuple(s) for s in sizes.tolist()}) > 3
        step = patch or config.patch_size[0]
        assert (sizes % step == 0).all()


def test_photo_is_bit_identical(odd_images):
    """Same order of operations and dtypes as transformers, so equal, not merely close."""
    image = load_image(odd_images["photo"])
    raw = CONFIGS["pixtral_12b"]
    theirs = pixtral_pil.PixtralImageProcessorPil(**raw)([image], return_tensors="np")["pixel_values"][0]
    (ours,), sizes = pixtral.preprocess_images([image], raw)
    assert sizes.tolist() == [[608, 512]]  # 512 x 600 fits 1024: kept, its height rounded up to 16s
    np.testing.assert_array_equal(ours, theirs)


def test_raw_pil_inputs_convert_as_transformers_does(odd_images):
    oracle = pixtral_pil.PixtralImageProcessorPil(**CONFIGS["mistral_small_3_1"])
    photo = Image.open(odd_images["photo"]).convert("RGB").resize((90, 70))
    rgba = photo.convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize(rgba.size))
    images = [rgba, photo.convert("L"), photo.convert("P"), Image.new("RGBA", (60, 60), (0, 0, 0, 0))]
    assert_same(pixtral.preprocess_images(images, CONFIGS["mistral_small_3_1"]), oracle(images, return_tensors="np"))


def test_resize_size_equals_transformers_on_many_sizes():
    import random

    rng = random.Random(0)
    sizes = [(rng.randint(1, 4000), rng.randint(1, 4000)) for _ in range(400)] + [
        (1, 1),
        (3, 5),
        (90, 1200),
        (1540, 1540),
        (1541, 3),
    ]
    for box, patch in [((1024, 1024), (16, 16)), ((1540, 1540), (28, 28)), ((200, 150), (14, 14))]:
        for height, width in sizes:
            expected = pixtral_pil.get_resize_output_image_size(
                np.zeros((3, height, width)), box, patch, input_data_format="channels_first"
            )
            assert pixtral.get_resize_output_image_size(height, width, box, patch) == tuple(expected), (height, width)


def test_refusals_name_the_image():
    raw = CONFIGS["pixtral_12b"]
    strip = Image.new("RGB", (3000, 1))  # shrinks to 1024 x 0
    with pytest.raises(ValueError, match="Size must contain"):  # transformers' message says nothing about the image
        pixtral_pil.PixtralImageProcessorPil(**raw)(strip)
    with pytest.raises(VisionInputError, match=r"image strip\.png: 3000x1 shrinks to 1024x0 to fit 1024x1024"):
        pixtral.preprocess_images([Image.new("RGB", (10, 10)), strip], raw, sources=["ok.png", "strip.png"])
    with pytest.raises(VisionInputError, match="image empty.png: has no pixels"):
        pixtral.preprocess_image(Image.new("RGB", (0, 5)), raw, source="empty.png")
    with pytest.raises(VisionInputError, match=r"image big\.jpg: 600x512 is 0\.3 megapixels"):
        pixtral.preprocess_image(Image.new("RGB", (600, 512)), raw, source="big.jpg", max_input_pixels=200_000)


def test_config_forms_resolve_as_transformers_resolves_them():
    cases = [
        {},
        {"size": 112},
        {"size": {"height": 112, "width": 56}},
        {"size": {"shortest_edge": 20, "longest_edge": 112}},
        {"patch_size": 14},
    ]
    image = Image.new("RGB", (300, 200), (10, 200, 30))
    for raw in cases:
        oracle = pixtral_pil.PixtralImageProcessorPil(**raw)
        assert_same(pixtral.preprocess_images([image], raw), oracle([image], return_tensors="np"))
    crop = {"do_center_crop": True, "crop_size": {"height": 50, "width": 60}}
    assert_same(
        pixtral.preprocess_images([image], crop),
        pixtral_pil.PixtralImageProcessorPil(**crop)([image], return_tensors="np"),
    )


def test_bad_config_values_are_all_reported_with_key_value_and_range():
    raw = {
        "size": {"shortest_edge": 224},
        "patch_size": {"height": 0, "width": 14},
        "image_mean": [0.5, 0.5],
        "image_std": [0.2, 0.0, 0.2],
        "rescale_factor": -1,
        "resample": 7,
        "do_resize": "yes",
        "crop_size": -2,
    }
    with pytest.raises(ConfigError) as info:
        pixtral.PixtralImageConfig.from_dict(raw)
    lines = str(info.value).splitlines()
    expected = [
        "preprocessor_config.do_resize: must be true or false (got 'yes')",
        (
            "preprocessor_config.size: must be {longest_edge}, {height, width} or an int, "
            "with positive int values (got {'shortest_edge': 224})"
        ),
        (
            "preprocessor_config.patch_size: must be a positive int or {height, width} with positive ints "
            "(got {'height': 0, 'width': 14})"
        ),
        (
            "preprocessor_config.crop_size: must be a positive int, [height, width] or {height, width} "
            "with positive ints (got -2)"
        ),
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


# ---- Token layout: transformers' PixtralProcessor itself ------------------------------------------

SPECIAL = ["[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]


@pytest.fixture(scope="module")
def pixtral_processor_class():
    """transformers' real PixtralProcessor. Its module imports the torchvision image processor only for
    a helper the Pillow module has too, so that import is served from the Pillow module while loading;
    both module entries are removed again afterwards."""
    fast_name = "transformers.models.pixtral.image_processing_pixtral"
    name = "transformers.models.pixtral.processing_pixtral"
    stub = None
    if importlib.util.find_spec("torchvision") is None:
        stub = types.ModuleType(fast_name)
        stub.get_resize_output_image_size = pixtral_pil.get_resize_output_image_size
        sys.modules[fast_name] = stub
    try:
        module = importlib.import_module(name)
    finally:
        if stub is not None:
            sys.modules.pop(fast_name, None)
            sys.modules.pop(name, None)
    return module.PixtralProcessor


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "describe": 3, "compare": 4, "these": 5, "and": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    wrapped.add_special_tokens({"additional_special_tokens": SPECIAL})
    return wrapped


@pytest.mark.parametrize(
    "checkpoint, patch, merge",
    [("pixtral_12b", 16, 1), ("mistral_small_3_1", 14, 2), ("small_box", 14, 2)],
)
def test_token_layout_matches_pixtral_processor(pixtral_processor_class, odd_images, checkpoint, patch, merge):
    tokenizer = make_tokenizer()
    image_processor = pixtral_pil.PixtralImageProcessorPil(**CONFIGS[checkpoint])
    processor = pixtral_processor_class(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=patch, spatial_merge_size=merge
    )
    images = [load_image(odd_images[name]) for name in ("photo", "wide", "tiny")]
    text = "[INST] describe [IMG] compare these [IMG] and [IMG] [/INST]"
    theirs = processor(text=text, images=images, return_tensors="np")

    values, sizes = pixtral.preprocess_images(images, CONFIGS[checkpoint], patch_size=patch * merge)
    assert_same((values, sizes), {"pixel_values": theirs["pixel_values"], "image_sizes": theirs["image_sizes"]})
    img, brk, end = tokenizer.convert_tokens_to_ids(["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    layouts = iter([pixtral.expand_image_tokens(int(h), int(w), img, brk, end, patch, merge) for h, w in sizes])
    ours = []
    for token in tokenizer(text)["input_ids"]:
        ours.extend(next(layouts) if token == img else [token])
    assert ours == theirs["input_ids"][0].tolist()
    counts = [pixtral.count_image_tokens(int(h), int(w), patch, merge) for h, w in sizes]
    assert sum(counts) == ours.count(img) and ours.count(end) == 3


def test_token_layout_rows():
    """2 rows of 3: [IMG] x3 [IMG_BREAK] [IMG] x3 [IMG_END]; a single patch is [IMG] [IMG_END]."""
    assert pixtral.expand_image_tokens(56, 84, 10, 12, 13, 14, 2) == [10, 10, 10, 12, 10, 10, 10, 13]
    assert pixtral.expand_image_tokens(16, 16, 10, 12, 13, 16) == [10, 13]
    with pytest.raises(VisionInputError, match="a.png: 40x20 holds no 28x28 patch window"):
        pixtral.expand_image_tokens(20, 40, 10, 12, 13, 14, 2, source="a.png")
