"""The gated delta rule (Gated DeltaNet: Qwen 3.5, Qwen3-Next), in plain MLX.

Per value head, the state S [Dk, Dv] decays by exp(g), then takes the delta rule's correction for
the token's key and value, and the token reads it with its query:

    S = exp(g) * S;   S += k (beta * (v - k^T S));   y = q^T S

Two forms compute it. `recurrent`: token by token (a decode step is one token). `chunked`: a
prefill piece in chunks of CHUNK tokens, each chunk's tokens together in a few matmuls (the WY / UT
transform of the DeltaNet papers, as transformers' torch_chunk_gated_delta_rule writes it), then one
state update a chunk. Both take any state and give the same numbers to rounding, so a prompt may be
cut anywhere. Masked positions (a row's padding) leave the state as it was: their k, beta and g
are zeroed, which makes their update the identity in both forms.

Shapes: q, k [B, L, Hk, Dk] (q already scaled by Dk^-0.5, both l2-normalised where the family
does); v [B, L, Hv, Dv]; g (log decay, <= 0) and beta [B, L, Hv]; state [B, Hv, Dk, Dv], float32.
Hv is a multiple of Hk: each query/key head serves Hv / Hk consecutive value heads.
"""

from __future__ import annotations

import mlx.core as mx

from mlxcel.models.recurrent import compiles_pieces

CHUNK = 64  # tokens a chunk: the within-chunk matrices are CHUNK x CHUNK
RECURRENT_BELOW = 8  # pieces shorter than this run token by token (a chunk's fixed cost is not worth it)


def gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """(y [B, L, Hv, Dv] in v's dtype, the state after the last token), by whichever form suits L."""
    if mask is not None:
        k, g, beta = apply_mask(k, g, beta, mask)
    if q.shape[1] < RECURRENT_BELOW:
        return recurrent(q, k, v, g, beta, state)
    return (compiled_chunked if compiles_pieces() else chunked)(q, k, v, g, beta, state)


def apply_mask(k: mx.array, g: mx.array, beta: mx.array, mask: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Zero k, g and beta where mask [B, L] is False: those tokens neither decay nor write the state."""
    keep = mask.astype(g.dtype)
    return k * mask[..., None, None].astype(k.dtype), g * keep[..., None], beta * mask[..., None].astype(beta.dtype)


def expand_heads(x: mx.array, heads: int) -> mx.array:
    """[B, L, Hk, D] -> [B, L, heads, D]: each key head repeated for its value heads."""
    repeat = heads // x.shape[2]
    return x if repeat == 1 else mx.repeat(x, repeat, axis=2)


def recurrent(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """Token by token (decode; short pieces)."""
    heads, dtype = v.shape[2], v.dtype
    q, k = (expand_heads(x, heads) for x in (q, k))
    step = compiled_step if mx.default_device() == mx.gpu else one_step
    ys = []
    for t in range(q.shape[1]):
        y, state = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
    y = ys[0][:, None] if len(ys) == 1 else mx.stack(ys, axis=1)
    return y.astype(dtype), state


def one_step(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """One token: q, k [B, H, Dk], v [B, H, Dv], g and beta [B, H]; (y [B, H, Dv] fp32, state).

    The state is read twice and written once, the least a step can: one matmul reads both
    S^T q and S^T k from the old state, and the output follows from them without reading the new
    one (y = S'^T q = e^g S^T q + (k . q) delta, with S' = e^g S + k delta^T). At 256 decoding
    rows a layer's state is ~270 MB (Qwen 3.5), so each pass over it costs the step."""
    q, k, v = q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32)
    decay = mx.exp(g.astype(mx.float32))[..., None]  # [B, H, 1]
    read = mx.stack([q, k], axis=-2) @ state  # [B, H, 2, Dv]: q^T S and k^T S
    # (rows picked by a sum against one-hot weights: a shapeless compile cannot slice)
    read_q, read_k = ((read * mx.array(pick, mx.float32)[:, None]).sum(axis=-2) for pick in ([1, 0], [0, 1]))
    delta = (v - decay * read_k) * beta.astype(mx.float32)[..., None]
    y = decay * read_q + (k * q).sum(axis=-1, keepdims=True) * delta
    return y, state * decay[..., None] + k[..., None] * delta[..., None, :]


