"""model.path=org/name through huggingface_hub's cache: a cache the test builds, offline."""

from __future__ import annotations

import shutil

import pytest

from mlxcel.checkpoints.hub import is_repo_id
from tests.helpers import run_cli

pytest.importorskip("huggingface_hub")


def make_hub_cache(root, repo_id: str, folder) -> None:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_repo_ids_and_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_repo_id("Qwen/Qwen2.5-0.5B-Instruct") and is_repo_id("org/name.v2")
    assert not any(is_repo_id(p) for p in ("/abs/path", "./rel/x", "~/x/y", "a/b/c", "model.gguf", "embedded:smollm2"))
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_repo_id("org/name")  # an existing local folder wins


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_cached_repo_runs_offline(tmp_path, tiny_llama):
    cache = tmp_path / "hub"
    make_hub_cache(cache, "tiny-org/tiny-llama", tiny_llama)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    result = run_cli(
        tmp_path, "model.path=tiny-org/tiny-llama", "decode.max_tokens=4", "decode.ignore_eos=true", env=env
    )
    assert result.returncode == 0, result.stderr
    assert "loaded llama" in result.stderr


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_uncached_repo_offline_is_one_clear_line(tmp_path, tiny_llama):
    env = {"HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1"}
    result = run_cli(tmp_path, "model.path=no-org/not-cached", env=env)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "not-cached" in line]
    assert len(lines) == 1, result.stderr
    assert "not in the Hugging Face cache" in lines[0] and "hf download no-org/not-cached" in lines[0]
