"""The Gated DeltaNet decode step as one CUDA kernel (models/gated_delta_cuda.py) against the ops path
it replaces (qwen3_5.GatedDeltaNet.advance; on by default on CUDA; MLXCEL_FUSED_DELTA=0 turns it off).

On the CPU: the layer's wiring (which projection output and column each of qkv, z, b and a comes
from, fused or not, Qwen 3.5's four projections and Qwen3-Next's two) through a stand-in for the
kernel written in MLX ops. On MLX's CUDA backend: the kernel itself, eager and inside mx.compile,
fp32 and bf16, and a model's greedy tokens through the scheduler with it and without it."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxcel.models import gated_delta_cuda, qwen3_5, qwen3_next
from mlxcel.models.gated_delta import one_step
from mlxcel.models.recurrent import causal_conv
from mlxcel.sampling.cuda_draw import has_cuda_backend

ROWS = 3
CONFIG = {
    "model_type": "qwen3_5_text",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "rms_norm_eps": 1e-5,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 16,
    "layer_types": ["linear_attention"],
}
LAYERS = {"qwen3_5": qwen3_5.GatedDeltaNet, "qwen3_next": qwen3_next.GatedDeltaNet}


def make_layer(family: str, fused: bool, dtype: mx.Dtype = mx.float32, seed: int = 0):
    if family == "qwen3_next":
        config = {**CONFIG, "model_type": "qwen3_next", "num_experts": 4, "num_experts_per_tok": 2}
        args = qwen3_next.ModelArgs.from_config({**config, "moe_intermediate_size": 32})
    else:
        args = qwen3_5.ModelArgs.from_config(dict(CONFIG))
    mx.random.seed(seed)
    layer = LAYERS[family](args)
    layer.A_log = mx.random.uniform(-1.0, 1.0, layer.A_log.shape)
    layer.dt_bias = mx.random.normal(layer.dt_bias.shape)
    layer.norm.weight = 1.0 + 0.1 * mx.random.normal(layer.norm.weight.shape)
    if fused:
        layer.fuse()
        assert "in_proj" in layer
    layer.set_dtype(dtype, lambda d: mx.issubdtype(d, mx.floating))
    layer.A_log = layer.A_log.astype(mx.float32)
    return layer


def random_states(layer, dtype: mx.Dtype, seed: int = 1) -> list[mx.array]:
    conv, state = layer.initial_states(ROWS)
    mx.random.seed(seed)
    return [mx.random.normal(conv.shape).astype(dtype), 0.1 * mx.random.normal(state.shape)]


def ops_step(layer, x, states, monkeypatch):
    with monkeypatch.context() as patch:
        patch.setenv("MLXCEL_FUSED_DELTA", "0")
        patch.setattr(gated_delta_cuda, "is_available", lambda *a: False)
        return layer.advance(x, states, None)


def emulated_kernel():
    """The kernel's contract in MLX ops: it reads each projection at the template's row stride and
    column, so a wrong column or stride in the wrapper gives other numbers than the ops path."""

    def run(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        t = dict(template)
        qkv, z, b, a, conv_state, conv_w, a_log, dt_bias, norm_w, state, params = inputs
        hk, hv, dk, dv, rows = t["HK"], t["HV"], t["DK"], t["DV"], qkv.shape[0]
        assert grid == (4 * dv, rows * hv, 1) and threadgroup == (4 * dv, 1, 1)

        def columns(array, name, width):
            flat = array.reshape(rows, -1)
            assert flat.shape[1] == t[f"{name}_STRIDE"]
            return flat[:, t[f"{name}_AT"] : t[f"{name}_AT"] + width]

        mixed, new_conv = causal_conv(columns(qkv, "QKV", t["C"])[:, None], conv_state, conv_w, None)
        q, k, v = mx.split(nn.silu(mixed)[:, 0], [hk * dk, 2 * hk * dk], axis=-1)
        q = qwen3_5.l2_normalize(q.reshape(rows, hk, dk), params[0].item()) * dk**-0.5
        k = qwen3_5.l2_normalize(k.reshape(rows, hk, dk), params[0].item())
        q, k = (mx.repeat(x, hv // hk, axis=1) for x in (q, k))
        beta = mx.sigmoid(columns(b, "B", hv).astype(mx.float32))
        g = -mx.exp(a_log) * nn.softplus(columns(a, "A", hv).astype(mx.float32) + dt_bias.astype(mx.float32))
        y, new_state = one_step(q, k, v.reshape(rows, hv, dv), g, beta, state)
        y = y.astype(qkv.dtype)
        normed = mx.fast.rms_norm(y.astype(mx.float32), None, params[1].item()).astype(qkv.dtype) * norm_w
        gate = nn.silu(columns(z, "Z", hv * dv).reshape(rows, hv, dv).astype(mx.float32))
        out = (normed.astype(mx.float32) * gate).astype(qkv.dtype).reshape(rows, 1, hv * dv)
        assert [out.shape, new_conv.shape, new_state.shape] == [tuple(s) for s in output_shapes]
        return out, new_conv.astype(output_dtypes[1]), new_state

    return run


@pytest.mark.parametrize("fused", [False, True], ids=["projections", "fused"])
@pytest.mark.parametrize("family", list(LAYERS))
def test_the_wrapper_hands_each_projection_to_the_kernel(family, fused, monkeypatch, on_the_cpu):
    layer = make_layer(family, fused)
    x = mx.random.normal((ROWS, 1, CONFIG["hidden_size"]))
    states = random_states(layer, mx.float32)
    expected, (conv, state) = ops_step(layer, x, states, monkeypatch)
    monkeypatch.setattr(gated_delta_cuda, "is_available", lambda *a: True)
    monkeypatch.setattr(gated_delta_cuda, "_kernel", emulated_kernel)
    assert layer.has_fused_step()
    out, (fused_conv, fused_state) = layer.advance(x, states, None)
    np.testing.assert_allclose(np.array(out), np.array(expected), atol=1e-5)
    np.testing.assert_allclose(np.array(fused_conv), np.array(conv), atol=0)
    np.testing.assert_allclose(np.array(fused_state), np.array(state), atol=1e-6)


def test_the_kernel_takes_only_head_sizes_its_block_fits():
    assert gated_delta_cuda.fits_block(128, 128, 16, 32)  # Qwen 3.5's layers
    assert gated_delta_cuda.fits_block(16, 16, 2, 4)  # the tiny checkpoints': two warps
    assert not gated_delta_cuda.fits_block(128, 12, 2, 4)  # 4 * 12 threads: not whole warps
    assert not gated_delta_cuda.fits_block(128, 512, 2, 4)  # 2048 threads a block
    assert not gated_delta_cuda.fits_block(130, 128, 2, 4)  # key rows in quarters
    assert not gated_delta_cuda.fits_block(128, 128, 3, 4)  # value heads per key head


def test_the_kernel_is_on_unless_switched_off(monkeypatch):
    monkeypatch.setattr(gated_delta_cuda, "has_cuda_backend", lambda: True)
    monkeypatch.setattr(gated_delta_cuda.mx, "default_device", lambda: gated_delta_cuda.mx.gpu)
    monkeypatch.delenv("MLXCEL_FUSED_DELTA", raising=False)
    assert gated_delta_cuda.is_available(128, 128, 16, 32)
    assert not gated_delta_cuda.is_available(128, 12, 2, 4)
    monkeypatch.setenv("MLXCEL_FUSED_DELTA", "0")
    assert not gated_delta_cuda.is_available(128, 128, 16, 32)


cuda = pytest.mark.skipif(not (mx.default_device() == mx.gpu and has_cuda_backend()), reason="MLX's CUDA backend only")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fused", [False, True], ids=["projections", "fused"])
@pytest.mark.parametrize("family", list(LAYERS))
def test_the_kernel_matches_the_ops_path(family, fused, dtype, monkeypatch):
    """Three decode steps, each from the last step's states, eager and compiled."""
    monkeypatch.setenv("MLXCEL_FUSED_DELTA", "1")
    layer = make_layer(family, fused, dtype)
    compiled = mx.compile(lambda x, conv, state: layer.advance(x, [conv, state], None))
    states = random_states(layer, dtype)
    tolerance = 2e-5 if dtype == mx.float32 else 3e-2
    for _ in range(3):
        x = mx.random.normal((ROWS, 1, CONFIG["hidden_size"])).astype(dtype)
        expected, (conv, state) = ops_step(layer, x, states, monkeypatch)
        for out, (fused_conv, fused_state) in (layer.advance(x, states, None), compiled(x, *states)):
            np.testing.assert_allclose(
                np.array(out.astype(mx.float32)), np.array(expected.astype(mx.float32)), atol=tolerance, rtol=tolerance
            )
            assert mx.array_equal(fused_conv, conv)
            np.testing.assert_allclose(np.array(fused_state), np.array(state), atol=tolerance, rtol=tolerance)
        states = [conv, state]


