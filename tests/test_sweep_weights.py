"""A sweep's jobs in one process keep the weights loaded for the next job that uses the same ones
(Hydra's basic launcher runs them one after another; loading costs seconds a job), and load
again when the weights, their load settings or the files change."""

from __future__ import annotations

import json
import os

import pytest

from mlxcel import pipeline as pipeline_module
from mlxcel import runner
from mlxcel.api import load_config


@pytest.fixture
def count_loads(monkeypatch):
    pipeline_module._KEPT_WEIGHTS.clear()
    calls = []
    real = pipeline_module.load_model

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline_module, "load_model", counting)
    yield calls
    pipeline_module._KEPT_WEIGHTS.clear()


def run_job(tiny_llama, out_dir, keep=True, **model):
    cfg = load_config(
        {
            "model": {"path": str(tiny_llama), "dtype": "float32", **model},
            "prompt": {"text": "hello there"},
            "decode": {"max_tokens": 4},
        }
    )
    result = runner.run(cfg, out_dir=out_dir, stream=None, log=None, keep_weights=keep)
    stats = json.loads((out_dir / "stats.json").read_text())
    return result.generations[0]["token_ids"], stats["model"]


def test_the_next_job_with_the_same_weights_reuses_them(tiny_llama, tmp_path, count_loads):
    first_ids, first = run_job(tiny_llama, tmp_path / "a")
    second_ids, second = run_job(tiny_llama, tmp_path / "b")
    assert len(count_loads) == 1 and second_ids == first_ids
    assert second["kept_from_previous_job"] is True and second["load_ms"] == 0.0
    assert "kept_from_previous_job" not in first and first["load_ms"] > 0


def test_other_settings_or_changed_files_load_again(tiny_llama, tmp_path, count_loads):
    run_job(tiny_llama, tmp_path / "a")
    run_job(tiny_llama, tmp_path / "b", fuse=False)  # another load setting
    assert len(count_loads) == 2
    config = tiny_llama / "config.json"
    stamp = config.stat().st_mtime_ns + 10**9
    os.utime(config, ns=(stamp, stamp))  # the checkpoint changed on disk between jobs
    run_job(tiny_llama, tmp_path / "c", fuse=False)
    assert len(count_loads) == 3
    run_job(tiny_llama, tmp_path / "d", fuse=False)
    assert len(count_loads) == 3


def test_a_single_run_keeps_nothing(tiny_llama, tmp_path, count_loads):
    run_job(tiny_llama, tmp_path / "a", keep=False)
    run_job(tiny_llama, tmp_path / "b", keep=False)
    assert len(count_loads) == 2 and not pipeline_module._KEPT_WEIGHTS


def test_a_change_in_a_sub_folder_loads_again(tiny_llama, tmp_path, count_loads):
    """An adapter beside the weights (Phi-4-multimodal's vision-lora/) is part of them."""
    import shutil

    folder = shutil.copytree(tiny_llama, tmp_path / "model")
    adapter = folder / "vision-lora" / "adapter_config.json"
    adapter.parent.mkdir()
    adapter.write_text("{}")
    run_job(folder, tmp_path / "a")
    run_job(folder, tmp_path / "b")
    assert len(count_loads) == 1
    stamp = adapter.stat().st_mtime_ns + 10**9
    os.utime(adapter, ns=(stamp, stamp))
    run_job(folder, tmp_path / "c")
    assert len(count_loads) == 2
