"""OpenBLAS preloading on Linux: when it applies, and that results do not change."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from mlxcel import blas
from tests.helpers import REPO, read_run, run_cli


@pytest.fixture
def linux_reference(monkeypatch):
    monkeypatch.setattr(blas.sys, "platform", "linux")
    monkeypatch.setattr(blas, "has_reference_blas", lambda: True)
    monkeypatch.setattr(blas, "find_openblas", lambda: "/usr/lib/libopenblas.so.0")


def test_plan(linux_reference, monkeypatch):
    assert blas.plan_blas_preload({}) == ("/usr/lib/libopenblas.so.0", None)
    assert blas.plan_blas_preload({"MLXCEL_BLAS": "off"}) == (None, None)
    assert blas.plan_blas_preload({blas.MARKER: "x"}) == (None, None)  # never re-exec twice
    assert blas.plan_blas_preload({"LD_PRELOAD": "/opt/libopenblas.so"}) == (None, None)
    monkeypatch.setattr(blas, "find_openblas", lambda: None)
    assert blas.plan_blas_preload({}) == (None, blas.HINT)
    monkeypatch.setattr(blas.sys, "platform", "darwin")
    assert blas.plan_blas_preload({}) == (None, None)  # macOS: Accelerate


needs_openblas = pytest.mark.skipif(
    sys.platform != "linux" or blas.find_openblas() is None or not blas.has_reference_blas(),
    reason="needs Linux, the mlx-cpu wheel's reference BLAS and an installed OpenBLAS",
)

LOGITS = """
import sys, numpy as np, mlx.core as mx
from mlxcel.checkpoints.loader import load_model
m = load_model(sys.argv[1], dtype="float32").model
ids = mx.array([[(7 * i + 3) % 300 + 5 for i in range(64)]])
np.save(sys.argv[2], np.array(m(ids, m.make_cache())[0]))
"""


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
@needs_openblas
def test_openblas_gives_the_same_logits(tiny_llama, tmp_path):
    outputs = {}
    for name, preload in (("reference", ""), ("openblas", blas.find_openblas())):
        env = {**os.environ, "PYTHONPATH": str(REPO), "LD_PRELOAD": preload}
        path = tmp_path / f"{name}.npy"
        subprocess.run([sys.executable, "-c", LOGITS, str(tiny_llama), str(path)], env=env, check=True, timeout=300)
        outputs[name] = np.load(path)
    assert np.abs(outputs["reference"] - outputs["openblas"]).max() <= 1e-4
    assert (outputs["reference"].argmax(-1) == outputs["openblas"].argmax(-1)).all()


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
@needs_openblas
def test_cli_preloads_openblas_and_tokens_match(tiny_llama, tmp_path):
    args = (f"model.path={tiny_llama}", "decode.max_tokens=16", "decode.ignore_eos=true", "prefill.chunk_size=8")
    assert run_cli(tmp_path, *args, run="fast").returncode == 0
    assert run_cli(tmp_path, *args, run="slow", env={"MLXCEL_BLAS": "off"}).returncode == 0
    fast, slow = read_run(tmp_path, "fast"), read_run(tmp_path, "slow")
    assert fast[0]["environment"]["blas"] == "openblas (preloaded)"
    assert slow[0]["environment"]["blas"] == "reference (mlx-cpu wheel)"
    assert fast[1][0]["token_ids"] == slow[1][0]["token_ids"]