@pytest.mark.cuda
@cuda
def test_a_model_decodes_the_same_tokens_with_the_kernel(tmp_path, monkeypatch):
    """fp32 on the GPU, the scheduler (segmented step, rows of different lengths): greedy tokens as
    with the ops path."""
    from mlxcel.checkpoints.loader import load_model
    from mlxcel.engine import GenerationRequest, RowRequest
    from mlxcel.engine.scheduler import BatchScheduler
    from mlxcel.sampling import Sampler
    from tests.family_fixtures import PROMPT
    from tests.test_families_qwen3_5 import make_checkpoint

    monkeypatch.setenv("MLXCEL_FUSED_DELTA", "1")
    model = load_model(str(make_checkpoint(tmp_path, "qwen3_5_text")), dtype="float32").model
    layer = next(layer.linear_attn for layer in model.model.layers if layer.is_linear)
    assert layer.has_fused_step()
    prompts = [PROMPT, PROMPT[5:28], PROMPT[:9]]

    def generate() -> list[list[int]]:
        model.__dict__.pop("_mlxcel_decoders", None)  # (segments traced with or without the kernel)
        scheduler = BatchScheduler(model, 512, len(prompts), chunk_size=16)
        rows = [RowRequest(p, row_id=i) for i, p in enumerate(prompts)]
        state = scheduler.generate(GenerationRequest(rows, Sampler("greedy"), max_tokens=16))
        return [r.token_ids for r in state.results]

    with_kernel = generate()
    monkeypatch.setenv("MLXCEL_FUSED_DELTA", "0")
    assert not layer.has_fused_step()
    assert with_kernel == generate()
