"""Mamba-2's selective state-space update (SSD: Nemotron-H, Granite 4), in plain MLX.

Per head h, the state S [P, N] (head_dim x state size) decays by exp(dt * A), takes the token's
input x (scaled by dt) along its B, and the token reads it along its C; D adds the input back:

    S = exp(dt A) S + dt x B^T;   y = S C + D x

Two forms compute it. `recurrent`: token by token (a decode step is one token). `chunked`: a
prefill piece in chunks of `chunk` tokens, each chunk's tokens together (its within-chunk part is
a causal "attention" C_i . B_j exp(cum_i - cum_j) dt_j, the rest comes from the chunk's start
state), then one state update a chunk. Both take any state and give the same numbers to rounding,
so a prompt may be cut anywhere. Masked positions (a row's padding) leave the state as it was:
their dt is zeroed, which makes their update the identity (no decay, nothing written).

Shapes: x [B, L, H, P]; dt [B, L, H] (discretised: discretize_dt); A [H] (negative: -exp(A_log));
B, C [B, L, G, N]; D [H]; state [B, H, P, N], float32. H is a multiple of G: each group's B and C
serve H / G consecutive heads.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxcel.models.recurrent import compiles_pieces

CHUNK = 64  # tokens a chunk: the within-chunk matrices are CHUNK x CHUNK
RECURRENT_BELOW = 8  # pieces shorter than this run token by token (a chunk's fixed cost is not worth it)


def discretize_dt(dt: mx.array, dt_bias: mx.array, limit: tuple[float, float]) -> mx.array:
    """softplus(dt + dt_bias) clipped to `limit` (time_step_limit), in float32."""
    dt = nn.softplus(dt.astype(mx.float32) + dt_bias.astype(mx.float32))
    low, high = limit
    if low > 0 or high != float("inf"):
        dt = mx.clip(dt, low, high)
    return dt


def ssd(
    x: mx.array,
    dt: mx.array,
    A: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array | None,
    state: mx.array,
    mask: mx.array | None = None,
    chunk: int = CHUNK,
) -> tuple[mx.array, mx.array]:
    """(y [B, L, H, P] in x's dtype, the state after the last token), by whichever form suits L.
    `mask` [B, L]: False where a position is not the row's own (its dt is zeroed)."""
    if mask is not None:
        dt = mx.where(mask[..., None], dt, 0)
    if x.shape[1] < RECURRENT_BELOW:
        return recurrent(x, dt, A, B, C, D, state)
    return (compiled_chunked if compiles_pieces() else chunked)(x, dt, A, B, C, D, state, chunk)


def by_group(x: mx.array, groups: int) -> mx.array:
    """[B, L, H, ...] -> [B, G, H / G, L, ...]: heads split by the group whose B and C they read."""
    b, length, heads = x.shape[:3]
    moved = mx.moveaxis(x, 1, 2)  # [B, H, L, ...]
    return moved.reshape(b, groups, heads // groups, length, *x.shape[3:])


def recurrent(
    x: mx.array, dt: mx.array, A: mx.array, B: mx.array, C: mx.array, D: mx.array | None, state: mx.array
) -> tuple[mx.array, mx.array]:
    """Token by token (decode; short pieces)."""
    heads, dtype = x.shape[2], x.dtype
    repeat = heads // B.shape[2]
    B, C = (v if repeat == 1 else mx.repeat(v, repeat, axis=2) for v in (B, C))  # each head's B and C
    step = compiled_step if mx.default_device() == mx.gpu else one_step
    A = A.astype(mx.float32)
    ys = []
    for t in range(x.shape[1]):
        y, state = step(x[:, t], dt[:, t], A, B[:, t], C[:, t], state)
        ys.append(y)
    y = ys[0][:, None] if len(ys) == 1 else mx.stack(ys, axis=1)
    if D is not None:
        y = y + x.astype(mx.float32) * D.astype(mx.float32)[:, None]
    return y.astype(dtype), state


def one_step(
    x: mx.array, dt: mx.array, A: mx.array, B: mx.array, C: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """One token: x [B, H, P], dt [B, H], A [H], B and C [B, H, N] (per head); (S C [B, H, P] fp32, S)."""
    x, dt = x.astype(mx.float32), dt.astype(mx.float32)
    written = (x * dt[..., None])[..., None] * B.astype(mx.float32)[..., None, :]  # dt x B^T: [B, H, P, N]
    state = state * mx.exp(dt * A)[..., None, None] + written
    return (state * C.astype(mx.float32)[..., None, :]).sum(axis=-1), state


# On a GPU the step's elementwise ops are one kernel chain: a decode step is bound by the host's
# per-op cost there. (The CPU would compile with the system's C++ compiler, for no gain.)
compiled_step = mx.compile(one_step, shapeless=True)


def chunked(
    x: mx.array,
    dt: mx.array,
    A: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array | None,
    state: mx.array,
    chunk: int = CHUNK,
) -> tuple[mx.array, mx.array]:
    """`chunk` tokens at a time. The piece is padded to whole chunks with tokens that do nothing
    (dt zero)."""
    batch, length, heads, head_dim = x.shape
    groups, size = B.shape[2:]
    dtype = x.dtype
    pad = -length % chunk
    x, dt, B, C = (v.astype(mx.float32) for v in (x, dt, B, C))
    skip = None if D is None else x * D.astype(mx.float32)[:, None]
    if pad:
        x, B, C = (mx.pad(v, [(0, 0), (0, pad), (0, 0), (0, 0)]) for v in (x, B, C))
        dt = mx.pad(dt, [(0, 0), (0, pad), (0, 0)])
    chunks = (length + pad) // chunk
    # heads by group, the sequence in chunks: x [B, G, R, c, T, P]; dt [B, G, R, c, T]; B, C [B, G, 1, c, T, N]
    xs = by_group(x, groups).reshape(batch, groups, -1, chunks, chunk, head_dim)
    dts = by_group(dt, groups).reshape(batch, groups, -1, chunks, chunk)
    Bs, Cs = (mx.moveaxis(v, 1, 2).reshape(batch, groups, 1, chunks, chunk, size) for v in (B, C))

    log_decay = dts * A.astype(mx.float32).reshape(1, groups, -1, 1, 1)  # dt A: [B, G, R, c, T]
    cum = mx.cumsum(log_decay, axis=-1)  # log decay from the chunk's start to each token
    lower = mx.tril(mx.ones((chunk, chunk), dtype=mx.bool_))
    # decay from token j to a later token i of one chunk (zero above the diagonal): dt A summed over
    # (j, i] as such. cum_i - cum_j loses digits where the decay is strong (cum in the hundreds):
    # 30x the recurrence's error in fp32.
    segment = mx.cumsum(mx.where(mx.tril(lower, -1), log_decay[..., :, None], 0), axis=-2)
    pairwise = mx.where(lower, mx.exp(segment), 0)
    scores = (Cs @ Bs.swapaxes(-1, -2)) * pairwise * dts[..., None, :]  # [B, G, R, c, T, T]
    within = scores @ xs  # each token's output from its own chunk
    # weight of token j in its chunk's final state: its dt, decayed over (j, end]
    to_end = mx.exp(mx.cumsum(log_decay, axis=-1, reverse=True, inclusive=False)) * dts
    written = (xs * to_end[..., None]).swapaxes(-1, -2) @ Bs  # [B, G, R, c, P, N]
    chunk_decay = mx.exp(cum[..., -1])[..., None, None]  # [B, G, R, c, 1, 1]
    from_start = mx.exp(cum)[..., None]  # [B, G, R, c, T, 1]

    state = state.reshape(batch, groups, -1, head_dim, size).astype(mx.float32)
    outs = []
    for c in range(chunks):
        # what each token reads of the chunk's start state: (S C_i) decayed to i
        outs.append(within[:, :, :, c] + from_start[:, :, :, c] * (Cs[:, :, :, c] @ state.swapaxes(-1, -2)))
        state = state * chunk_decay[:, :, :, c] + written[:, :, :, c]
    y = outs[0] if chunks == 1 else mx.concatenate(outs, axis=3)  # [B, G, R, L + pad, P]
    y = mx.moveaxis(y.reshape(batch, heads, length + pad, head_dim), 2, 1)[:, :length]
    if skip is not None:
        y = y + skip
    return y.astype(dtype), state.reshape(batch, heads, head_dim, size)


# on a GPU (recurrent.compiles_pieces); not shapeless: the chunk count is the loop's length
compiled_chunked = mx.compile(chunked)
