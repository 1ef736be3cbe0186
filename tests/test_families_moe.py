"""Mixture-of-experts layers: the stacked experts (gather_mm / gather_qmm) against a per-expert loop,
routing, quantized experts, mlx-lm's converted folders and the presets. Mixtral and Qwen3-MoE against
transformers are in tests/test_text_families.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from mlxcel.models.switch import (
    QuantizedSwitchLinear,
    SwitchGLU,
    SwitchLinear,
    route_top_k,
)
from tests.family_fixtures import PROMPT, make_family_checkpoint, mlxcel_logits

pytest.importorskip("torch")


def loop_over_experts(glu: SwitchGLU, x: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """The reference: each (token, chosen expert) through that expert's dense weights."""
    gate, up, down = (np.array(p.weight) for p in (glu.gate_proj, glu.up_proj, glu.down_proj))
    out = np.zeros((*indices.shape, x.shape[-1]), np.float32)
    for pos in np.ndindex(indices.shape):
        token, e = x[pos[:-1]], indices[pos]
        g, u = gate[e] @ token, up[e] @ token
        out[pos] = down[e] @ (g / (1 + np.exp(-g)) * u)
    return out


@pytest.mark.parametrize("tokens", [3, 40])  # 6 (token, expert) pairs: plain gather; 80: sorted by expert
def test_switch_glu_equals_a_loop_over_experts(tokens):
    mx.random.seed(0)
    glu = SwitchGLU(16, 24, 5)
    x = mx.random.normal((2, tokens, 16))
    indices = mx.random.randint(0, 5, (2, tokens, 2))
    expected = loop_over_experts(glu, np.array(x), np.array(indices))
    np.testing.assert_allclose(np.array(glu(x, indices)), expected, atol=1e-4)
    glu.fuse()
    assert "gate_up_proj" in glu and "gate_proj" not in glu
    np.testing.assert_allclose(np.array(glu(x, indices)), expected, atol=1e-4)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_switch_glu_runs_in_half_precision(dtype):
    """The CPU's gather_mm takes float32 only: half-precision weights still work there."""
    mx.random.seed(2)
    glu = SwitchGLU(16, 24, 5)
    x = mx.random.normal((1, 40, 16))
    indices = mx.random.randint(0, 5, (1, 40, 2))
    expected = np.array(glu(x, indices))
    glu.set_dtype(dtype)
    got = glu(x.astype(dtype), indices)
    assert got.dtype == dtype
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), expected, atol=0.05 * np.abs(expected).max())


def test_route_top_k_softmax_then_top_k_then_optional_renormalisation():
    logits = mx.array([[2.0, 0.5, 1.0, -1.0]])
    probs = np.exp([2.0, 0.5, 1.0, -1.0]) / np.exp([2.0, 0.5, 1.0, -1.0]).sum()
    indices, weights = route_top_k(logits, 2, normalize=False)
    assert sorted(indices[0].tolist()) == [0, 2]
    picked = dict(zip(indices[0].tolist(), weights[0].tolist()))
    assert picked == pytest.approx({0: probs[0], 2: probs[2]})
    _, normalised = route_top_k(logits, 2, normalize=True)
    assert sorted(normalised[0].tolist()) == pytest.approx(
        sorted([probs[2] / (probs[0] + probs[2]), probs[0] / (probs[0] + probs[2])])
    )


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_switch_linear_equals_its_dequantized_weights(bits):
    mx.random.seed(1)
    layer = SwitchLinear(64, 32, 4)
    quantized = layer.to_quantized(group_size=32, bits=bits)
    assert isinstance(quantized, QuantizedSwitchLinear) and quantized.weight.dtype == mx.uint32
    dense = SwitchLinear(64, 32, 4)
    dense.weight = mx.dequantize(quantized.weight, quantized.scales, quantized.biases, group_size=32, bits=bits)
    x = mx.random.normal((5, 1, 1, 64))
    indices = mx.array([[3], [0], [3], [1], [2]])
    np.testing.assert_allclose(np.array(quantized(x, indices)), np.array(dense(x, indices)), atol=1e-4)


def test_quantized_experts_fuse_gate_and_up():
    """As an MLX-quantized folder loads: quantized first (separate gate/up), fused after."""
    mx.random.seed(3)
    glu = SwitchGLU(64, 32, 4)
    nn.quantize(glu, group_size=32, bits=4)
    x = mx.random.normal((1, 40, 64))
    indices = mx.random.randint(0, 4, (1, 40, 2))
    separate = np.array(glu(x, indices))
    glu.fuse()
    assert isinstance(glu.gate_up_proj, QuantizedSwitchLinear) and glu.gate_up_proj.scales.shape == (4, 64, 2)
    np.testing.assert_allclose(np.array(glu(x, indices)), separate, atol=1e-5)


@pytest.mark.parametrize("family,overrides", [("mixtral", {"sliding_window": None}), ("qwen3_moe", {})])
def test_mlx_lm_convert_moe_folder_loads_and_matches_mlx_lm(family, overrides, tmp_path):
    """mlx_lm.convert -q writes switch_mlp.{gate,up,down}_proj stacked and packed (dev-only
    cross-check). Qwen3-MoE's expert width 48 is no multiple of the group size 32: its down_proj
    stays dense beside quantized gate/up. mlx-lm has no sliding window, so Mixtral goes without."""
    mlx_lm = pytest.importorskip("mlx_lm")
    import json

    src = make_family_checkpoint(tmp_path / "src", family, seed=14, **overrides)
    config = json.loads((src / "config.json").read_text())
    # mlx-lm 0.32 reads neither transformers 5's rope_parameters nor its num_local_experts for Qwen3-MoE
    config.setdefault("rope_theta", config["rope_parameters"]["rope_theta"])
    config.setdefault("num_experts", config.get("num_local_experts"))
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "q4"
    mlx_lm.convert(str(src), mlx_path=str(out), quantize=True, q_group_size=32, q_bits=4)
    ours, loaded = mlxcel_logits(out, PROMPT)
    theirs, _ = mlx_lm.load(str(out))
    np.testing.assert_allclose(ours, np.array(theirs(mx.array([PROMPT]))[0]), atol=1e-4)
    layer = loaded.model.model.layers[1]
    switch = (layer.block_sparse_moe if family == "mixtral" else layer.mlp).switch_mlp
    assert isinstance(switch.gate_up_proj, QuantizedSwitchLinear) and switch.gate_up_proj.bits == 4
    assert isinstance(switch.down_proj, QuantizedSwitchLinear if family == "mixtral" else SwitchLinear)


def test_moe_presets_require_a_path_and_name_their_family(tmp_path):
    from mlxcel.checkpoints.loader import list_supported_families
    from mlxcel.config import validate_config
    from mlxcel.errors import ConfigError
    from tests.helpers import compose_run

    for preset in ("mixtral", "qwen3_moe"):
        with pytest.raises(ConfigError, match=r"model\.path: required"):
            validate_config(compose_run([f"model={preset}"]))
        model = validate_config(compose_run([f"model={preset}", f"model.path={tmp_path}"])).model
        assert model.path == str(tmp_path) and preset in model.families
        assert preset in list_supported_families()
