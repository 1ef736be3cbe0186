"""Mamba-2's state-space update (mlxcel/models/ssd.py) against transformers' torch fallback
(modeling_nemotron_h's mamba2_chunk_scan and mamba2_selective_state_update) and against itself:
the chunked form equals the token-by-token one from any state, a prompt cut anywhere gives the
same outputs and state, and masked positions leave the state as it was."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.models import ssd

torch = pytest.importorskip("torch")
nemotron_h = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")

BATCH, LENGTH, HEADS, HEAD_DIM, GROUPS, STATE = 2, 45, 4, 8, 2, 16
CHUNK = 16  # small, so a 45-token prompt spans three chunks, the last one partial
TOLERANCE = 1e-4
NO_LIMIT = (0.0, float("inf"))


@pytest.fixture(scope="module")
def inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(BATCH, LENGTH, HEADS, HEAD_DIM)).astype(np.float32),
        "dt": rng.normal(size=(BATCH, LENGTH, HEADS)).astype(np.float32),
        "B": (rng.normal(size=(BATCH, LENGTH, GROUPS, STATE)) * 0.5).astype(np.float32),
        "C": (rng.normal(size=(BATCH, LENGTH, GROUPS, STATE)) * 0.5).astype(np.float32),
        "A": -np.exp(np.log(np.arange(1, HEADS + 1)) * 0.5).astype(np.float32),
        "D": rng.normal(size=(HEADS,)).astype(np.float32),
        "dt_bias": rng.normal(size=(HEADS,)).astype(np.float32),
        "state": rng.normal(size=(BATCH, HEADS, HEAD_DIM, STATE)).astype(np.float32),
    }


def run_ours(inputs, form, start: int = 0, end: int = LENGTH, state=None, mask=None):
    """y and the state after positions [start, end), from `state` (the inputs' initial one if None)."""
    piece = {k: mx.array(inputs[k][:, start:end]) for k in ("x", "dt", "B", "C")}
    dt = ssd.discretize_dt(piece["dt"], mx.array(inputs["dt_bias"]), NO_LIMIT)
    state = mx.array(inputs["state"]) if state is None else state
    args = (piece["x"], dt, mx.array(inputs["A"]), piece["B"], piece["C"], mx.array(inputs["D"]), state)
    if form == "chunked":
        return ssd.chunked(*args, chunk=CHUNK)
    if form == "recurrent":
        return ssd.recurrent(*args)
    return ssd.ssd(*args, mask=mask, chunk=CHUNK)


def reference_chunked(inputs) -> tuple[np.ndarray, np.ndarray]:
    t = {k: torch.tensor(v) for k, v in inputs.items()}
    y, state = nemotron_h.mamba2_chunk_scan(
        t["x"],
        t["dt"],
        t["A"],
        t["B"],
        t["C"],
        chunk_size=CHUNK,
        D=t["D"],
        dt_bias=t["dt_bias"],
        initial_states=t["state"],
        dt_softplus=True,
        return_final_states=True,
    )
    return y.numpy(), state.numpy()


def reference_recurrent(inputs) -> tuple[np.ndarray, np.ndarray]:
    """transformers' decode step, one token at a time (it updates `state` in place)."""
    t = {k: torch.tensor(v) for k, v in inputs.items()}
    state, ys = t["state"].clone(), []
    for i in range(LENGTH):
        ys.append(
            nemotron_h.mamba2_selective_state_update(
                state,
                t["x"][:, i],
                t["dt"][:, i, :, None].expand(-1, -1, HEAD_DIM),
                t["A"][:, None, None].expand(-1, HEAD_DIM, STATE),
                t["B"][:, i],
                t["C"][:, i],
                t["D"][:, None].expand(-1, HEAD_DIM),
                dt_bias=t["dt_bias"][:, None].expand(-1, HEAD_DIM),
                dt_softplus=True,
            )
        )
    return torch.stack(ys, dim=1).numpy(), state.numpy()


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_matches_transformers_chunk_scan(inputs, form):
    y_ref, state_ref = reference_chunked(inputs)
    y, state = run_ours(inputs, form)
    assert max_diff(y, y_ref) <= TOLERANCE
    assert max_diff(state, state_ref) <= TOLERANCE


def test_recurrent_matches_transformers_decode_step(inputs):
    y_ref, state_ref = reference_recurrent(inputs)
    y, state = run_ours(inputs, "recurrent")
    assert max_diff(y, y_ref) <= TOLERANCE
    assert max_diff(state, state_ref) <= TOLERANCE


@pytest.mark.parametrize("cuts", [[1], [7], [8], [16], [17, 33], [3, 4, 5, 30], list(range(1, LENGTH))])
def test_any_split_gives_one_shot(inputs, cuts):
    """Pieces of any size (short ones token by token, the rest chunked, cut inside and on chunk
    boundaries) carry the state from one to the next: the outputs and final state of one shot."""
    y_one, state_one = run_ours(inputs, "recurrent")
    state, ys = None, []
    for start, end in zip([0, *cuts], [*cuts, LENGTH]):
        y, state = run_ours(inputs, "auto", start, end, state)
        ys.append(y)
    assert max_diff(mx.concatenate(ys, axis=1), y_one) <= TOLERANCE
    assert max_diff(state, state_one) <= TOLERANCE


@pytest.mark.parametrize("length", [5, 30])  # the recurrent form, then the chunked one
def test_masked_positions_leave_the_state(inputs, length):
    """Row 0's first 3 positions and row 1's first 11 are not its own (left padding): each row's
    state and own outputs are those of its own tokens alone."""
    leads = [3, 11] if length > 11 else [3, 1]
    mask = mx.array(np.arange(length)[None, :] >= np.array(leads)[:, None])
    y, state = run_ours(inputs, "auto", 0, length, mask=mask)
    for row, lead in enumerate(leads):
        alone = {**inputs, "state": inputs["state"][row : row + 1]}
        alone.update({k: inputs[k][row : row + 1, lead:] for k in ("x", "dt", "B", "C")})
        y_alone, state_alone = run_ours(alone, "recurrent", 0, length - lead)
        assert max_diff(state[row], state_alone[0]) <= TOLERANCE
        assert max_diff(y[row, lead:], y_alone[0]) <= TOLERANCE


def test_all_masked_keeps_the_state_exactly(inputs):
    """A call where the row has no token of its own returns its state bit for bit."""
    for length in (3, 20):
        mask = mx.zeros((BATCH, length), dtype=mx.bool_)
        _, state = run_ours(inputs, "auto", 0, length, mask=mask)
        assert np.array_equal(np.array(state), inputs["state"])


def test_time_step_limit_clips(inputs):
    dt = ssd.discretize_dt(mx.array(inputs["dt"]), mx.array(inputs["dt_bias"]), (0.2, 0.5))
    assert float(dt.min()) >= 0.2 and float(dt.max()) <= 0.5


def test_the_compiled_decode_step_equals_the_plain_one_at_any_batch():
    """The GPU's decode step is compiled shapeless: rows joining and leaving change its batch."""
    rng = np.random.default_rng(1)
    for rows in (1, 3, 2):
        args = [
            rng.normal(size=(rows, HEADS, HEAD_DIM)),
            rng.uniform(size=(rows, HEADS)),
            -np.arange(1, HEADS + 1),
            rng.normal(size=(rows, HEADS, STATE)),
            rng.normal(size=(rows, HEADS, STATE)),
            rng.normal(size=(rows, HEADS, HEAD_DIM, STATE)),
        ]
        args = [mx.array(np.asarray(a, dtype=np.float32)) for a in args]
        for plain, compiled in zip(ssd.one_step(*args), ssd.compiled_step(*args)):
            assert max_diff(plain, compiled) <= 1e-6


def test_strong_decay_keeps_the_recurrences_precision():
    """Tokens with a strong decay early in a chunk (dt A down to -600): the chunked form sums each
    span's decay as such, not as a difference of cumulative sums in the hundreds, and stays as
    close to a float64 recurrence as the token-by-token form (differences: 2e-4 off, 30x)."""
    rng = np.random.default_rng(3)
    length = 2 * ssd.CHUNK
    x = rng.normal(size=(1, length, HEADS, HEAD_DIM))
    B, C = (rng.normal(size=(1, length, GROUPS, STATE)) * 0.5 for _ in range(2))
    dt = np.full((1, length, HEADS), 0.01)
    dt[:, :: ssd.CHUNK], dt[:, 1 :: ssd.CHUNK] = 5.0, 3.0
    A, state = -np.array([1.0, 20.0, 60.0, 120.0]), rng.normal(size=(1, HEADS, HEAD_DIM, STATE))
    expected, s = [], state.copy()
    B_heads, C_heads = (np.repeat(v, HEADS // GROUPS, axis=2) for v in (B, C))
    for t in range(length):
        written = (x[:, t] * dt[:, t, :, None])[..., None] * B_heads[:, t, :, None, :]
        s = s * np.exp(dt[:, t] * A)[..., None, None] + written
        expected.append((s * C_heads[:, t, :, None, :]).sum(-1))
    args = [mx.array(np.asarray(v, dtype=np.float32)) for v in (x, dt, A, B, C, np.zeros(HEADS), state)]
    for form in (ssd.chunked, ssd.recurrent):
        y, final = form(*args)
        assert max_diff(y, np.stack(expected, axis=1)) <= 5e-5, form.__name__
        assert max_diff(final, s) <= 1e-5, form.__name__


def test_the_compiled_chunked_form_equals_the_plain_one(inputs):
    """The GPU's prefill form is chunked compiled per piece shape: the plain form's numbers, for
    two piece lengths one after another, with the skip term D and without it."""
    for end, skip in ((LENGTH, mx.array(inputs["D"])), (LENGTH // 2 + 3, mx.array(inputs["D"])), (LENGTH, None)):
        piece = {k: mx.array(inputs[k][:, :end]) for k in ("x", "dt", "B", "C")}
        dt = ssd.discretize_dt(piece["dt"], mx.array(inputs["dt_bias"]), NO_LIMIT)
        args = (piece["x"], dt, mx.array(inputs["A"]), piece["B"], piece["C"], skip)
        state = mx.array(inputs["state"])
        plain = ssd.chunked(*args, state, chunk=CHUNK)
        compiled = ssd.compiled_chunked(*args, state, CHUNK)
        for a, b in zip(plain, compiled):
            assert a.shape == b.shape and max_diff(a, b) <= 1e-5
