"""Multimodal Gemma 3 folders (model_type gemma3, Gemma3ForConditionalGeneration) load as their
language model, against transformers on text-only prompts, in both weight layouts."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.models import gemma3
from mlxcel.vision.stage import is_vision_model
from tests.family_fixtures import (
    BASE_SHAPE,
    FAMILIES,
    PROMPT,
    assert_parity,
    mlxcel_generate,
    save_widened,
)
from tests.helpers import write_tiny_tokenizer

pytest.importorskip("torch")

# tiny SigLIP: 28 / 14 = 2 x 2 patches, pooled to mm_tokens_per_image = 4
VISION = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}
# transformers < 4.52 (and transformers 5 on save) -> transformers 4.52+ in memory
OLD_TO_NEW = {
    "language_model.model.": "model.language_model.",
    "language_model.lm_head.": "lm_head.",
    "vision_tower.": "model.vision_tower.",
    "multi_modal_projector.": "model.multi_modal_projector.",
}
NEW_TO_OLD = {new: old for old, new in OLD_TO_NEW.items()}
# google/gemma-3-4b-it's config.json, vision_config left out: the text_config omits what it shares
# with Gemma3TextConfig's defaults
HUB_4B_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "mm_tokens_per_image": 256,
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
}


def make_multimodal_checkpoint(folder: Path, seed: int, **overrides) -> Path:
    """The gemma3_text test model as the language model of a Gemma3ForConditionalGeneration."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    text = {**BASE_SHAPE, **FAMILIES["gemma3_text"][2], "vocab_size": write_tiny_tokenizer(folder)}
    config = transformers.Gemma3Config(
        text_config=text, vision_config=VISION, mm_tokens_per_image=4, eos_token_id=2, **overrides
    )
    torch.manual_seed(seed)
    save_widened(transformers.Gemma3ForConditionalGeneration(config), folder)
    return folder


def rewrite_in_other_layout(folder: Path, target: Path) -> Path:
    """A copy of `folder` with its tensors renamed to the layout the installed transformers did not write."""
    import shutil

    shutil.copytree(folder, target)
    weights = mx.load(str(target / "model.safetensors"))
    renames = OLD_TO_NEW if any(k.startswith("language_model.") for k in weights) else NEW_TO_OLD
    renamed = {rename_key(k, renames): v for k, v in weights.items()}
    assert renamed.keys().isdisjoint(weights.keys())  # every tensor moved
    mx.save_safetensors(str(target / "model.safetensors"), renamed, metadata={"format": "pt"})
    return target


def rename_key(key: str, renames: dict[str, str]) -> str:
    prefix = next(p for p in renames if key.startswith(p))
    return renames[prefix] + key[len(prefix) :]


def logits_of(folder: Path) -> np.ndarray:
    model = load_model(str(folder), dtype="float32").model
    return np.array(model(mx.array([PROMPT]), model.make_cache())[0])


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "lm_head"])
def checkpoint(request, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gemma3_mm")
    return make_multimodal_checkpoint(folder / "saved", seed=20, tie_word_embeddings=request.param)


def test_multimodal_gemma3_matches_transformers(checkpoint):
    model = assert_parity(checkpoint)["model"]
    tied = model.args.tie_word_embeddings
    assert tied == ("lm_head" not in model)
    assert model.eos_token_ids() == [2]  # the top-level eos, not text_config's default 1
    assert model.layer_windows == [16, 16, None, 16]
    loaded = load_model(str(checkpoint), dtype="float32")  # now with its tower (tests/test_families_gemma3_vl.py)
    assert "note" not in loaded.info and is_vision_model(loaded.model)


def test_multimodal_gemma3_other_weight_layout_loads_the_same(checkpoint):
    """transformers reads the renamed copy as the same model, and so does mlxcel."""
    other = rewrite_in_other_layout(checkpoint, checkpoint.parent / "other_layout")
    result = assert_parity(other)
    assert np.array_equal(logits_of(other), logits_of(checkpoint))
    saved = load_model(str(checkpoint), dtype="float32").model
    assert result["greedy"] == mlxcel_generate(saved, [PROMPT], 32)[0]


def test_hub_text_config_takes_transformers_defaults():
    args = gemma3.ModelArgs.from_config(gemma3.normalize_config(HUB_4B_CONFIG))
    assert (args.num_attention_heads, args.num_key_value_heads, args.head_dim) == (8, 4, 256)
    assert (args.query_pre_attn_scalar, args.vocab_size, args.max_position_embeddings) == (256, 262208, 131072)
    assert args.layer_windows == ([1024] * 5 + [None]) * 5 + [1024] * 4
    assert (args.rope_theta, args.rope_local_theta, args.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert args.tie_word_embeddings and args.eos_token_ids == [1, 106] and args.model_type == "gemma3_text"


def test_text_config_eos_used_when_the_top_level_has_none():
    config = {**HUB_4B_CONFIG, "text_config": {**HUB_4B_CONFIG["text_config"], "eos_token_id": [1, 106]}}
    del config["eos_token_id"]
    assert gemma3.normalize_config(config)["eos_token_id"] == [1, 106]


def test_text_config_defaults_match_transformers():
    from transformers import Gemma3TextConfig

    reference = Gemma3TextConfig()
    assert {key: getattr(reference, key) for key in gemma3.TEXT_CONFIG_DEFAULTS} == gemma3.TEXT_CONFIG_DEFAULTS


def test_dry_run_header_reads_the_language_models_context(tmp_path):
    from mlxcel.checkpoints.fingerprint import read_context_length

    assert read_context_length(HUB_4B_CONFIG) == 131072  # Gemma3TextConfig's default; text_config omits it
    assert (
        read_context_length(
            {**HUB_4B_CONFIG, "text_config": {**HUB_4B_CONFIG["text_config"], "max_position_embeddings": 8192}}
        )
        == 8192
    )
    assert read_context_length({"model_type": "llama", "max_position_embeddings": 2048}) == 2048
    assert read_context_length({"model_type": "llava_next", "text_config": {"max_position_embeddings": 32768}}) == 32768
