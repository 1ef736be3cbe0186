"""Per-row random streams, derived batch-wide on the device.

A row's base key (64 bits) is hashed once on the host from (seed, prompt id, sample index); every
random number it needs is then a counter-based hash of (base key, position, stream, index) in
uint32 arithmetic, computed for the whole batch in one graph. A row's numbers therefore depend on
nothing else in its batch (size, order, neighbours), and on no library RNG whose algorithm could
change under us. Integer hashing is exact, so the CPU and the GPU draw the same uniforms.
"""

from __future__ import annotations

import hashlib

import mlx.core as mx

DRAW_STREAM = 0  # the categorical draw's Gumbel noise, one number per vocabulary entry
XTC_STREAM = 1  # XTC's gate, one number per row and step

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
    """Two [B, 1] uint32 words keying (row, position, stream)."""
    k0, k1 = base_keys[:, :1], base_keys[:, 1:]
    pos = mx.array(position, dtype=mx.uint32) if isinstance(position, int) else position.astype(mx.uint32)
    a = mix32(k0 ^ mix32(k1 + pos * _GOLD + (stream * _STREAM) % 2**32))
    b = mix32(a + k1 * _M1 + pos)
    return a, b


def make_uniform(base_keys: mx.array, position: mx.array | int, stream: int, width: int) -> mx.array:
    """[B, width] float32 uniforms in (0, 1): element v of row b is a hash of (key_b, position, stream, v)."""
    a, b = make_step_keys(base_keys, position, stream)
    index = mx.arange(width, dtype=mx.uint32)[None, :]
    h = mix32(mix32(index * _GOLD + a) ^ b)
    return ((h >> 9).astype(mx.float32) + 0.5) * (1.0 / 8388608.0)  # 23 bits + 0.5: exact in float32, never 0 or 1


def make_gumbel(base_keys: mx.array, position: mx.array | int, width: int) -> mx.array:
    return -mx.log(-mx.log(make_uniform(base_keys, position, DRAW_STREAM, width)))
