"""RoPE scaling in base.RoPE against transformers' own tables (the oracle): YaRN's frequencies and
attention factor, applied to the rotated part of a head only (partial rotary), as transformers
scales cos and sin."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.models.base import RoPE, make_yarn_rope_freqs

torch = pytest.importorskip("torch")

YARN = [
    {"factor": 4.0, "original_max_position_embeddings": 4096},
    {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.7, "original_max_position_embeddings": 4096},
]


def transformers_yarn(params: dict, head_dim: int, partial: float = 1.0):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "partial_rotary_factor": partial, **params}
    config = LlamaConfig(hidden_size=8 * head_dim, num_attention_heads=8, max_position_embeddings=131072)
    config.rope_parameters = rope
    return ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")


@pytest.mark.parametrize("params", YARN)
def test_yarn_frequencies_and_attention_factor_equal_transformers(params):
    inverse, factor = transformers_yarn(params, 64)
    wavelengths, ours = make_yarn_rope_freqs(64, 150000.0, {"rope_type": "yarn", **params}, 131072)
    np.testing.assert_allclose(1 / np.array(wavelengths), inverse.numpy(), rtol=1e-6)
    assert ours == pytest.approx(factor)


def test_yarn_rotates_and_scales_the_rotated_dimensions_only():
    """A head of 32 whose first 16 dimensions turn (partial rotary): transformers' cos/sin at
    positions 0..5, scaled by the attention factor, against RoPE(16, yarn) on the same head."""
    from transformers.models.llama.modeling_llama import rotate_half

    params = YARN[1]
    inverse, factor = transformers_yarn(params, 32, partial=0.5)
    positions = torch.arange(6, dtype=torch.float32)
    angles = positions[:, None] * inverse[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos() * factor, emb.sin() * factor
    x = torch.randn(1, 2, 6, 32)
    rotated, kept = x[..., :16], x[..., 16:]
    expected = torch.cat([rotated * cos + rotate_half(rotated) * sin, kept], dim=-1)
    rope = RoPE(16, 150000.0, scaling={"rope_type": "yarn", **params}, max_position_embeddings=131072)
    got = rope(mx.array(x.numpy()))
    np.testing.assert_allclose(np.array(got), expected.numpy(), atol=1e-5)
