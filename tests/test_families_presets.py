"""Every family preset composes, names a family the loader supports, and still requires model.path."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcel.checkpoints.loader import FAMILIES, list_supported_families
from mlxcel.config import validate_config
from mlxcel.errors import ConfigError
from tests.helpers import CONF_DIR, compose_run

# preset -> the model_type it documents
FAMILY_PRESETS = {
    "mistral": "mistral",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "mixtral": "mixtral",
    "qwen3_moe": "qwen3_moe",
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_5_vl",
    "llava": "llava",
    "llava_next": "llava_next",
    "mistral3": "mistral3",
    "idefics3": "idefics3",
    "smolvlm": "smolvlm",
}
LANDED = [name for name in FAMILY_PRESETS if (CONF_DIR / "model" / f"{name}.yaml").exists()]


@pytest.mark.parametrize("preset", LANDED)
def test_family_preset_requires_a_path(preset):
    with pytest.raises(ConfigError, match=r"model\.path: required"):
        validate_config(compose_run([f"model={preset}"]))


@pytest.mark.parametrize("preset", LANDED)
def test_family_preset_validates_with_a_path_and_its_family_is_supported(preset, tmp_path):
    cfg = validate_config(compose_run([f"model={preset}", f"model.path={tmp_path}"]))
    assert cfg.model.path == str(tmp_path)
    model_type = FAMILY_PRESETS[preset]
    assert model_type in list_supported_families() and model_type in FAMILIES
    assert model_type in cfg.model.families  # the preset takes that family's checkpoints (and refuses others)


@pytest.mark.parametrize(
    "preset", sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "conf" / "model").glob("*.yaml"))
)
def test_every_model_preset_takes_every_model_key(preset):
    """The presets share one base through Hydra defaults: model.quantize once failed on 16 of 18."""
    from mlxcel.cli import compose_config

    model = compose_config([f"model={preset}", "model.quantize={bits: 4, group_size: 64}", "model.max_context=512"])[
        "model"
    ]
    keys = {"path", "dtype", "gguf_weights", "max_context", "quantize", "families", "hub_ids", "fuse"}
    assert set(model) == keys | {"adapter", "adapters", "merge_adapter"}
    # a family preset names its usual repos when model.path is missing (model=hf and smollm2 need none)
    assert bool(model["hub_ids"]) == bool(model["families"]) and all("/" in repo for repo in model["hub_ids"] or [])
    assert model["quantize"] == {"bits": 4, "group_size": 64} and model["max_context"] == 512


def test_a_family_preset_refuses_another_familys_checkpoint(tmp_path):
    """model=qwen2_vl model.path=embedded:smollm2 once ran Llama without a word."""
    from mlxcel.api import load_config
    from mlxcel.checkpoints.fingerprint import read_model_header
    from mlxcel.checkpoints.loader import resolve_model_path
    from mlxcel.pipeline import check_before_loading

    header = read_model_header(resolve_model_path("embedded:smollm2"))
    wrong = load_config({"model": {"path": "embedded:smollm2"}}, ["model=qwen2_vl", "model.path=embedded:smollm2"])
    with pytest.raises(
        ConfigError, match=r"model: embedded:smollm2 is a 'llama' checkpoint, and this model preset is for qwen2_vl"
    ):
        check_before_loading(wrong, header)
    check_before_loading(load_config(None, ["model=hf", "model.path=embedded:smollm2"]), header)  # hf: any family
    check_before_loading(load_config(None, []), header)  # the default preset (smollm2) takes any path given to it
