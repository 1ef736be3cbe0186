"""LLaVA-1.5 (llava) and LLaVA-NeXT (llava_next) against transformers' LlavaForConditionalGeneration
and LlavaNextForConditionalGeneration (fp32, tiny random checkpoints written by save_pretrained):
a two-image prompt of a real photo (placeholder counts as the processors expand them, logits,
greedy tokens), text prompts through the loader and the engine, and every checkpoint layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.errors import MlxcelError
from mlxcel.models import llava
from mlxcel.vision.images import load_image
from mlxcel.vision.stage import expand_placeholders, is_vision_model, merge_embeddings
from tests.family_fixtures import (
    LOGIT_TOLERANCE,
    PROMPT,
    mlxcel_generate,
    reference_greedy,
    reference_logits,
    save_widened,
)
from tests.helpers import write_tiny_tokenizer
from tests.llava_fixtures import CLIP_PROCESSOR, IMAGE, NEXT_PROCESSOR, PINPOINTS, TEXT, VISION, image_runs
from tests.vision_fixtures import build_once, mlxcel_greedy_after

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # noqa: E402 -- after importorskip
from transformers.models.llava_next.image_processing_pil_llava_next import (  # noqa: E402 -- after importorskip
    LlavaNextImageProcessorPil,
)

GREEDY = 24
CASES = {
    "llava": {"kind": "llava", "text": "llama"},
    "llava-full": {
        "kind": "llava",
        "text": "llama",
        "vision_feature_layer": [-3, -1],
        "vision_feature_select_strategy": "full",
    },
    "llava-qwen2": {
        "kind": "llava",
        "text": "qwen2",
        "text_overrides": {"tie_word_embeddings": True},
    },  # tied in text_config only
    "next": {"kind": "llava_next", "text": "llama"},
    "next-mistral": {
        "kind": "llava_next",
        "text": "mistral",
        "text_overrides": {"sliding_window": 64},
    },  # < the image prompt
}


def make_checkpoint(folder: Path, kind: str, text: str, text_overrides: dict | None = None, **config):
    vocab = write_tiny_tokenizer(folder)
    text_config = {**TEXT, "model_type": text, "vocab_size": vocab, **(text_overrides or {})}
    if kind == "llava":
        config = transformers.LlavaConfig(
            vision_config=VISION, text_config=text_config, image_token_index=IMAGE, **config
        )
        model_class, processor = transformers.LlavaForConditionalGeneration, CLIP_PROCESSOR
    else:
        config = transformers.LlavaNextConfig(
            vision_config=VISION,
            text_config=text_config,
            image_token_index=IMAGE,
            image_grid_pinpoints=PINPOINTS,
            **config,
        )
        model_class, processor = transformers.LlavaNextForConditionalGeneration, NEXT_PROCESSOR
    torch.manual_seed(0)
    model = model_class(config)
    save_widened(model, folder)  # std 0.2 matrices, perturbed norms/biases/image_newline; eval mode
    (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """case name -> (folder, transformers model), each built once."""
    return build_once(tmp_path_factory, lambda folder, name: make_checkpoint(folder, **CASES[name]))


@pytest.fixture(scope="module")
def images(photo_path):
    """The photo (600x512: a 2x2 any-res grid, unpadded left and right) and a wide strip of it (1x3, not unpadded)."""
    photo = load_image(photo_path)
    return [photo, photo.crop((0, 100, 512, 250))]


def make_processor(kind: str, strategy: str):
    """transformers' processor over a word-level tokenizer where `<image>` is id 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<image>": 1, "describe": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=["<image>"]
    )
    if kind == "llava":
        processor_class, image_processor = transformers.LlavaProcessor, CLIPImageProcessorPil.from_dict(CLIP_PROCESSOR)
    else:
        processor_class, image_processor = (
            transformers.LlavaNextProcessor,
            LlavaNextImageProcessorPil.from_dict(NEXT_PROCESSOR),
        )
    return processor_class(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=VISION["patch_size"],
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=1,
    )


def two_image_prompt() -> list[int]:
    return PROMPT[:6] + [IMAGE] + PROMPT[6:12] + [IMAGE] + PROMPT[12:20]


