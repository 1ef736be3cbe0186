"""The gated delta rule (models/gated_delta.py) against transformers' torch functions (the oracle:
torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule), and its two forms against
each other: any piece size, any split of a prompt, masked positions that leave the state alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.models import gated_delta as gd
from mlxcel.models.recurrent import RecurrentCache, causal_conv, token_mask

torch = pytest.importorskip("torch")

B, HK, HV, DK, DV = 2, 2, 4, 16, 8


def make_inputs(length: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "q": rng.normal(size=(B, length, HK, DK)).astype(np.float32),
        "k": rng.normal(size=(B, length, HK, DK)).astype(np.float32),
        "v": rng.normal(size=(B, length, HV, DV)).astype(np.float32),
        "g": (-np.abs(rng.normal(size=(B, length, HV))) * 0.3).astype(np.float32),
        "beta": (1 / (1 + np.exp(-rng.normal(size=(B, length, HV))))).astype(np.float32),
        "state": (rng.normal(size=(B, HV, DK, DV)) * 0.1).astype(np.float32),
    }


def normalized(x: dict) -> tuple:
    """q and k as the families hand them over: l2-normalized, q scaled by Dk^-0.5 (transformers
    does this inside its functions with use_qk_l2norm_in_kernel)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import l2norm

    q = l2norm(torch.tensor(x["q"])).numpy() * DK**-0.5
    k = l2norm(torch.tensor(x["k"])).numpy()
    return q, k


