"""Gumbel-max over [B, V] logits as one CUDA kernel (and a [B, blocks] argmax), for MLX's CUDA backend.

The noise is rng.py's hash: two murmur rounds and two logs per element. mx.compile fuses
elementwise ops only to a depth of 11, so as an MLX graph the noise runs as three [B, V] kernels
that write uint32 intermediates to memory before the argmax reads the noisy logits: at batch
32 x 152k on the H200 that was most of a temperature-only step. Here each block hashes, adds and
reduces one contiguous chunk of a row in registers; a small argmax over the blocks' maxima picks
the row's token. The integer hash and the float ops (float32 log, add) are the graph's, and ties
go to the lowest index as in mx.argmax, so the tokens are those of the graph path on the same GPU.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from mlxcel.models.cuda_kernel import cuda_kernel
from mlxcel.sampling.rng import _GOLD, _M1, _M2, DRAW_STREAM, KEY_WORDS

THREADS = 256  # per block
ELEMENTS_PER_THREAD = 16  # sets the number of blocks per row: enough to fill the GPU at batch 1

_HEADER = f"""
__device__ __forceinline__ uint32_t mix32(uint32_t x) {{
  x ^= x >> 16; x *= {_M1}u; x ^= x >> 13; x *= {_M2}u; return x ^ (x >> 16);
}}
__device__ __forceinline__ bool better(float v, uint32_t i, float best, uint32_t best_i) {{
  return v > best || (v == best && i < best_i);
}}
"""

# Template constants: T (the logits' type), V (vocabulary), CHUNK (elements per block).
_SOURCE = f"""
  const uint32_t row = blockIdx.y;
  const uint32_t a = keys[row * {KEY_WORDS} + {2 * DRAW_STREAM}];
  const uint32_t b = keys[row * {KEY_WORDS} + {2 * DRAW_STREAM + 1}];
  const uint32_t start = blockIdx.x * CHUNK;
  const uint32_t stop = min(start + CHUNK, (uint32_t)V);
  float best = __int_as_float(0xFF800000u);  // -inf
  uint32_t best_i = 0xFFFFFFFFu;  // loses every tie: a row of -inf still gives its first index
  for (uint32_t v = start + threadIdx.x; v < stop; v += {THREADS}) {{
    const uint32_t h = mix32(mix32(v * {_GOLD}u + a) ^ b);
    const float u = ((float)(h >> 9) + 0.5f) * (1.0f / 8388608.0f);
    const float value = static_cast<float>(x[(size_t)row * V + v]) + (-log(-log(u)));
    if (better(value, v, best, best_i)) {{ best = value; best_i = v; }}
  }}
  for (int offset = 16; offset > 0; offset >>= 1) {{
    const float other = __shfl_down_sync(0xFFFFFFFFu, best, offset);
    const uint32_t other_i = __shfl_down_sync(0xFFFFFFFFu, best_i, offset);
    if (better(other, other_i, best, best_i)) {{ best = other; best_i = other_i; }}
  }}
  __shared__ float warp_best[{THREADS // 32}];
  __shared__ uint32_t warp_best_i[{THREADS // 32}];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {{ warp_best[warp] = best; warp_best_i[warp] = best_i; }}
  __syncthreads();
  if (warp == 0) {{
    best = lane < {THREADS // 32} ? warp_best[lane] : __int_as_float(0xFF800000u);
    best_i = lane < {THREADS // 32} ? warp_best_i[lane] : 0xFFFFFFFFu;
    for (int offset = 16; offset > 0; offset >>= 1) {{
      const float other = __shfl_down_sync(0xFFFFFFFFu, best, offset);
      const uint32_t other_i = __shfl_down_sync(0xFFFFFFFFu, best_i, offset);
      if (better(other, other_i, best, best_i)) {{ best = other; best_i = other_i; }}
    }}
    if (lane == 0) {{
      block_max[row * gridDim.x + blockIdx.x] = best;
      block_index[row * gridDim.x + blockIdx.x] = best_i;
    }}
  }}
"""


@lru_cache(maxsize=1)
def _kernel():
    return cuda_kernel(
        name="mlxcel_gumbel_max",
        input_names=["x", "keys"],
        output_names=["block_max", "block_index"],
        source=_SOURCE,
        header=_HEADER,
    )


def is_available() -> bool:
    """On MLX's CUDA backend with the GPU as the default device."""
    return mx.default_device() == mx.gpu and has_cuda_backend()


@lru_cache(maxsize=1)
def has_cuda_backend() -> bool:
    cuda = getattr(mx, "cuda", None)  # absent from some builds (older Metal ones)
    return cuda is not None and cuda.is_available()


def gumbel_max(x: mx.array, step_keys: mx.array) -> mx.array:
    """[B] uint32: argmax(x + the rows' Gumbel noise) for x [B, V] and step keys [B, KEY_WORDS]."""
    batch, vocab = x.shape
    chunk = THREADS * ELEMENTS_PER_THREAD
    blocks = -(-vocab // chunk)
    block_max, block_index = _kernel()(
        inputs=[x, step_keys],
        template=[("T", x.dtype), ("V", vocab), ("CHUNK", chunk)],
        grid=(blocks * THREADS, batch, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(batch, blocks), (batch, blocks)],
        output_dtypes=[mx.float32, mx.uint32],
    )
    # Blocks cover increasing index ranges, so argmax's first maximum is the lowest index.
    best_block = mx.argmax(block_max, axis=-1, keepdims=True)
    return mx.take_along_axis(block_index, best_block, axis=-1)[:, 0]
