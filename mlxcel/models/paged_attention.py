"""The paged KV cache's CUDA kernels (MLX's CUDA backend): pool writes in place, and decode
attention that reads the blocks in place.

Writes. MLX arrays are values: `pool[idx] = new` makes a new pool, and its CUDA backend copies
the whole pool for it whenever the old buffer is still referenced, which a pipelined step always
does (docs/benchmarks.md has the cost: milliseconds per write, 32 writes a step for 16 layers).
vLLM writes its cache in place (reshape_and_cache); so do these kernels: they take the pool as an
input and store into it. That is sound only because every access to a pool on this path goes
through these kernels, and each takes the layer's previous kernel's `done` output as an input, so
MLX orders them (the pool itself never changes identity, so MLX sees no dependency through it).
The pool must be a real buffer (`make_pool`): `mx.zeros` may be one broadcast element.

Decode attention. The plain-MLX path (paged_cache.py) gathers every decoding row's positions into a
dense array and masks each row's padding; the array mask sends MLX's attention to its unfused path,
and the gather copies the rows' cache once per layer and step. Here each thread block takes one row,
one KV head (all the query heads that share it) and one split of the row's positions, walks the
row's blocks through the block table, and keeps an online softmax; a few small MLX ops combine the
splits. Splits keep the GPU busy when few rows decode long contexts (flash-decoding). The step's new
key and value come in as inputs: the block that covers the new position stores them in the pool.

Runs only where our tests ran it (MLX's CUDA backend); Metal and the CPU keep the plain path.
"""

from __future__ import annotations

import os
from functools import lru_cache

import mlx.core as mx

from mlxcel.models.cuda_kernel import cuda_kernel
from mlxcel.sampling.cuda_draw import has_cuda_backend

