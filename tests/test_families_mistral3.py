"""Mistral 3 (mistral3) against transformers' Mistral3ForConditionalGeneration (fp32, tiny random
checkpoints written by save_pretrained, with a byte-level tokenizer holding [IMG] / [IMG_BREAK] /
[IMG_END] and a Mistral-style chat template): a two-image prompt of a real photo (ids as
transformers' PixtralProcessor lays them out, logits, greedy tokens), text prompts through the
loader and the engine, the checkpoint layouts, the files images need, and mlxcel-run end to end."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import types
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.errors import MlxcelError
from mlxcel.models import mistral3
from mlxcel.vision.images import load_image
from mlxcel.vision.stage import is_vision_model, merge_embeddings
from tests.family_fixtures import (
    LOGIT_TOLERANCE,
    mlxcel_generate,
    reference_greedy,
    reference_logits,
    save_widened,
)
from tests.helpers import SPECIALS, read_rows, run_cli, write_tiny_tokenizer
from tests.vision_fixtures import assert_batch_rows_equal_their_runs_alone, build_once, mlxcel_greedy_after

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.pixtral import image_processing_pil_pixtral as pixtral_pil  # noqa: E402 -- after importorskip

GREEDY = 24
MAX_TOKENS = 8
LAYOUT = ["[IMG]", "[IMG_BREAK]", "[IMG_END]", "[INST]", "[/INST]"]
IMG, BREAK, END = 3, 4, 5  # their ids: after the three ChatML specials
VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "patch_size": 14,
    "image_size": 168,
    "hidden_act": "silu",
}
TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "eos_token_id": 2,
    "bos_token_id": None,
    "pad_token_id": 0,
}
MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
PREPROCESSOR = {  # Mistral-Small-3.1's, with a smaller longest edge
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": MEAN,
    "image_std": STD,
    "image_processor_type": "PixtralImageProcessor",
    "patch_size": 14,
    "processor_class": "PixtralProcessor",
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"longest_edge": 168},
}
PROCESSOR = {
    "image_break_token": "[IMG_BREAK]",
    "image_end_token": "[IMG_END]",
    "image_token": "[IMG]",
    "patch_size": 14,
    "processor_class": "PixtralProcessor",
    "spatial_merge_size": 2,
}
# Mistral's format, cut down: [INST]...[/INST]; an image part renders as [IMG] where it stands
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}[INST]{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}[IMG]{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %}[/INST]{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
)
CASES = {
    "mistral": {
        "text": "mistral",
        "text_overrides": {"sliding_window": 64},
        "tie_word_embeddings": False,
    },  # window < the image prompt
    "llama-tied": {"text": "llama", "text_overrides": {}},  # Mistral3Config's default: tied, no head saved
}


def write_tokenizer(folder: Path) -> int:
    size = write_tiny_tokenizer(folder, [*SPECIALS, *LAYOUT], TEMPLATE, vocab_size=330)
    assert transformers.AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(LAYOUT[:3]) == [IMG, BREAK, END]
    return size


def make_checkpoint(folder: Path, text: str, text_overrides: dict, **config):
    text_config = {**TEXT, "model_type": text, "vocab_size": write_tokenizer(folder), **text_overrides}
    config = transformers.Mistral3Config(
        vision_config=VISION, text_config=text_config, image_token_index=IMG, spatial_merge_size=2, **config
    )
    torch.manual_seed(0)
    model = transformers.Mistral3ForConditionalGeneration(config)
    save_widened(model, folder)  # std 0.2 matrices, perturbed norms; eval mode
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    (folder / "processor_config.json").write_text(json.dumps(PROCESSOR))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """case name -> (folder, transformers model), each built once."""
    return build_once(tmp_path_factory, lambda folder, name: make_checkpoint(folder, **CASES[name]))


@pytest.fixture(scope="module")
def images(photo_path):
    """The photo (600x512: 168x168 after the resize, 6x6 tokens) and a wide strip of it (168x56: 2 rows of 6)."""
    photo = load_image(photo_path)
    return [photo, photo.crop((0, 100, 512, 250))]


def pixtral_processor_class():
    """transformers' real PixtralProcessor. Its module imports the torchvision image processor only for
    a helper the Pillow module has too, so that import is served from the Pillow module while loading."""
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


def transformers_inputs(folder: Path, text: str, images) -> dict:
    """input_ids, pixel_values, image_sizes as PixtralProcessor (patch 14, merge 2) makes them."""
    processor = pixtral_processor_class()(
        image_processor=pixtral_pil.PixtralImageProcessorPil(**PREPROCESSOR),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        patch_size=14,
        spatial_merge_size=2,
    )
    return dict(processor(text=text, images=images or None, return_tensors="pt"))


def tokenize(folder: Path, text: str) -> list[int]:
    return transformers.AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"]


def mlxcel_image_prefill(model, ids: list[int], images) -> tuple[list[int], np.ndarray, list]:
    """Expanded ids, logits over them and the cache: embed -> merge(encode(preprocess)) -> forward."""
    sources = [f"image{i}" for i in range(len(images))]
    inputs = model.preprocess_images(images, sources)
    expanded = model.expand_image_tokens(ids, inputs, sources)
    assert expanded.count(IMG) == sum(inputs.token_counts)
    embeddings = merge_embeddings(model.embed_tokens(mx.array([expanded])), expanded, IMG, model.encode_images(inputs))
    cache = model.make_cache()
    return expanded, np.array(model.forward_with_embeddings(embeddings, cache)[0]), cache


TWO_IMAGES = "[INST]Compare [IMG] with [IMG] today, how are you?[/INST]"


@pytest.mark.parametrize("name", list(CASES))
def test_two_image_prompt_matches_transformers(checkpoint, images, name):
    folder, reference = checkpoint(name)
    model = load_model(str(folder), dtype="float32").model
    assert is_vision_model(model) and model.image_token_id == IMG
    assert (
        model.args.tie_word_embeddings == (name == "llama-tied")
        and ("lm_head" in model) != model.args.tie_word_embeddings
    )
    expanded, got, cache = mlxcel_image_prefill(model, tokenize(folder, TWO_IMAGES), images)

    theirs = transformers_inputs(folder, TWO_IMAGES, images)
    assert expanded == theirs["input_ids"][0].tolist()
    assert expanded.count(IMG) == 36 + 12 and expanded.count(BREAK) == 5 + 1 and expanded.count(END) == 2

    pixels = {"pixel_values": theirs["pixel_values"], "image_sizes": theirs["image_sizes"]}
    with torch.no_grad():
        want = reference(input_ids=torch.tensor([expanded]), **pixels).logits[0].numpy()
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= LOGIT_TOLERANCE, np.abs(got - want).max()

    greedy = mlxcel_greedy_after(model, got, cache, GREEDY)
    with torch.no_grad():
        out = reference.generate(
            input_ids=torch.tensor([expanded]),
            **pixels,
            max_new_tokens=GREEDY,
            min_new_tokens=GREEDY,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert greedy == out[0, len(expanded) :].tolist()
    assert len(set(greedy)) >= 3  # a varied continuation, not one repeated token


@pytest.mark.parametrize("name", list(CASES))
def test_text_prompt_through_loader_and_engine_matches_transformers(checkpoint, name):
    folder, reference = checkpoint(name)
    model = load_model(str(folder), dtype="float32").model
    ids = tokenize(folder, "[INST]The capital of France is Paris. The capital of Italy is[/INST]")
    got = np.array(model(mx.array([ids]), model.make_cache())[0])
    assert np.abs(got - reference_logits(reference, ids)).max() <= LOGIT_TOLERANCE
    assert mlxcel_generate(model, [ids], GREEDY)[0] == reference_greedy(reference, ids, GREEDY)


def rename_to_hub(key: str) -> str:
    """transformers 5's saved names -> the Hub files' (language_model.model.*, language_model.lm_head.*)."""
    for ours, hub in (
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ):
        if key.startswith(ours):
            return hub + key[len(ours) :]
    return key


@pytest.mark.parametrize("layout", ["hub", "in_memory", "mlx_vlm"])
def test_checkpoint_layouts_give_the_same_logits(checkpoint, images, tmp_path, layout):
    from safetensors.numpy import save_file

    folder, reference = checkpoint("mistral")
    weights = {k: v.detach().numpy().copy() for k, v in reference.state_dict().items()}  # in-memory names
    assert "model.language_model.norm.weight" in weights and "lm_head.weight" in weights
    if layout != "in_memory":
        weights = {rename_to_hub(k): v for k, v in weights.items()}
    if layout == "mlx_vlm":  # a vision_model level, channels-last conv kernel
        weights = {
            (k.replace("vision_tower.", "vision_tower.vision_model.", 1) if k.startswith("vision_tower.") else k): v
            for k, v in weights.items()
        }
        conv = "vision_tower.vision_model.patch_conv.weight"
        weights[conv] = weights[conv].transpose(0, 2, 3, 1).copy()
    for file in (
        "config.json",
        "preprocessor_config.json",
        "processor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        shutil.copy(folder / file, tmp_path / file)
    save_file(weights, str(tmp_path / "model.safetensors"))
    ids = tokenize(folder, TWO_IMAGES)
    _, base, _ = mlxcel_image_prefill(load_model(str(folder), dtype="float32").model, ids, images)
    _, got, _ = mlxcel_image_prefill(load_model(str(tmp_path), dtype="float32").model, ids, images)
    np.testing.assert_array_equal(got, base)


def test_images_need_the_processor_and_tokenizer_files(checkpoint, images, tmp_path):
    folder, _ = checkpoint("mistral")
    for file in ("config.json", "model.safetensors"):
        shutil.copy(folder / file, tmp_path / file)
    model = load_model(str(tmp_path), dtype="float32").model  # text prompts need none of them
    model(mx.array([[7, 8, 9]]), model.make_cache())
    with pytest.raises(MlxcelError, match="no preprocessor_config.json"):
        model.preprocess_images(images, ["photo", "strip"])
    shutil.copy(folder / "preprocessor_config.json", tmp_path / "preprocessor_config.json")
    model.attach_preprocessor(tmp_path)
    with pytest.raises(MlxcelError, match="no tokenizer.json or tokenizer_config.json"):
        model.preprocess_images(images, ["photo", "strip"])
    (tmp_path / "processor_config.json").write_text(json.dumps({**PROCESSOR, "spatial_merge_size": 1}))
    shutil.copy(folder / "tokenizer.json", tmp_path / "tokenizer.json")
    model.attach_preprocessor(tmp_path)
    with pytest.raises(MlxcelError, match="14 \\* 1 = 14 px, but each image token covers 28 px"):
        model.preprocess_images(images, ["photo", "strip"])
    (tmp_path / "processor_config.json").write_text(json.dumps({**PROCESSOR, "image_end_token": "[END_OF_IMAGE]"}))
    model.attach_preprocessor(tmp_path)
    with pytest.raises(MlxcelError, match="do not name \\[END_OF_IMAGE\\]"):
        model.preprocess_images(images, ["photo", "strip"])
    shutil.copy(folder / "processor_config.json", tmp_path / "processor_config.json")
    model.attach_preprocessor(tmp_path)
    inputs = model.preprocess_images(images, ["photo", "strip"])
    assert inputs.token_counts == [36, 12] and inputs.extras["image_sizes"].tolist() == [[168, 168], [56, 168]]
    with pytest.raises(MlxcelError, match="1 image placeholder\\(s\\) for 2 image\\(s\\)"):
        model.expand_image_tokens([7, IMG, 8], inputs, ["photo", "strip"])


# Mistral-Small-3.1-24B-Instruct-2503's config.json (the head is not tied: the Hub files carry one).
MISTRAL_SMALL_3_1 = {
    "architectures": ["Mistral3ForConditionalGeneration"],
    "image_token_index": 10,
    "model_type": "mistral3",
    "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu",
    "spatial_merge_size": 2,
    "text_config": {
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "intermediate_size": 32768,
        "max_position_embeddings": 131072,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 40,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000000.0,
        "sliding_window": None,
        "vocab_size": 131072,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {
        "attention_dropout": 0.0,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "image_size": 1540,
        "intermediate_size": 4096,
        "model_type": "pixtral",
        "num_attention_heads": 16,
        "num_channels": 3,
        "num_hidden_layers": 24,
        "patch_size": 14,
        "rope_theta": 10000.0,
    },
    "vision_feature_layer": -1,
}


def test_hub_config_reads_as_transformers_reads_it():
    ours = mistral3.ModelArgs.from_config(MISTRAL_SMALL_3_1)
    theirs = transformers.Mistral3Config.from_dict(MISTRAL_SMALL_3_1)
    text = theirs.text_config
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
    ):
        assert getattr(ours.text, key) == getattr(text, key), key
    assert ours.text.rope_theta == text.rope_parameters["rope_theta"] and ours.text.sliding_window is None
    assert ours.image_token_id == theirs.image_token_id == 10 and ours.vision_feature_layer == -1
    assert (ours.projector.text_hidden_size, ours.projector.rms_norm_eps, ours.spatial_merge_size) == (5120, 1e-5, 2)
    assert ours.vision_config["patch_size"] == theirs.vision_config.patch_size == 14


# ---- end to end through mlxcel-run ----------------------------------------------------------------


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_prompt_images_generate_as_transformers(tmp_path, checkpoint, photo_path):
    folder, reference = checkpoint("mistral")
    result = run_cli(
        tmp_path,
        "model=mistral3",
        f"model.path={folder}",
        "model.max_context=512",
        f"decode.max_tokens={MAX_TOKENS}",
        "decode.ignore_eos=true",
        "prompt.text=Describe it.",
        f"prompt.images=[{photo_path}]",
    )
    assert result.returncode == 0, result.stderr
    row = read_rows(tmp_path / "run")[0]
    assert row["prompt"] == "[INST][IMG]Describe it.[/INST]"
    ids = row["prompt_token_ids"]
    theirs = transformers_inputs(folder, row["prompt"], [load_image(photo_path)])
    assert ids == theirs["input_ids"][0].tolist()
    assert ids.count(IMG) == 36 and ids.count(BREAK) == 5 and ids.count(END) == 1

    with torch.no_grad():
        out = reference.generate(
            torch.tensor([ids]),
            pixel_values=theirs["pixel_values"],
            image_sizes=theirs["image_sizes"],
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert row["token_ids"] == out[0, len(ids) :].tolist()
    assert len(set(row["token_ids"])) >= 2
    stats = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert stats["visual_tokens"] == 36 and stats["prompt_tokens"] == len(ids)
    assert stats["image_preprocess_ms"] > 0 and stats["vision_encode_ms"] > 0


def test_mixed_batch_rows_equal_their_runs_alone(tmp_path, checkpoint, photo_path, odd_images):
    """An image row, a text row, a two-image conversation and a missing image in one batch: the
    bad row fails alone, every good row gives its tokens alone."""
    folder, _ = checkpoint("mistral")
    rows = [
        {"id": "photo", "prompt": "Describe it.", "images": [str(photo_path)]},
        {"id": "text", "prompt": "Hello there"},
        {
            "id": "two",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "path": str(odd_images["gray"])},
                        {"type": "text", "text": "and"},
                        {"type": "image", "path": str(photo_path)},
                    ],
                }
            ],
        },
        {"id": "missing", "prompt": "Describe it.", "images": [str(tmp_path / "nope.png")]},
    ]
    args = (
        "model=mistral3",
        f"model.path={folder}",
        "model.max_context=512",
        f"decode.max_tokens={MAX_TOKENS}",
        "decode.ignore_eos=true",
    )
    got = assert_batch_rows_equal_their_runs_alone(tmp_path, args, rows, {"missing": "nope.png: no such file"})
    assert got[("two", 0)]["prompt_token_ids"].count(IMG) > 36  # both images expanded