def mlxcel_image_prefill(model, ids: list[int], images) -> tuple[list[int], np.ndarray, list]:
    """Expanded ids, logits over them and the cache: embed -> merge(encode(preprocess)) -> forward."""
    inputs = model.preprocess_images(images, ["photo", "strip"])
    expanded = expand_placeholders(ids, model.image_token_id, inputs.token_counts)
    embeddings = merge_embeddings(
        model.embed_tokens(mx.array([expanded])), expanded, model.image_token_id, model.encode_images(inputs)
    )
    cache = model.make_cache()
    return expanded, np.array(model.forward_with_embeddings(embeddings, cache)[0]), cache


@pytest.mark.parametrize("name", ["llava", "llava-full", "next", "next-mistral"])
def test_two_image_prompt_matches_transformers(checkpoint, images, name):
    folder, reference = checkpoint(name)
    case = CASES[name]
    model = load_model(str(folder), dtype="float32").model
    assert is_vision_model(model) and model.image_token_id == IMAGE
    ids = two_image_prompt()
    expanded, got, cache = mlxcel_image_prefill(model, ids, images)

    # the placeholder counts LlavaProcessor / LlavaNextProcessor expand the same two images to
    processor = make_processor(case["kind"], case.get("vision_feature_select_strategy", "default"))
    theirs = processor(text=["describe <image> describe <image> describe"], images=images, return_tensors="pt")
    counts = image_runs(theirs["input_ids"][0].numpy(), 1)
    assert image_runs(np.array(expanded), IMAGE) == counts and len(counts) == 2
    if case["kind"] == "llava_next":
        assert counts[0] != counts[1]  # different grids; the photo's is unpadded

    pixels = {k: theirs[k] for k in ("pixel_values", "image_sizes") if k in theirs}
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


@pytest.mark.parametrize("name", ["llava", "llava-qwen2", "next-mistral"])
def test_text_prompt_through_loader_and_engine_matches_transformers(checkpoint, name):
    folder, reference = checkpoint(name)
    loaded = load_model(str(folder), dtype="float32")
    model = loaded.model
    assert model.args.vocab_size == reference.config.text_config.vocab_size
    assert (
        model.args.tie_word_embeddings == (name == "llava-qwen2")
        and ("lm_head" in model) != model.args.tie_word_embeddings
    )
    got = np.array(model(mx.array([PROMPT]), model.make_cache())[0])
    assert np.abs(got - reference_logits(reference, PROMPT)).max() <= LOGIT_TOLERANCE
    assert mlxcel_generate(model, [PROMPT], GREEDY)[0] == reference_greedy(reference, PROMPT, GREEDY)


def rename_to_hub(key: str) -> str:
    """transformers 5's saved names -> the llava-hf files' (a vision_model level in the tower)."""
    return key.replace("vision_tower.", "vision_tower.vision_model.", 1) if key.startswith("vision_tower.") else key


@pytest.mark.parametrize("name", ["llava", "next"])
@pytest.mark.parametrize("layout", ["hub", "in_memory"])
def test_checkpoint_layouts_give_the_same_logits(checkpoint, images, tmp_path, name, layout):
    from safetensors.numpy import load_file, save_file

    folder, reference = checkpoint(name)
    if layout == "hub":
        weights = {rename_to_hub(k): v for k, v in load_file(folder / "model.safetensors").items()}
        weights["vision_tower.vision_model.embeddings.position_ids"] = np.arange(17, dtype=np.int64)[
            None
        ]  # older saves' buffer
        assert "language_model.lm_head.weight" in weights and "vision_tower.vision_model.pre_layrnorm.weight" in weights
    else:  # transformers' module names: model.language_model.*, model.vision_tower.*, lm_head.*
        weights = {k: v.detach().numpy().copy() for k, v in reference.state_dict().items()}
        assert "model.language_model.norm.weight" in weights and "lm_head.weight" in weights
    for file in ("config.json", "preprocessor_config.json"):
        shutil.copy(folder / file, tmp_path / file)
    save_file(weights, str(tmp_path / "model.safetensors"))
    ids = two_image_prompt()
    _, base, _ = mlxcel_image_prefill(load_model(str(folder), dtype="float32").model, ids, images)
    _, got, _ = mlxcel_image_prefill(load_model(str(tmp_path), dtype="float32").model, ids, images)
    np.testing.assert_array_equal(got, base)