def reference(x: dict, chunked: bool = True) -> tuple[np.ndarray, np.ndarray]:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as oracle

    run = oracle.torch_chunk_gated_delta_rule if chunked else oracle.torch_recurrent_gated_delta_rule
    t = {name: torch.tensor(value) for name, value in x.items()}
    y, state = run(
        t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["state"], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return y.numpy(), state.numpy()


def ours(x: dict, start: int = 0, end: int | None = None, state=None, form=gd.gated_delta):
    q, k = normalized(x)
    parts = [a[:, start:end] for a in (q, k, x["v"], x["g"], x["beta"])]
    y, new_state = form(*(mx.array(a) for a in parts), mx.array(x["state"]) if state is None else state)
    return np.array(y), new_state


@pytest.mark.parametrize("length", [1, 5, 64, 150])
@pytest.mark.parametrize("form", [gd.chunked, gd.recurrent], ids=["chunked", "recurrent"])
def test_both_forms_equal_transformers(length, form):
    x = make_inputs(length)
    expected_y, expected_state = reference(x, chunked=length > 1)
    y, state = ours(x, form=form)
    assert np.abs(y - expected_y).max() <= 1e-5
    assert np.abs(np.array(state) - expected_state).max() <= 1e-5


@pytest.mark.parametrize("cuts", [(37,), (1, 2, 3), (64,), (63, 65, 128), (10, 100)])
def test_any_split_of_a_prompt_gives_the_one_shot_numbers(cuts):
    x = make_inputs(150, seed=1)
    expected_y, expected_state = reference(x)
    bounds = [0, *cuts, 150]
    ys, state = [], None
    for start, end in zip(bounds, bounds[1:]):
        y, state = ours(x, start, end, state)
        ys.append(y)
    assert np.abs(np.concatenate(ys, axis=1) - expected_y).max() <= 1e-4
    assert np.abs(np.array(state) - expected_state).max() <= 1e-4


@pytest.mark.parametrize("length", [3, 70])
def test_masked_positions_leave_the_state_as_it_was(length):
    """Row 0's first positions masked (padding before its tokens) in both forms: its state and
    later outputs are those of its own tokens alone."""
    x = make_inputs(length, seed=2)
    lead = 2
    mask = np.ones((B, length), dtype=bool)
    mask[0, :lead] = False
    q, k = normalized(x)
    y, state = gd.gated_delta(
        *(mx.array(a) for a in (q, k, x["v"], x["g"], x["beta"])), mx.array(x["state"]), mx.array(mask)
    )
    alone_y, alone_state = gd.gated_delta(
        *(mx.array(a[:1, lead:]) for a in (q, k, x["v"], x["g"], x["beta"])), mx.array(x["state"][:1])
    )
    assert np.abs(np.array(state[:1]) - np.array(alone_state)).max() <= 1e-5
    assert np.abs(np.array(y[:1, lead:]) - np.array(alone_y)).max() <= 1e-5


def test_the_convolution_keeps_its_window_across_a_rows_leads():
    """causal_conv with leads: each row's own tokens see its state and its earlier tokens, as if the
    row ran alone (torch's conv1d over the same sequence is the reference)."""
    rng = np.random.default_rng(3)
    channels, kernel, length = 6, 4, 9
    weight = rng.normal(size=(channels, kernel, 1)).astype(np.float32)
    state = rng.normal(size=(2, kernel - 1, channels)).astype(np.float32)
    x = rng.normal(size=(2, length, channels)).astype(np.float32)
    leads = np.array([3, 0])
    x[0, :3] = 0
    out, new_state = causal_conv(mx.array(x), mx.array(state), mx.array(weight), leads)
    for row, lead in enumerate(leads):
        sequence = np.concatenate([state[row], x[row, lead:]])  # [K-1 + own, C]
        expected = torch.nn.functional.conv1d(
            torch.tensor(sequence.T[None]), torch.tensor(weight.transpose(0, 2, 1)), groups=channels
        )[0].T.numpy()
        assert np.abs(np.array(out[row, lead:]) - expected).max() <= 1e-5
        assert np.abs(np.array(new_state[row]) - sequence[-(kernel - 1) :]).max() == 0


def test_a_left_padded_batch_masks_only_its_first_piece():
    cache = RecurrentCache(2, mx.array([2, 0]))
    states, leads = cache.read(lambda rows: [mx.zeros((rows, 1))])
    assert leads.tolist() == [2, 0] and np.array(token_mask(leads, 4)).tolist() == [
        [False, False, True, True],
        [True, True, True, True],
    ]
    cache.write(states, 4)
    assert cache.read(lambda rows: [])[1] is None  # the padding is behind it
    with pytest.raises(ValueError):
        cache.trim(1)


def test_the_compiled_step_equals_the_eager_one_at_every_batch_size():
    """The GPU's decode step is one_step compiled shapeless (traced once for every batch size): its
    numbers are the eager step's for batches of different sizes, one after another."""
    rng = np.random.default_rng(5)
    for rows in (1, 3, 8, 2):
        q, k = (mx.array(rng.normal(size=(rows, 4, 8)).astype(np.float32)) for _ in range(2))
        v = mx.array(rng.normal(size=(rows, 4, 16)).astype(np.float32))
        g = mx.array(-rng.uniform(size=(rows, 4)).astype(np.float32))
        beta = mx.array(rng.uniform(size=(rows, 4)).astype(np.float32))
        state = mx.array(rng.normal(size=(rows, 4, 8, 16)).astype(np.float32))
        for got, want in zip(gd.compiled_step(q, k, v, g, beta, state), gd.one_step(q, k, v, g, beta, state)):
            assert got.shape == want.shape
            np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-6)


@pytest.mark.parametrize("length", [64, 150])
def test_the_compiled_chunked_form_equals_the_eager_one(length):
    """The GPU's prefill form is chunked compiled (traced once per piece shape): the eager form's
    numbers, with a row's leading padding masked, for two shapes one after another."""
    x = make_inputs(length, seed=3)
    q, k = normalized(x)
    mask = mx.array(np.arange(length)[None, :] >= np.array([[0], [length // 3]]))  # row 1: left padding
    args = [mx.array(a) for a in (q, k, x["v"], x["g"], x["beta"])]
    args[1], args[3], args[4] = gd.apply_mask(args[1], args[3], args[4], mask)
    for got, want in zip(gd.compiled_chunked(*args, mx.array(x["state"])), gd.chunked(*args, mx.array(x["state"]))):
        assert got.shape == want.shape
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6)


def test_pieces_compile_on_a_gpu_only_when_switched_on(monkeypatch):
    from mlxcel.models.recurrent import compiles_pieces

    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.delenv("MLXCEL_COMPILED_PIECES", raising=False)
    assert not compiles_pieces()  # tracing each of a job's piece shapes cost more than it saved
    monkeypatch.setenv("MLXCEL_COMPILED_PIECES", "1")
    assert compiles_pieces()
    monkeypatch.setattr(mx, "default_device", lambda: mx.cpu)
    assert not compiles_pieces()
