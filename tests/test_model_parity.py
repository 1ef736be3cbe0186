"""The dense llama/qwen2 code paths on tiny random checkpoints: config reading, fused and separate
projections, memory. Their logits and greedy tokens against transformers are in
tests/test_text_families.py."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.checkpoints.loader import load_model
from tests.family_fixtures import PROMPT, mlxcel_logits
from tests.helpers import make_tiny_checkpoint

pytest.importorskip("torch")


def test_rope_theta_read_from_rope_parameters_only(tmp_path, tiny_llama):
    """transformers 5 writes rope_parameters and no rope_theta: the base must still be read."""
    config = json.loads((tiny_llama / "config.json").read_text())
    assert "rope_theta" not in config, "transformers 5 layout expected"
    theta = config["rope_parameters"]["rope_theta"]
    _, loaded = mlxcel_logits(tiny_llama, PROMPT[:4])
    assert loaded.model.args.rope_theta == theta


def test_qwen2_has_qkv_bias_and_no_o_bias(tiny_qwen2, monkeypatch):
    monkeypatch.setenv("MLXCEL_FUSE", "0")
    attn = load_model(str(tiny_qwen2), dtype="float32").model.model.layers[0].self_attn
    assert "bias" in attn.q_proj and "bias" in attn.k_proj and "bias" in attn.v_proj
    assert "bias" not in attn.o_proj
    monkeypatch.setenv("MLXCEL_FUSE", "1")
    fused = load_model(str(tiny_qwen2), dtype="float32").model.model.layers[0]
    assert fused.self_attn.qkv_proj.bias.shape == (64 + 2 * 32,) and "q_proj" not in fused.self_attn
    assert fused.mlp.gate_up_proj.weight.shape == (2 * 128, 64)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_and_separate_projections_agree(family, tiny_llama, tiny_qwen2, monkeypatch):
    folder = tiny_llama if family == "llama" else tiny_qwen2
    monkeypatch.setenv("MLXCEL_FUSE", "0")
    separate, _ = mlxcel_logits(folder, PROMPT)
    monkeypatch.setenv("MLXCEL_FUSE", "1")
    fused, _ = mlxcel_logits(folder, PROMPT)
    assert np.abs(separate - fused).max() <= 1e-4


def test_one_row_bias_split_gives_the_fused_linear_result(tiny_qwen2, monkeypatch):
    """The CUDA-only batch-1 path (gemv + bias add instead of one biased matmul) computes the
    same decode logits; forced on here so the CPU exercises it."""
    from mlxcel.models import base

    model = load_model(str(tiny_qwen2), dtype="float32").model
    prompt = mx.array([[5, 9, 14, 3, 27, 8]])

    def decode_logits() -> mx.array:
        cache = model.make_cache(1)
        model(prompt, cache)
        return model(mx.array([[11]]), cache)[:, -1, :]

    monkeypatch.setattr(base, "SPLIT_ONE_ROW_BIAS", False)
    fused = decode_logits()
    monkeypatch.setattr(base, "SPLIT_ONE_ROW_BIAS", True)
    split = decode_logits()
    assert mx.abs(fused - split).max().item() < 1e-5


@pytest.mark.slow  # starts mlxcel-run (or Python) in a subprocess
def test_import_sets_the_cuda_graph_size_unless_the_user_did():
    import os
    import subprocess
    import sys

    code = "import os, mlxcel; print(os.environ.get('MLX_MAX_OPS_PER_BUFFER'))"
    env = {k: v for k, v in os.environ.items() if k != "MLX_MAX_OPS_PER_BUFFER"}
    default = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert default == ("100" if sys.platform == "linux" else "None")
    kept = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "MLX_MAX_OPS_PER_BUFFER": "7"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert kept == "7"


def test_fused_swiglu_equals_silu_times_up():
    import mlx.nn as nn

    from mlxcel.models.base import fused_swiglu

    gate, up = mx.random.normal((2, 3, 64), key=mx.random.key(1)), mx.random.normal((2, 3, 64), key=mx.random.key(2))
    assert mx.abs(fused_swiglu(gate, up) - nn.silu(gate) * up).max().item() < 1e-6


def test_fused_qkv_prefill_peak_memory_is_no_higher_than_separate(tmp_path, monkeypatch):
    """A prefill's peak memory with fused QKV stays at the unfused level (V stored into the cache
    as a view of the fused output once kept every layer's QKV buffer alive: deep and
    attention-heavy here, so that would show)."""
    folder = make_tiny_checkpoint(
        tmp_path / "deep", "llama", num_hidden_layers=12, hidden_size=128, intermediate_size=128
    )

    def prefill_peak(fuse: str) -> int:
        monkeypatch.setenv("MLXCEL_FUSE", fuse)
        model = load_model(str(folder), dtype="float32").model
        mx.eval(model.parameters())
        tokens = mx.random.randint(3, 60, (8, 256), key=mx.random.key(0))
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        cache = model.make_cache(8)
        mx.eval(model(tokens, cache, logits_at=255), [c.state for c in cache])
        return mx.get_peak_memory() - base

    separate, fused = prefill_peak("0"), prefill_peak("1")
    # Fusing may hold one layer's QKV output at a time ([8, 256, q 128 + k 64 + v 64] fp32, 2 MiB:
    # measured exactly that on CI), never every layer's (12 of them: +24 MiB).
    one_layer_qkv = 8 * 256 * (128 + 64 + 64) * 4
    assert fused <= separate + one_layer_qkv + 64 * 1024, (fused, separate)