# On a GPU the step's dozen elementwise ops are one kernel chain: a decode step is bound by the
# host's per-op cost there. (The CPU would compile with the system's C++ compiler, for no gain.)
compiled_step = mx.compile(one_step, shapeless=True)


def invert_unit_lower(strict: mx.array) -> mx.array:
    """(I + N)^-1 for N strictly lower triangular [.., C, C] (so N^C = 0): the finite Neumann series
    sum (-N)^i as the product (I - N)(I + N^2)(I + N^4)..., log2(C) squarings; no triangular solve
    (MLX has it on the CPU only)."""
    size = strict.shape[-1]
    eye = mx.eye(size, dtype=strict.dtype)
    power = -strict
    inverse = eye + power
    span = 2
    while span < size:
        power = power @ power
        inverse = inverse @ (eye + power)
        span *= 2
    return inverse


def chunked(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """CHUNK tokens at a time. The piece is padded to whole chunks with tokens that do nothing
    (k, g, beta zero)."""
    B, L = k.shape[:2]
    heads, dtype = v.shape[2], v.dtype
    pad = -L % CHUNK
    # [B, H, L, D] in float32, as the reference computes
    q, k = (expand_heads(x, heads).astype(mx.float32).transpose(0, 2, 1, 3) for x in (q, k))
    v = v.astype(mx.float32).transpose(0, 2, 1, 3)
    g, beta = (x.astype(mx.float32).transpose(0, 2, 1) for x in (g, beta))  # [B, H, L]
    if pad:
        q, k, v = (mx.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)]) for x in (q, k, v))
        g, beta = (mx.pad(x, [(0, 0), (0, 0), (0, pad)]) for x in (g, beta))
    chunks = (L + pad) // CHUNK
    q, k, v = (x.reshape(B, heads, chunks, CHUNK, -1) for x in (q, k, v))
    g, beta = (x.reshape(B, heads, chunks, CHUNK) for x in (g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]

    cum = mx.cumsum(g, axis=-1)  # log decay from the chunk's start to each token
    lower = mx.tril(mx.ones((CHUNK, CHUNK), dtype=mx.bool_))
    strictly_lower = mx.tril(lower, -1)
    # decay between token j and a later token i of one chunk (zero above the diagonal): the sum of
    # g over (j, i], summed as such. cum_i - cum_j loses digits where the decay is strong (cum in
    # the hundreds): 50x the recurrence's error in fp32, which a prompt cut elsewhere shows.
    segment = mx.cumsum(mx.where(strictly_lower, g[..., :, None], 0), axis=-2)
    pairwise = mx.where(lower, mx.exp(segment), 0)
    strict = mx.where(strictly_lower, (k_beta @ k.swapaxes(-1, -2)) * pairwise, 0)
    solve = invert_unit_lower(strict)
    new_values = solve @ v_beta  # the delta rule's targets within the chunk ("u")
    k_cumdecay = solve @ (k_beta * mx.exp(cum)[..., None])  # what each token reads of the chunk's start state
    attention = (q @ k.swapaxes(-1, -2)) * pairwise  # within-chunk attention, causal
    q_decayed = q * mx.exp(cum)[..., None]
    k_decayed = k * mx.exp(mx.cumsum(g, axis=-1, reverse=True, inclusive=False))[..., None]  # to the chunk's end
    chunk_decay = mx.exp(cum[..., -1])[..., None, None]  # [B, H, chunks, 1, 1]

    outs = []
    for c in range(chunks):
        corrected = new_values[:, :, c] - k_cumdecay[:, :, c] @ state
        outs.append(q_decayed[:, :, c] @ state + attention[:, :, c] @ corrected)
        state = state * chunk_decay[:, :, c] + k_decayed[:, :, c].swapaxes(-1, -2) @ corrected
    y = outs[0] if chunks == 1 else mx.concatenate(outs, axis=2)  # [B, H, L + pad, Dv]
    return y[:, :, :L].transpose(0, 2, 1, 3).astype(dtype), state


# (not shapeless: the chunk count is the loop's length)
compiled_chunked = mx.compile(chunked)
