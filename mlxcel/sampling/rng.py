"""Per-row random streams, derived batch-wide on the device.

A row's base key (64 bits) is hashed once on the host from (seed, prompt id, sample index); every
random number it needs is then a counter-based hash of (base key, position, stream, index) in
uint32 arithmetic, computed for the whole batch in one graph. A row's numbers therefore depend on
nothing else in its batch (size, order, neighbours), and on no library RNG whose algorithm could
change under us. Integer hashing is exact, so the CPU and the GPU draw the same uniforms.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import mlx.core as mx

DRAW_STREAM = 0  # the categorical draw's Gumbel noise, one number per vocabulary entry
XTC_STREAM = 1  # XTC's gate, one number per row and step
STREAMS = (DRAW_STREAM, XTC_STREAM)
KEY_WORDS = 2 * len(STREAMS)

_M1, _M2, _GOLD, _STREAM = 0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9, 0x632BE5AB


def derive_row_seed(seed: int, row_id: object, sample_index: int) -> int:
    digest = hashlib.blake2b(f"{seed}|{row_id}|{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def make_base_keys(seeds: list[int]) -> mx.array:
    """[B, 2] uint32 from 64-bit row seeds."""
    return mx.array([[s & 0xFFFFFFFF, s >> 32] for s in seeds], dtype=mx.uint32)


def mix32(x: mx.array) -> mx.array:
    """murmur3's finalizer: a bijection of uint32 with full avalanche."""
    x = x ^ (x >> 16)
    x = x * _M1
    x = x ^ (x >> 13)
    x = x * _M2
    return x ^ (x >> 16)


def make_step_keys(base_keys: mx.array, position: mx.array | int, stream: int) -> tuple[mx.array, mx.array]:
    """Two uint32 words keying (row, position, stream): [B, 1] for one position, [B, N] for
    positions [1, N] (broadcast)."""
    k0, k1 = base_keys[:, :1], base_keys[:, 1:]
    pos = mx.array(position, dtype=mx.uint32) if isinstance(position, int) else position.astype(mx.uint32)
    a = mix32(k0 ^ mix32(k1 + pos * _GOLD + (stream * _STREAM) % 2**32))
    b = mix32(a + k1 * _M1 + pos)
    return a, b


def make_step_key_words(base_keys: mx.array, positions: mx.array | int) -> mx.array:
    """[B, N, KEY_WORDS] uint32: every stream's two words (stream s at columns 2s, 2s+1) for each
    row at positions [1, N], or at one position (an int or [B, 1]: N = 1)."""
    words = []
    for stream in STREAMS:
        words += make_step_keys(base_keys, positions, stream)
    return mx.stack(words, axis=-1)


def make_key_table(base_keys: mx.array, first: int, count: int) -> mx.array:
    """[count, B, KEY_WORDS]: the step keys of positions first .. first+count-1 in one graph, so a
    step only slices its [B, KEY_WORDS] row. Derived inside each step, the keys' hash chain ran
    as five small kernels a step (mx.compile fuses elementwise ops only to a depth of 11), about
    a fifth of a temperature-only step at batch 32 on the H200."""
    positions = mx.arange(first, first + count, dtype=mx.uint32)[None, :]
    return mx.contiguous(make_step_key_words(base_keys, positions).transpose(1, 0, 2))


@lru_cache(maxsize=8)
def column_offsets(width: int) -> mx.array:
    """[1, width] uint32 index * _GOLD: the row-independent first term of every element's hash,
    made once per width instead of an arange (and a multiply) in every step's graph."""
    offsets = mx.arange(width, dtype=mx.uint32)[None, :] * _GOLD
    mx.eval(offsets)
    return offsets


def uniform_from_step_keys(step_keys: mx.array, stream: int, width: int) -> mx.array:
    """[B, width] float32 uniforms in (0, 1) from [B, KEY_WORDS] step keys: element v of row b is a
    hash of (key_b, position, stream, v)."""
    a, b = step_keys[:, 2 * stream : 2 * stream + 1], step_keys[:, 2 * stream + 1 : 2 * stream + 2]
    h = mix32(mix32(column_offsets(width) + a) ^ b)
    return ((h >> 9).astype(mx.float32) + 0.5) * (1.0 / 8388608.0)  # 23 bits + 0.5: exact in float32, never 0 or 1


def make_uniform(base_keys: mx.array, position: mx.array | int, stream: int, width: int) -> mx.array:
    """uniform_from_step_keys for base keys [B, 2] at one position (scalar or [B, 1])."""
    return uniform_from_step_keys(make_step_key_words(base_keys, position)[:, 0], stream, width)


def gumbel_from_step_keys(step_keys: mx.array, width: int) -> mx.array:
    return -mx.log(-mx.log(uniform_from_step_keys(step_keys, DRAW_STREAM, width)))
