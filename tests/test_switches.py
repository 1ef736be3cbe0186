"""The engine's switches as config keys (decode.step, model.fuse): the environment variables still
override them, config.resolved.json records what ran, and run folders written before the keys
existed still resume."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlxcel.api import load_config
from mlxcel.config import resolve_decode_step
from mlxcel.engine import GenerationRequest, RowRequest
from mlxcel.errors import ConfigError
from mlxcel.outputs import RunOutputs, check_resume
from mlxcel.pipeline import Pipeline
from mlxcel.sampling import Sampler

SWITCH_ENV = ("MLXCEL_DECODE_STEP", "MLXCEL_COMPILE", "MLXCEL_FUSE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in SWITCH_ENV:
        monkeypatch.delenv(name, raising=False)


def config(tiny_llama, **sections):
    return load_config({"model": {"path": str(tiny_llama)}, "prompt": {"text": "hi"}, **sections})


def test_decode_step_key_and_its_environment_override(monkeypatch):
    device_default = "segmented" if mx.default_device() == mx.gpu else "eager"
    assert resolve_decode_step("auto") == device_default
    assert resolve_decode_step("compiled") == "compiled"
    monkeypatch.setenv("MLXCEL_DECODE_STEP", "eager")
    assert resolve_decode_step("segmented") == "eager"  # the variable wins over the key
    monkeypatch.delenv("MLXCEL_DECODE_STEP")
    monkeypatch.setenv("MLXCEL_COMPILE", "1")  # the older spelling of decode.step=compiled
    assert resolve_decode_step("auto") == "compiled"


def test_a_bad_decode_step_is_a_config_error(tiny_llama, monkeypatch):
    with pytest.raises(ConfigError, match=r"decode\.step: must be one of: auto, eager, segmented, compiled"):
        config(tiny_llama, decode={"step": "fast"})
    monkeypatch.setenv("MLXCEL_DECODE_STEP", "fast")
    with pytest.raises(ConfigError, match=r"MLXCEL_DECODE_STEP: environment variable: must be one of"):
        config(tiny_llama)


def test_the_engine_runs_the_configured_step(tiny_llama):
    pipeline = Pipeline.load(config(tiny_llama, decode={"step": "segmented", "max_tokens": 3}))
    engine = pipeline.make_engine(GenerationRequest([RowRequest([1, 2, 3])], Sampler("greedy")))
    assert engine.segmented is True  # the scheduler's small-batch step (its default on the CPU: eager)


@pytest.mark.parametrize("fuse", [True, False])
def test_model_fuse_key(tiny_llama, fuse):
    attention = Pipeline.load(config(tiny_llama, model={"path": str(tiny_llama), "fuse": fuse})).loaded.model
    attention = attention.model.layers[0].self_attn
    assert ("qkv_proj" in attention) == fuse and ("q_proj" in attention) != fuse


def test_the_environment_overrides_model_fuse(tiny_llama, monkeypatch):
    monkeypatch.setenv("MLXCEL_FUSE", "0")
    cfg = config(tiny_llama, model={"path": str(tiny_llama), "fuse": True})
    assert cfg.model.resolved_fuse() is False
    assert "q_proj" in Pipeline.load(cfg).loaded.model.model.layers[0].self_attn


def test_config_resolved_records_what_ran(tiny_llama, monkeypatch):
    monkeypatch.setenv("MLXCEL_DECODE_STEP", "compiled")
    monkeypatch.setenv("MLXCEL_FUSE", "0")
    resolved = config(tiny_llama, decode={"step": "eager"}).resolved_dict()
    assert resolved["decode"]["step"] == "eager" and resolved["decode"]["resolved_step"] == "compiled"
    assert resolved["model"]["fuse"] is True and resolved["model"]["resolved_fuse"] is False


def test_a_folder_written_before_the_keys_resumes(tiny_llama, tmp_path):
    resolved = config(tiny_llama).resolved_dict()
    old = json.loads(json.dumps(resolved))
    for section, keys in (("decode", ("step", "resolved_step")), ("model", ("fuse", "resolved_fuse"))):
        for key in keys:
            del old[section][key]
    (tmp_path / "config.resolved.json").write_text(json.dumps(old))
    (tmp_path / "generations.jsonl").write_text("")
    assert check_resume(RunOutputs(tmp_path), resolved) == {}
    # a run that did not fuse is another run: its rows may differ in the last bits
    unfused = config(tiny_llama, model={"path": str(tiny_llama), "fuse": False}).resolved_dict()
    with pytest.raises(ConfigError, match=r"model\.fuse: differs from the run being resumed"):
        check_resume(RunOutputs(tmp_path), unfused)
