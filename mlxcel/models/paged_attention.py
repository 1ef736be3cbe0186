"""Decode attention that reads a paged KV cache in place, as one CUDA kernel (MLX's CUDA backend).

The plain-MLX path (paged_cache.py) gathers every decoding row's positions into a dense array
and masks each row's padding; the array mask sends MLX's attention to its unfused path, and the
gather copies the whole cache once per layer and step. Here each thread block takes one row, one
KV head (all the query heads that share it) and one split of the row's positions, walks the
row's blocks through the block table, and keeps an online softmax; a few small MLX ops combine
the splits. Splits keep the GPU busy when few rows decode long contexts (flash-decoding).

Runs only where our tests ran it (MLX's CUDA backend); Metal and the CPU keep the plain path.
"""

from __future__ import annotations

import os
from functools import lru_cache

import mlx.core as mx

from mlxcel.sampling.cuda_draw import has_cuda_backend

THREADS = 128  # per block; also positions per tile (one per thread when scoring)
TARGET_BLOCKS = 528  # ~4 per SM on an H200: below it, rows' positions are split across blocks

_HEADER = """
#define NEG_INF __int_as_float(0xFF800000u)
__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xFFFFFFFFu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xFFFFFFFFu, x, o);
  return x;
}
"""

# Template constants: T (cache dtype), D (head dim), G (query heads per KV head), KVH (KV heads),
# BS (positions per cache block), ACC ((G * D) / THREADS, rounded up). params: split length, table width.
_SOURCE = f"""
  constexpr int NT = {THREADS};
  constexpr int NWARPS = NT / 32;
  struct alignas(16) Vec8 {{ T v[8]; }};
  const int split = blockIdx.x;
  const int b = blockIdx.y / KVH, kvh = blockIdx.y % KVH;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int split_len = params[0];
  const int TW = params[1];
  const int len = lengths[b];
  const int p0 = split * split_len;
  const int p1 = min(p0 + split_len, len);
  __shared__ float qs[G][D];
  __shared__ float probs[G][NT];
  __shared__ int rows[NT];
  __shared__ float m_sh[G], l_sh[G], alpha_sh[G];
  const float sc = scale[0];
  for (int i = t; i < G * D; i += NT) {{
    const int g = i / D, d = i % D;
    qs[g][d] = static_cast<float>(q[((size_t)b * KVH * G + kvh * G + g) * D + d]) * sc;
  }}
  if (t < G) {{ m_sh[t] = NEG_INF; l_sh[t] = 0.0f; }}
  float acc[ACC];
  #pragma unroll
  for (int j = 0; j < ACC; j++) acc[j] = 0.0f;
  __syncthreads();
  for (int tile = p0; tile < p1; tile += NT) {{
    const int p = tile + t;
    const bool valid = p < p1;
    const int row = valid ? block_table[b * TW + p / BS] * BS + p % BS : 0;
    rows[t] = row;
    float s[G];
    #pragma unroll
    for (int g = 0; g < G; g++) s[g] = 0.0f;
    if (valid) {{
      const T* krow = k + ((size_t)row * KVH + kvh) * D;
      for (int d = 0; d < D; d += 8) {{
        const Vec8 c = *reinterpret_cast<const Vec8*>(krow + d);
        #pragma unroll
        for (int i = 0; i < 8; i++) {{
          const float kv = static_cast<float>(c.v[i]);
          #pragma unroll
          for (int g = 0; g < G; g++) s[g] += qs[g][d + i] * kv;
        }}
      }}
    }}
    #pragma unroll
    for (int g = 0; g < G; g++) probs[g][t] = valid ? s[g] : NEG_INF;
    __syncthreads();
    for (int g = warp; g < G; g += NWARPS) {{
      float mx = NEG_INF;
      for (int i = lane; i < NT; i += 32) mx = fmaxf(mx, probs[g][i]);
      mx = warp_max(mx);
      const float m_old = m_sh[g];
      const float m_new = fmaxf(m_old, mx);
      float sum = 0.0f;
      for (int i = lane; i < NT; i += 32) {{
        const float e = probs[g][i] == NEG_INF ? 0.0f : __expf(probs[g][i] - m_new);
        probs[g][i] = e;
        sum += e;
      }}
      sum = warp_sum(sum);
      if (lane == 0) {{
        const float alpha = m_old == NEG_INF ? 0.0f : __expf(m_old - m_new);
        alpha_sh[g] = alpha;
        l_sh[g] = l_sh[g] * alpha + sum;
        m_sh[g] = m_new;
      }}
    }}
    __syncthreads();
    const int count = min(NT, p1 - tile);
    #pragma unroll
    for (int j = 0; j < ACC; j++) {{
      const int i = t + j * NT;
      if (i < G * D) {{
        const int g = i / D, d = i % D;
        float a = acc[j] * alpha_sh[g];
        for (int pi = 0; pi < count; pi++) a += probs[g][pi] * static_cast<float>(v[((size_t)rows[pi] * KVH + kvh) * D + d]);
        acc[j] = a;
      }}
    }}
    __syncthreads();
  }}
  const int splits = gridDim.x;
  if (t < G) {{
    const size_t o = ((size_t)b * KVH * G + kvh * G + t) * splits + split;
    out_m[o] = m_sh[t];
    out_l[o] = l_sh[t];
  }}
  #pragma unroll
  for (int j = 0; j < ACC; j++) {{
    const int i = t + j * NT;
    if (i < G * D) {{
      const int g = i / D, d = i % D;
      out_acc[(((size_t)b * KVH * G + kvh * G + g) * splits + split) * D + d] = acc[j];
    }}
  }}
"""