def test_images_need_a_matching_preprocessor_config(checkpoint, images, tmp_path):
    folder, _ = checkpoint("next")
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    shutil.copy(folder / "model.safetensors", tmp_path / "model.safetensors")
    model = load_model(str(tmp_path), dtype="float32").model  # text prompts need no image processor
    model(mx.array([PROMPT[:4]]), model.make_cache())
    with pytest.raises(MlxcelError, match="no preprocessor_config.json"):
        model.preprocess_images(images, ["photo", "strip"])
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({**NEXT_PROCESSOR, "image_grid_pinpoints": [[56, 112]]})
    )
    model.attach_preprocessor(tmp_path)
    with pytest.raises(MlxcelError, match="image_grid_pinpoints"):
        model.preprocess_images(images, ["photo", "strip"])
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**NEXT_PROCESSOR, "crop_size": 42, "size": 42}))
    model.attach_preprocessor(tmp_path)
    with pytest.raises(MlxcelError, match="vision tower takes 56x56"):
        model.preprocess_images(images, ["photo", "strip"])


# The llava-hf config.json files (text_config saved as its difference from the defaults).
LLAVA_15_7B = {
    "architectures": ["LlavaForConditionalGeneration"],
    "ignore_index": -100,
    "image_token_index": 32000,
    "model_type": "llava",
    "pad_token_id": 32001,
    "projector_hidden_act": "gelu",
    "text_config": {
        "_name_or_path": "lmsys/vicuna-7b-v1.5",
        "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "rms_norm_eps": 1e-05,
        "torch_dtype": "float16",
        "vocab_size": 32064,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "vision_config": {
        "hidden_size": 1024,
        "image_size": 336,
        "intermediate_size": 4096,
        "model_type": "clip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "patch_size": 14,
        "projection_dim": 768,
        "vocab_size": 32000,
    },
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "vocab_size": 32064,
}
LLAVA_NEXT_MISTRAL_7B = {
    "architectures": ["LlavaNextForConditionalGeneration"],
    "ignore_index": -100,
    "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
    "image_token_index": 32000,
    "model_type": "llava_next",
    "projector_hidden_act": "gelu",
    "text_config": {
        "_name_or_path": "mistralai/Mistral-7B-Instruct-v0.2",
        "architectures": ["MistralForCausalLM"],
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mistral",
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "torch_dtype": "bfloat16",
        "vocab_size": 32064,
    },
    "torch_dtype": "float16",
    "use_image_newline_parameter": True,
    "vision_config": {
        "hidden_size": 1024,
        "image_size": 336,
        "intermediate_size": 4096,
        "model_type": "clip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "patch_size": 14,
        "projection_dim": 768,
        "vocab_size": 32000,
    },
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "vocab_size": 32064,
}


@pytest.mark.parametrize("raw", [LLAVA_15_7B, LLAVA_NEXT_MISTRAL_7B], ids=["llava-1.5-7b", "llava-v1.6-mistral-7b"])
def test_hub_configs_read_as_transformers_reads_them(raw):
    ours = llava.ModelArgs.from_config(raw)
    theirs = getattr(transformers, "LlavaConfig" if raw["model_type"] == "llava" else "LlavaNextConfig").from_dict(raw)
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
    assert ours.text.rope_theta == text.rope_parameters["rope_theta"]
    assert getattr(ours.text, "sliding_window", None) == getattr(text, "sliding_window", None)
    assert ours.text.tie_word_embeddings == theirs.tie_word_embeddings is False
    assert ours.text.eos_token_ids == [text.eos_token_id]
    assert ours.image_token_id == theirs.image_token_id == 32000
    assert (ours.vision_feature_layer, ours.vision_feature_select_strategy) == (
        theirs.vision_feature_layer,
        theirs.vision_feature_select_strategy,
    )
    if raw["model_type"] == "llava_next":
        assert ours.image_grid_pinpoints == theirs.image_grid_pinpoints
