"""runner.ray.address: a job joins a Ray cluster another process runs, as on a cluster of machines
(docs/scaleout.md), and leaves it running. Its own module: the other Ray tests' in-process cluster
must be gone (a driver already connected would use that one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mlxcel.config import validate_config
from mlxcel.runner import run
from tests.helpers import REPO, read_rows, write_rows

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def run_job(tmp_path, tiny_llama, name: str, **runner) -> tuple[dict, dict]:
    rows = [{"id": f"r{i}", "prompt": "word " * (3 + 5 * i), "max_tokens": 5 + 4 * i} for i in range(6)]
    cfg = validate_config(
        {
            "model": {"path": str(tiny_llama), "max_context": 256},
            "template": {"kind": "none"},
            "prompt": {"file": str(write_rows(tmp_path / f"{name}.jsonl", rows))},
            "sampler": {"processors": {"temperature": {"value": 1.0}}, "selector": {"kind": "categorical"}, "seed": 5},
            "runner": {"max_rows": 2, "progress": "off", **runner},
        }
    )
    run(cfg, tmp_path / name, stream=None, log=None)
    stats = json.loads((tmp_path / name / "stats.json").read_text())
    return {r["id"]: r["token_ids"] for r in read_rows(tmp_path / name)}, stats


def test_a_job_joins_a_running_cluster_by_its_address(tmp_path, tiny_llama):
    assert not ray.is_initialized()
    code = (
        "import ray, sys; ray.init(num_cpus=2, include_dashboard=False, logging_level='ERROR');"
        "print(ray.get_runtime_context().gcs_address, flush=True); sys.stdin.read()"
    )
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(REPO)}
    head = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        address = head.stdout.readline().strip()
        assert ":" in address, address
        local, _ = run_job(tmp_path, tiny_llama, "local")
        remote, stats = run_job(tmp_path, tiny_llama, "ray", backend="ray", ray={"address": address, "workers": 2})
        assert remote == local and stats["ray"]["address"] == address
        assert len(stats["ray"]["workers"]) == 2 and not ray.is_initialized()  # disconnected
        ray.init(address=address, logging_level="ERROR")  # the cluster still runs
        assert ray.cluster_resources()["CPU"] == 2
        ray.shutdown()
    finally:
        head.communicate(input="", timeout=60)