@lru_cache(maxsize=1)
def _kernel():
    return mx.fast.cuda_kernel(
        name="mlxcel_paged_decode_attention",
        input_names=["q", "k", "v", "block_table", "lengths", "params", "scale"],
        output_names=["out_m", "out_l", "out_acc"],
        source=_SOURCE,
        header=_HEADER,
    )


def is_available(head_dim: int) -> bool:
    """On MLX's CUDA backend with the GPU as the default device, for head dims the kernel's 16-byte
    loads divide ($MLXCEL_PAGED_KERNEL=0 turns it off: the plain path, to compare)."""
    if os.environ.get("MLXCEL_PAGED_KERNEL", "1") == "0" or head_dim % 8:
        return False
    return mx.default_device() == mx.gpu and has_cuda_backend()


def choose_split_length(rows: int, kv_heads: int, longest: int) -> int:
    """Positions per split, a whole number of tiles: one split per row when rows x heads fill
    the GPU, more when few rows decode long contexts."""
    splits = max(1, -(-TARGET_BLOCKS // (rows * kv_heads)))
    per_split = -(-longest // splits)
    return -(-per_split // THREADS) * THREADS


def paged_decode_attention(q: mx.array, keys: mx.array, values: mx.array, block_table: mx.array, lengths: mx.array, longest: int, scale: float, block_size: int) -> mx.array:
    """Attention of one new query per row over its cached positions.

    q [B, H, 1, D]; keys, values [positions, KVH, D] (the pool, flat positions); block_table
    [B, TW] int32; lengths [B] int32 (positions to attend, the new one included); longest: the
    largest length (host). Returns [B, H, 1, D] in q's dtype."""
    B, H, _, D = q.shape
    kv_heads = keys.shape[1]
    group = H // kv_heads
    split_len = choose_split_length(B, kv_heads, longest)
    splits = -(-longest // split_len)
    out_m, out_l, out_acc = _kernel()(
        inputs=[q.reshape(B, H, D), keys, values, block_table, lengths, mx.array([split_len, block_table.shape[1]], mx.int32), mx.array([scale], mx.float32)],
        template=[("T", keys.dtype), ("D", D), ("G", group), ("KVH", kv_heads), ("BS", block_size), ("ACC", -(-(group * D) // THREADS))],
        grid=(splits * THREADS, B * kv_heads, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, H, splits), (B, H, splits), (B, H, splits, D)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    m = out_m.max(axis=-1, keepdims=True)
    weights = mx.exp(out_m - m)  # an empty split has m = -inf: weight 0
    out = (out_acc * weights[..., None]).sum(axis=-2) / (out_l * weights).sum(axis=-1, keepdims=True)
    return out.astype(q.dtype)[:, :, None, :]
