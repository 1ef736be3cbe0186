"""The segmented decode step (compiled between attentions) computes what the eager step computes,
for every family that takes part, at batch 1 and in left-padded batches (fp32, CPU)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxcel.checkpoints.loader import load_model
from mlxcel.engine import DirectEngine
from mlxcel.engine.segmented import SegmentedDecoder
from tests.family_fixtures import PROMPT, make_family_checkpoint, mlxcel_generate

pytest.importorskip("torch")

BATCH = [PROMPT, PROMPT[5:28], PROMPT[:9]]
STEPS = 24  # the sliding-window fixtures (window 16) wrap their ring buffers in this many


def prefill(model, prompts: list[list[int]]):
    length = max(map(len, prompts))
    left_pad = [length - len(p) for p in prompts]
    cache = model.make_cache(len(prompts), left_pad)
    tokens = mx.array([[0] * pad + p for pad, p in zip(left_pad, prompts)])
    return model(tokens, cache, logits_at=length - 1)[:, -1, :], cache


def decode_both_ways(model, prompts: list[list[int]]) -> tuple[float, list, list]:
    """Greedy steps from the same prefill, eager and segmented; the largest logit gap seen."""
    decoder = SegmentedDecoder(model)
    first, eager_cache = prefill(model, prompts)
    _, segmented_cache = prefill(model, prompts)
    token = mx.argmax(first, axis=-1)
    worst, eager_ids, segmented_ids = 0.0, [], []
    for _ in range(STEPS):
        eager = model(token[:, None], eager_cache)[:, -1, :]
        segmented = decoder(token, segmented_cache)
        worst = max(worst, float(mx.abs(eager - segmented).max()))
        eager_ids.append(mx.argmax(eager, axis=-1).tolist())
        segmented_ids.append(mx.argmax(segmented, axis=-1).tolist())
        token = mx.argmax(eager, axis=-1)  # both follow the same tokens
    return worst, eager_ids, segmented_ids


@pytest.fixture(
    scope="module", params=["llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "mixtral", "qwen3_moe"]
)
def family_model(request, tmp_path_factory):
    from tests.helpers import make_tiny_checkpoint

    folder = tmp_path_factory.mktemp(f"seg_{request.param}")
    if request.param in ("llama", "qwen2"):
        make_tiny_checkpoint(folder, request.param, seed=3)
    else:
        make_family_checkpoint(folder, request.param, seed=3)
    return load_model(str(folder), dtype="float32").model


@pytest.mark.parametrize("prompts", [BATCH[:1], BATCH], ids=["batch1", "left_padded"])
def test_segmented_step_gives_the_eager_logits(family_model, prompts):
    worst, eager_ids, segmented_ids = decode_both_ways(family_model, prompts)
    assert worst <= 1e-4, worst
    assert segmented_ids == eager_ids


def test_engine_uses_the_segmented_step_where_asked(family_model, monkeypatch):
    eager = mlxcel_generate(family_model, BATCH, 16)
    monkeypatch.setenv("MLXCEL_DECODE_STEP", "segmented")
    engine = DirectEngine(family_model, 512).engine
    assert isinstance(engine.decoder, SegmentedDecoder)
    assert mlxcel_generate(family_model, BATCH, 16) == eager


def test_unknown_decode_step_is_a_clear_error(tiny_llama, monkeypatch):
    from mlxcel.errors import MlxcelError

    monkeypatch.setenv("MLXCEL_DECODE_STEP", "fast")
    with pytest.raises(
        MlxcelError, match=r"MLXCEL_DECODE_STEP: environment variable: must be one of eager, segmented, compiled"
    ):
        DirectEngine(load_model(str(tiny_llama), dtype="float32").model, 512)
