"""Mixture-of-experts families (Mixtral, Qwen3-MoE) against transformers, and the stacked-expert
layers (gather_mm / gather_qmm) against a per-expert loop."""

from __future__ import annotations

import shutil

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
from tests.family_fixtures import (
    LOGIT_TOLERANCE,
    PROMPT,
    assert_batch_rows_match_alone,
    assert_parity,
    assert_pieces_match_one_shot,
    make_family_checkpoint,
    mlxcel_generate,
    mlxcel_logits,
    reference_logits,
)

pytest.importorskip("torch")

BATCH = [PROMPT, PROMPT[5:28], PROMPT[:9], PROMPT[3:34]]


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    return make_family_checkpoint(tmp_path_factory.mktemp("tiny_mixtral"), "mixtral", seed=11)


@pytest.fixture(scope="module")
def mixtral_parity(tiny_mixtral):
    return assert_parity(tiny_mixtral)


@pytest.fixture(scope="module")
def qwen3_moe_parity(tmp_path_factory):
    return assert_parity(make_family_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe"), "qwen3_moe", seed=11))


def flip_routing_normalisation(model) -> None:
    for layer in model.model.layers:
        moe = layer.block_sparse_moe if "block_sparse_moe" in layer else layer.mlp
        if hasattr(moe, "normalize"):
            moe.normalize = not moe.normalize


def assert_normalisation_matters(folder, model) -> None:
    """The fixture's router weights are far enough from one-hot that renormalising or not shows
    in the logits: the parity above would catch the wrong choice."""
    from tests.helpers import load_reference

    expected = reference_logits(load_reference(folder), PROMPT)
    flip_routing_normalisation(model)
    try:
        flipped = np.array(model(mx.array([PROMPT]), model.make_cache())[0])
    finally:
        flip_routing_normalisation(model)
    assert np.abs(flipped - expected).max() > 100 * LOGIT_TOLERANCE


def test_mixtral_matches_transformers(mixtral_parity, tiny_mixtral):
    model = mixtral_parity["model"]
    moe = model.model.layers[0].block_sparse_moe
    assert moe.normalize and moe.top_k == 2
    assert moe.switch_mlp.gate_up_proj.weight.shape == (4, 256, 64)  # 4 experts stacked, gate and up fused
    assert moe.switch_mlp.down_proj.weight.shape == (4, 64, 128)
    assert model.layer_windows == [16, 16] and model.eos_token_ids() == [2]
    assert_normalisation_matters(tiny_mixtral, model)


def test_mixtral_batch_rows_match_alone(mixtral_parity):
    assert_batch_rows_match_alone(mixtral_parity["model"], BATCH)


@pytest.mark.parametrize("piece,tile", [(7, None), (12, 8)])
def test_mixtral_pieces_match_one_shot(mixtral_parity, piece, tile):
    model = mixtral_parity["model"]
    assert model.supports_multi_piece_prefill and model.supports_padded_prefill
    assert_pieces_match_one_shot(model, PROMPT, piece, tile)


def test_mixtral_loads_transformers_stacked_experts(tiny_mixtral, tmp_path):
    """save_original_format=False keeps transformers 5's in-memory names: mlp.experts.gate_up_proj
    [E, 2I, H] and mlp.experts.down_proj, no per-expert tensors."""
    from safetensors import safe_open

    from tests.helpers import load_reference

    folder = tmp_path / "stacked"
    load_reference(tiny_mixtral).save_pretrained(folder, save_original_format=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_mixtral / name, folder / name)
    with safe_open(str(folder / "model.safetensors"), "np") as f:
        names = list(f.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any(".experts.0." in n for n in names)
    stacked, _ = mlxcel_logits(folder, PROMPT)
    per_expert, _ = mlxcel_logits(tiny_mixtral, PROMPT)
    np.testing.assert_allclose(stacked, per_expert, atol=1e-5)


def test_qwen3_moe_matches_transformers(qwen3_moe_parity):
    model = qwen3_moe_parity["model"]
    assert model.args.sparse_layers == [True, True] and model.args.norm_topk_prob
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (32,)
    assert model.model.layers[1].mlp.switch_mlp.down_proj.weight.shape == (4, 64, 48)


def test_qwen3_moe_batch_rows_match_alone(qwen3_moe_parity):
    assert_batch_rows_match_alone(qwen3_moe_parity["model"], BATCH)


@pytest.mark.parametrize("piece,tile", [(16, None), (12, 8)])
def test_qwen3_moe_pieces_match_one_shot(qwen3_moe_parity, piece, tile):
    assert_pieces_match_one_shot(qwen3_moe_parity["model"], PROMPT, piece, tile)


def test_qwen3_moe_dense_layers_and_unnormalised_routing_match_transformers(tmp_path):
    """decoder_sparse_step=2 makes layers 1 and 3 sparse, mlp_only_layers=[3] turns 3 dense
    again; norm_topk_prob=False (Qwen3-30B-A3B's own setting is True) keeps the raw top-k probabilities."""
    folder = make_family_checkpoint(
        tmp_path / "q",
        "qwen3_moe",
        seed=12,
        num_hidden_layers=4,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        norm_topk_prob=False,
    )
    model = assert_parity(folder)["model"]
    assert model.args.sparse_layers == [False, True, False, False]
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, nn.Linear)  # dense: intermediate_size
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (256, 64)
    assert model.model.layers[1].mlp.normalize is False
    assert_normalisation_matters(folder, model)


def test_qwen3_moe_sliding_window_covers_every_layer(tmp_path):
    """Unlike dense Qwen3, transformers' Qwen3-MoE slides every layer when use_sliding_window
    (max_window_layers is ignored: reading it as Qwen3 does gives |dlogit| ~7 here)."""
    folder = make_family_checkpoint(
        tmp_path / "q", "qwen3_moe", seed=13, use_sliding_window=True, sliding_window=12, max_window_layers=1
    )
    assert assert_parity(folder)["model"].layer_windows == [12, 12]


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


def test_model_quantize_at_load_reaches_the_experts(tiny_mixtral, mixtral_parity):
    """model.quantize: the stacked experts quantize through to_quantized (the fused gate/up stays
    fused); 8 bits keeps most argmaxes of this random model (its router is quantized too)."""
    from mlxcel.checkpoints.loader import load_model

    loaded = load_model(str(tiny_mixtral), dtype="float32", quantize={"bits": 8, "group_size": 32})
    switch = loaded.model.model.layers[0].block_sparse_moe.switch_mlp
    assert isinstance(switch.gate_up_proj, QuantizedSwitchLinear) and switch.gate_up_proj.bits == 8
    assert isinstance(switch.down_proj, QuantizedSwitchLinear)
    assert loaded.info["quantization"]["mean_abs_logit_diff"] > 0
    fp32 = np.array(mixtral_parity["model"](mx.array([PROMPT]), mixtral_parity["model"].make_cache())[0])
    q8 = np.array(loaded.model(mx.array([PROMPT]), loaded.model.make_cache())[0])
    assert (q8.argmax(-1) == fp32.argmax(-1)).mean() >= 0.9


def test_quantized_moe_matches_its_dequantized_form(tiny_mixtral):
    """The quantized experts turn back into dense SwitchLinears with the same weights: logits
    equal and greedy tokens identical (the reference a quantized checkpoint is compared with)."""
    from mlxcel.checkpoints.loader import load_model
    from mlxcel.checkpoints.quantize import dequantize_model
    from mlxcel.models.switch import SwitchLinear

    quantized = load_model(str(tiny_mixtral), dtype="float32", quantize={"bits": 4, "group_size": 32})
    dense = load_model(str(tiny_mixtral), dtype="float32", quantize={"bits": 4, "group_size": 32})
    dequantize_model(dense.model)
    switch = dense.model.model.layers[0].block_sparse_moe.switch_mlp
    assert type(switch.gate_up_proj) is SwitchLinear and type(switch.down_proj) is SwitchLinear
    q = np.array(quantized.model(mx.array([PROMPT]), quantized.model.make_cache())[0])
    d = np.array(dense.model(mx.array([PROMPT]), dense.model.make_cache())[0])
    assert np.abs(q - d).max() <= 1e-3
    assert mlxcel_generate(quantized.model, [PROMPT], 16) == mlxcel_generate(dense.model, [PROMPT], 16)


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


def test_qwen3_moe_compiled_decode_matches_eager(qwen3_moe_parity, monkeypatch):
    """Routing, top-k and the expert gather trace into the compiled step (no sliding window here)."""
    from mlxcel.engine.compiled import CompiledDecoder
    from tests.family_fixtures import mlxcel_generate

    model = qwen3_moe_parity["model"]
    assert CompiledDecoder.can_drive(model.make_cache(1))
    eager = mlxcel_generate(model, BATCH, 12)
    monkeypatch.setenv("MLXCEL_COMPILE", "1")
    assert mlxcel_generate(model, BATCH, 12) == eager