THREADS = 128  # per block; also positions per tile (one per thread when scoring)
TARGET_BLOCKS = 528  # ~4 per SM on an H200: below it, rows' positions are split across blocks
MIN_SPLIT = 1024  # positions: a split shorter than this costs more in ops than it saves on the GPU
SHARED = 48 * 1024  # bytes of static shared memory a kernel may declare

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
# BS (positions per cache block). params: split length, table width, window (0: none).
# Per tile of NT positions: each thread scores one position for the G query heads (16-byte key
# loads), warps run the online softmax, then the values: thread t owns the dimension pair t % (D/2)
# for every head and takes every (NT / (D/2))-th position, so a warp reads whole value rows, each
# once; the groups' partial sums meet in shared memory at the end.
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
  const int window = params[2];  // a sliding-window layer sees this many positions back; 0: all
  const int first = window > 0 ? max(0, len - window) : 0;
  const int p0 = first + split * split_len;
  const int p1 = min(p0 + split_len, len);
  __shared__ float qs[G][D];
  __shared__ float probs[G][NT];
  __shared__ int rows[NT];
  __shared__ float m_sh[G], l_sh[G], alpha_sh[G];
  const float sc = scale[0];
  const T* k_in = k_new + ((size_t)b * KVH + kvh) * D;  // the new position's key and value
  const T* v_in = v_new + ((size_t)b * KVH + kvh) * D;
  if (p0 < len && p1 == len) {{  // this block covers the new position: store it in the pool
    const int last = len - 1;
    const size_t at = ((size_t)(block_table[b * TW + last / BS] * BS + last % BS) * KVH + kvh) * D;
    for (int d = t; d < D; d += NT) {{
      const_cast<T*>(k)[at + d] = k_in[d];
      const_cast<T*>(v)[at + d] = v_in[d];
    }}
  }}
  if (blockIdx.x == 0 && blockIdx.y == 0 && t == 0) done[0] = 0;
  for (int i = t; i < G * D; i += NT) {{
    const int g = i / D, d = i % D;
    qs[g][d] = static_cast<float>(q[((size_t)b * KVH * G + kvh * G + g) * D + d]) * sc;
  }}
  if (t < G) {{ m_sh[t] = NEG_INF; l_sh[t] = 0.0f; }}
  constexpr int PAIRS = D / 2;
  constexpr int PER = (PAIRS + NT - 1) / NT;  // pairs a thread owns: 1 up to D = 256, more above
  constexpr int GROUPS = PER == 1 ? NT / PAIRS : 1;  // threads past GROUPS * PAIRS idle in the value phase
  const int pair = PER == 1 ? t % PAIRS : t, group = PER == 1 ? t / PAIRS : 0;
  float acc[G][2 * PER];
  #pragma unroll
  for (int g = 0; g < G; g++) {{
    #pragma unroll
    for (int j = 0; j < 2 * PER; j++) acc[g][j] = 0.0f;
  }}
  __syncthreads();
  for (int tile = p0; tile < p1; tile += NT) {{
    const int p = tile + t;
    const bool valid = p < p1;
    const bool fresh = p == len - 1;  // read from k_new (its pool slot is being written)
    const int row = valid && !fresh ? block_table[b * TW + p / BS] * BS + p % BS : -1;
    rows[t] = row;
    float s[G];
    #pragma unroll
    for (int g = 0; g < G; g++) s[g] = 0.0f;
    if (valid) {{
      const T* krow = fresh ? k_in : k + ((size_t)row * KVH + kvh) * D;
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
    if (group < GROUPS) {{
      #pragma unroll
      for (int g = 0; g < G; g++) {{
        #pragma unroll
        for (int j = 0; j < 2 * PER; j++) acc[g][j] *= alpha_sh[g];
      }}
      for (int pi = group; pi < count; pi += GROUPS) {{
        const T* vrow = rows[pi] < 0 ? v_in : v + ((size_t)rows[pi] * KVH + kvh) * D;
        #pragma unroll
        for (int j = 0; j < PER; j++) {{
          const int at = pair + j * NT;
          if (at >= PAIRS) break;
          const float v0 = static_cast<float>(vrow[2 * at]), v1 = static_cast<float>(vrow[2 * at + 1]);
          #pragma unroll
          for (int g = 0; g < G; g++) {{
            const float w = probs[g][pi];
            acc[g][2 * j] += w * v0;
            acc[g][2 * j + 1] += w * v1;
          }}
        }}
      }}
    }}
    __syncthreads();
  }}
  // the groups' partial sums, added in a fixed order
  __shared__ float partial[GROUPS][G][D];
  if (group < GROUPS) {{
    #pragma unroll
    for (int j = 0; j < PER; j++) {{
      const int at = pair + j * NT;
      if (at >= PAIRS) break;
      #pragma unroll
      for (int g = 0; g < G; g++) {{
        partial[group][g][2 * at] = acc[g][2 * j];
        partial[group][g][2 * at + 1] = acc[g][2 * j + 1];
      }}
    }}
  }}
  __syncthreads();
"""

# Several splits a row: each writes its running max, sum and unnormalized output; MLX ops combine them.
_SPLITS_TAIL = """
  const int splits = gridDim.x;
  if (t < G) {
    const size_t o = ((size_t)b * KVH * G + kvh * G + t) * splits + split;
    out_m[o] = m_sh[t];
    out_l[o] = l_sh[t];
  }
  for (int i = t; i < G * D; i += NT) {
    const int g = i / D, d = i % D;
    float total = 0.0f;
    for (int j = 0; j < GROUPS; j++) total += partial[j][g][d];
    out_acc[(((size_t)b * KVH * G + kvh * G + g) * splits + split) * D + d] = total;
  }
"""

# One split a row: the block writes the normalized output itself, so the layer's attention is one
# kernel (a decode step of few rows is bound by the host's cost per op, not by the GPU).
_SINGLE_TAIL = """
  for (int i = t; i < G * D; i += NT) {
    const int g = i / D, d = i % D;
    float total = 0.0f;
    for (int j = 0; j < GROUPS; j++) total += partial[j][g][d];
    // a sink (SINKS: gpt-oss) is one more logit in the softmax, with no value
    const float sink = SINKS ? __expf(sinks[kvh * G + g] - m_sh[g]) : 0.0f;
    out[((size_t)b * KVH * G + kvh * G + g) * D + d] = static_cast<T>(total / (l_sh[g] + sink));
  }
"""


@lru_cache(maxsize=2)
def _kernel(single: bool):
    return cuda_kernel(
        name="mlxcel_paged_decode_attention" + ("_single" if single else ""),
        input_names=["q", "k", "v", "k_new", "v_new", "block_table", "lengths", "params", "scale", "sinks", "after"],
        output_names=["out", "done"] if single else ["out_m", "out_l", "out_acc", "done"],
        source=_SOURCE + (_SINGLE_TAIL if single else _SPLITS_TAIL),
        header=_HEADER,
    )


def is_available(head_dim: int, group: int = 1) -> bool:
    """The decode kernel (and the pool writes beside it): writes_available for the head dim, where
    the decode kernel's shared memory for `group` query heads a KV head fits."""
    return writes_available(head_dim) and decode_shared_bytes(head_dim, group) <= SHARED


def writes_available(*widths: int) -> bool:
    """The write-and-gather kernel for keys and values of these widths: on MLX's CUDA backend with
    the GPU as the default device, for widths its 16-byte copies divide ($MLXCEL_PAGED_KERNEL=0
    turns every paged kernel off: the plain path, to compare)."""
    if os.environ.get("MLXCEL_PAGED_KERNEL", "1") == "0" or any(width % 8 for width in widths):
        return False
    return mx.default_device() == mx.gpu and has_cuda_backend()


def decode_shared_bytes(head_dim: int, group: int) -> int:
    """The decode kernel's static shared memory: the queries, a tile's scores, the value groups'
    partial sums (_SOURCE's qs, probs, partial, rows)."""
    groups = max(THREADS // (head_dim // 2), 1)
    return 4 * (group * head_dim * (1 + groups) + group * THREADS + THREADS + 3 * group)


def choose_split_length(rows: int, kv_heads: int, longest: int) -> int:
    """Positions per split, a whole number of tiles: one split per row when rows x heads fill
    the GPU, more when few rows decode long contexts, but never below MIN_SPLIT positions: few
    rows over short contexts are bound by the host's cost per op, and one split needs no ops
    to combine splits."""
    splits = max(1, -(-TARGET_BLOCKS // (rows * kv_heads)))
    per_split = max(-(-longest // splits), MIN_SPLIT)
    return -(-per_split // THREADS) * THREADS


def paged_decode_attention(
    q: mx.array,
    new_keys: mx.array,
    new_values: mx.array,
    pool: PoolLayer,
    block_table: mx.array,
    lengths: mx.array,
    longest: int,
    scale: float,
    block_size: int,
    window: int = 0,
    one_split: bool = False,
    sinks: mx.array | None = None,
) -> mx.array:
    """Store each row's new key and value in the pool, and attend its one new query over its
    positions (the new one included).

    q [B, H, 1, D]; new_keys, new_values [B, KVH, 1, D]; block_table [B, TW] int32; lengths [B]
    int32 (positions in the row, the new one included); longest: the most positions a row
    attends to (host); window: a sliding window's size (0: every position); one_split: each row's
    positions in one block (batch-invariant mode: the split then depends on the row alone, and
    the kernel normalizes it itself); sinks [H]: a learned logit per head in every softmax
    (gpt-oss). Returns [B, H, 1, D] in q's dtype."""
    B, H, _, D = q.shape
    kv_heads = pool.keys.shape[1]
    group = H // kv_heads
    split_len = -(-longest // THREADS) * THREADS if one_split else choose_split_length(B, kv_heads, longest)
    splits = -(-longest // split_len)
    inputs = [
        q.reshape(B, H, D),
        pool.keys,
        pool.values,
        new_keys,
        new_values,
        block_table,
        lengths,
        constant_array((split_len, block_table.shape[1], window), mx.int32),
        constant_array((scale,), mx.float32),
        constant_array((0.0,), mx.float32) if sinks is None else sinks.astype(mx.float32),
        pool.done,
    ]
    template = [
        ("T", pool.keys.dtype),
        ("D", D),
        ("G", group),
        ("KVH", kv_heads),
        ("BS", block_size),
        ("SINKS", int(sinks is not None)),
    ]
    grid, threadgroup = (splits * THREADS, B * kv_heads, 1), (THREADS, 1, 1)
    if splits == 1:
        out, pool.done = _kernel(True)(
            inputs=inputs,
            template=template,
            grid=grid,
            threadgroup=threadgroup,
            output_shapes=[(B, H, D), (1,)],
            output_dtypes=[pool.keys.dtype, mx.int32],
        )
        return out.astype(q.dtype)[:, :, None, :]
    out_m, out_l, out_acc, pool.done = _kernel(False)(
        inputs=inputs,
        template=template,
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=[(B, H, splits), (B, H, splits), (B, H, splits, D), (1,)],
        output_dtypes=[mx.float32, mx.float32, mx.float32, mx.int32],
    )
    m = out_m.max(axis=-1, keepdims=True)
    weights = mx.exp(out_m - m)  # an empty split has m = -inf: weight 0
    total = (out_l * weights).sum(axis=-1, keepdims=True)
    if sinks is not None:  # one more logit a head, with no value
        total = total + mx.exp(sinks.astype(mx.float32)[None, :, None] - m)
    out = (out_acc * weights[..., None]).sum(axis=-2) / total
    return out.astype(q.dtype)[:, :, None, :]


@lru_cache(maxsize=256)
def constant_array(values: tuple, dtype: mx.Dtype) -> mx.array:
    """A kernel's small constant input, made once (every layer of every step passes the same ones)."""
    array = mx.array(values, dtype)
    mx.eval(array)
    return array


class PoolLayer:
    """One layer's keys and values, [positions, KVH, D] and [positions, KVH, DV] (DV = D but for
    MLA's latent and RoPE key), written in place, and the `done` output of the last kernel that
    touched them (the next one takes it as an input)."""

    def __init__(self, positions: int, kv_heads: int, head_dim: int, dtype: mx.Dtype, value_dim: int | None = None):
        shape = (positions, kv_heads, head_dim)
        self.keys, self.values, self.done = _zeros_kernel()(
            inputs=[],
            template=[("T", dtype)],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
            output_shapes=[shape, (positions, kv_heads, value_dim or head_dim), (1,)],
            output_dtypes=[dtype, dtype, mx.int32],
            init_value=0,
        )


@lru_cache(maxsize=1)
def _zeros_kernel():
    # init_value zero-fills every output: fresh, row-contiguous buffers of the full size.
    return cuda_kernel(name="mlxcel_paged_pool", input_names=[], output_names=["k", "v", "done"], source="")


# One thread per (row, key position, KV head): new positions come from the step's keys and values
# (and are stored in the pool), earlier ones from the pool, positions past the row's end are zero.
# A row's new tokens may sit after `leads[b]` padding tokens (rows of a ragged piece, aligned to
# end together), which are neither stored nor gathered.
_WRITE_GATHER_SOURCE = """
  struct alignas(16) Vec8 { T v[8]; };
  const int B = dims[0], S = dims[1], L = dims[2];
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i == 0) done[0] = 0;
  if (i >= (size_t)B * S * KVH) return;
  const int h = i % KVH, s = (i / KVH) % S, b = i / ((size_t)KVH * S);
  const int start = starts[b], lead = leads[b];
  const size_t row = ((size_t)b * KVH + h) * S + s;  // the output's [b, h, s]
  const Vec8* ksrc;
  const Vec8* vsrc;
  if (s >= start && s < start + L - lead) {
    const int n = s - start + lead;  // its index among the step's tokens
    const size_t token = ((size_t)b * KVH + h) * L + n;
    ksrc = reinterpret_cast<const Vec8*>(k_new + token * D);
    vsrc = reinterpret_cast<const Vec8*>(v_new + token * DV);
    const size_t slot = (size_t)write[b * L + n] * KVH + h;
    Vec8* kp = reinterpret_cast<Vec8*>(const_cast<T*>(k) + slot * D);
    Vec8* vp = reinterpret_cast<Vec8*>(const_cast<T*>(v) + slot * DV);
    for (int d = 0; d < D / 8; d++) kp[d] = ksrc[d];
    for (int d = 0; d < DV / 8; d++) vp[d] = vsrc[d];
  } else if (s < start) {
    const size_t slot = (size_t)gather[(size_t)b * S + s] * KVH + h;
    ksrc = reinterpret_cast<const Vec8*>(k + slot * D);
    vsrc = reinterpret_cast<const Vec8*>(v + slot * DV);
  } else {
    Vec8 zero;
    for (int j = 0; j < 8; j++) zero.v[j] = static_cast<T>(0.0f);
    for (int d = 0; d < D / 8; d++) reinterpret_cast<Vec8*>(k_out + row * D)[d] = zero;
    for (int d = 0; d < DV / 8; d++) reinterpret_cast<Vec8*>(v_out + row * DV)[d] = zero;
    return;
  }
  for (int d = 0; d < D / 8; d++) reinterpret_cast<Vec8*>(k_out + row * D)[d] = ksrc[d];
  for (int d = 0; d < DV / 8; d++) reinterpret_cast<Vec8*>(v_out + row * DV)[d] = vsrc[d];
"""


@lru_cache(maxsize=1)
def _write_gather_kernel():
    return cuda_kernel(
        name="mlxcel_paged_write_gather",
        input_names=["k", "v", "k_new", "v_new", "write", "gather", "starts", "leads", "dims", "after"],
        output_names=["k_out", "v_out", "done"],
        source=_WRITE_GATHER_SOURCE,
    )


def write_and_gather(
    pool: PoolLayer,
    new_keys: mx.array,
    new_values: mx.array,
    write: mx.array,
    gather: mx.array,
    starts: mx.array,
    leads: mx.array,
) -> tuple[mx.array, mx.array]:
    """Store [B, KVH, L, D] new keys and [B, KVH, L, DV] values at flat pool positions `write`
    [B * L], and return each row's positions as dense [B, KVH, S, D] keys and [B, KVH, S, DV]
    values: `gather` [B, S] names the pool position of each earlier one (those before the row's
    `starts`), the new ones come from the step, positions past a row's end are zero (masked by the
    caller). A row's first `leads` [B] new tokens are padding: not stored, not returned."""
    B, kv_heads, L, D = new_keys.shape
    DV = new_values.shape[-1]
    S = gather.shape[1]
    threads = 256
    total = B * S * kv_heads
    k_out, v_out, pool.done = _write_gather_kernel()(
        inputs=[
            pool.keys,
            pool.values,
            new_keys,
            new_values,
            write,
            gather,
            starts,
            leads,
            mx.array([B, S, L], mx.int32),
            pool.done,
        ],
        template=[("T", pool.keys.dtype), ("D", D), ("DV", DV), ("KVH", kv_heads)],
        grid=(-(-total // threads) * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, kv_heads, S, D), (B, kv_heads, S, DV), (1,)],
        output_dtypes=[pool.keys.dtype, pool.keys.dtype, mx.int32],
    )
    return k_out, v_out


def read_positions(pool: PoolLayer, flat: mx.array) -> tuple[mx.array, mx.array]:
    """The pool's keys and values at flat positions `flat` [n], as [n, KVH, D] each: the
    write-and-gather kernel with one padding token (nothing stored), so the read is ordered after
    the kernels that wrote those positions and before the ones that write them next."""
    _, kv_heads, dim = pool.keys.shape
    n = flat.shape[0]
    empty = mx.zeros((1, kv_heads, 1, dim), pool.keys.dtype)
    empty_values = mx.zeros((1, kv_heads, 1, pool.values.shape[-1]), pool.values.dtype)
    keys, values = write_and_gather(
        pool,
        empty,
        empty_values,
        constant_array((0,), mx.int32),
        flat[None],
        mx.array([n], mx.int32),
        constant_array((1,), mx.int32),
    )
    return keys[0].transpose(1, 0, 2), values[0].transpose(1, 0, 2)


def write_positions(pool: PoolLayer, keys: mx.array, values: mx.array, flat: mx.array) -> None:
    """Store [n, KVH, D] keys and values at flat pool positions `flat` [n] (the gathered copy the
    kernel also returns is not used)."""
    new_keys, new_values = (a.transpose(1, 0, 2)[None] for a in (keys, values))
    zero = constant_array((0,), mx.int32)
    write_and_gather(pool, new_keys, new_values, flat, zero_index(flat.shape[0]), zero, zero)


@lru_cache(maxsize=16)
def zero_index(n: int) -> mx.array:
    """[1, n] zeros: write_positions' unused gather (one array per length, shared by every layer)."""
    index = mx.zeros((1, n), mx.int32)
    mx.eval(index)
    return index
