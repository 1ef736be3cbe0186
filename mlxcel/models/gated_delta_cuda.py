"""A Gated DeltaNet layer's decode step as one CUDA kernel (MLX's CUDA backend).

At batch 1 a GPU's decode step is bound by the host's cost per op (docs/benchmarks.md), and a
linear-attention layer's step is ~20 small ops between its input projection and its output
projection: the causal convolution's window, silu, the q/k l2 norms, the decay and beta, the delta
rule's reads and update, the gated RMSNorm. Here one thread block a (row, value head) does all of
it: it convolves the head's q, k and v channels from the conv window, normalizes q and k, reads
S^T q and S^T k from the old state in one pass (the output follows without reading the new state:
y = e^g S^T q + (k . q) delta, as gated_delta.one_step), writes the new state and window, and
applies the gated RMSNorm. Same arithmetic as the ops path (qwen3_5.GatedDeltaNet.advance), in
float32, with the ops path's roundings to the activations' dtype where it stores one.

Threads: a block of NT = 4 * Dv (whole warps: Dv a multiple of 8); thread t owns value column
t % Dv and a quarter of the key rows (coalesced loads of the [Dk, Dv] state); the quarters' partial
sums meet in shared memory.
"""

from __future__ import annotations

import os
from functools import lru_cache

import mlx.core as mx

from mlxcel.models.cuda_kernel import cuda_kernel
from mlxcel.models.paged_attention import constant_array
from mlxcel.sampling.cuda_draw import has_cuda_backend

GROUPS = 4  # key-row quarters: a block has GROUPS * Dv threads

_HEADER = """
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xFFFFFFFFu, x, o);
  return x;
}
__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }
"""

# Template constants: T (activations), DK, DV, HK, HV, K (conv width), C (conv channels: 2*HK*DK +
# HV*DV); row strides and offsets of the projections (qkv, z, b, a: one fused matmul's output or
# four arrays). params: the l2 norm's and the RMSNorm's epsilons.
_SOURCE = """
  constexpr int NT = GROUPS * DV;
  constexpr int ROWS = DK / GROUPS;  // key rows a thread keeps
  const int b = blockIdx.y / HV, hv = blockIdx.y % HV, hk = hv / (HV / HK);
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  __shared__ float qs[DK], ks[DK], vs[DV];
  __shared__ float red_q[GROUPS][DV], red_k[GROUPS][DV], red_n[NT / 32];
  __shared__ float scalars[4];  // q's and k's inverse norms, k . q, the decay
  __shared__ float beta_sh;
  const T* qkv_row = qkv + (size_t)b * QKV_STRIDE + QKV_AT;
  const T* conv_row = conv_state + (size_t)b * (K - 1) * C;
  T* new_conv_row = new_conv + (size_t)b * (K - 1) * C;
  // 1. the causal convolution and silu over this head's channels: q, k (shared by HV / HK value
  // heads: the first of them writes their window) and v
  for (int i = t; i < 2 * DK + DV; i += NT) {
    const int c = i < DK ? hk * DK + i
                : i < 2 * DK ? HK * DK + hk * DK + (i - DK)
                : 2 * HK * DK + hv * DV + (i - 2 * DK);
    const float x = static_cast<float>(qkv_row[c]);
    float acc = x * static_cast<float>(conv_w[c * K + K - 1]);
    for (int j = 0; j < K - 1; j++)
      acc += static_cast<float>(conv_row[j * C + c]) * static_cast<float>(conv_w[c * K + j]);
    const float act = static_cast<float>(static_cast<T>(silu(static_cast<float>(static_cast<T>(acc)))));
    if (i < DK) qs[i] = act; else if (i < 2 * DK) ks[i - DK] = act; else vs[i - 2 * DK] = act;
    if (i >= 2 * DK || hv % (HV / HK) == 0) {
      for (int j = 0; j < K - 2; j++) new_conv_row[j * C + c] = conv_row[(j + 1) * C + c];
      new_conv_row[(K - 2) * C + c] = qkv_row[c];
    }
  }
  __syncthreads();
  // 2. l2 norms of q and k, k . q, the decay and beta
  for (int j = warp; j < 3; j += NT / 32) {  // (whole warps: the loop is uniform across one)
    float acc = 0.0f;
    for (int i = lane; i < DK; i += 32) acc += j == 0 ? qs[i] * qs[i] : j == 1 ? ks[i] * ks[i] : qs[i] * ks[i];
    acc = warp_sum(acc);
    if (lane == 0) scalars[j] = j < 2 ? rsqrtf(acc + params[0]) : acc;
  }
  if (t == NT - 1) {
    const float x = static_cast<float>(aa[(size_t)b * A_STRIDE + A_AT + hv]) + static_cast<float>(dt_bias[hv]);
    const float softplus = x > 20.0f ? x : log1pf(__expf(x));
    scalars[3] = __expf(-__expf(static_cast<float>(a_log[hv])) * softplus);
    beta_sh = 1.0f / (1.0f + __expf(-static_cast<float>(bb[(size_t)b * B_STRIDE + B_AT + hv])));
  }
  __syncthreads();
  const float q_scale = scalars[0] * rsqrtf((float)DK), k_scale = scalars[1];
  const float decay = scalars[3];
  // 3. S^T q and S^T k from the old state, this thread's quarter of the key rows
  const int dv = t % DV, group = t / DV;
  const size_t base = ((size_t)(b * HV + hv) * DK + group * ROWS) * DV + dv;
  float s[ROWS];
  float read_q = 0.0f, read_k = 0.0f;
  #pragma unroll
  for (int r = 0; r < ROWS; r++) {
    s[r] = state[base + (size_t)r * DV];
    read_q += s[r] * qs[group * ROWS + r];
    read_k += s[r] * ks[group * ROWS + r];
  }
  red_q[group][dv] = read_q;
  red_k[group][dv] = read_k;
  __syncthreads();
  read_q = 0.0f;
  read_k = 0.0f;
  #pragma unroll
  for (int g = 0; g < GROUPS; g++) { read_q += red_q[g][dv]; read_k += red_k[g][dv]; }
  read_q *= q_scale;
  read_k *= k_scale;
  const float delta = (vs[dv] - decay * read_k) * beta_sh;
  const float kq = scalars[2] * q_scale * k_scale;
  // 4. the new state: e^g S + k delta^T
  #pragma unroll
  for (int r = 0; r < ROWS; r++)
    new_state[base + (size_t)r * DV] = decay * s[r] + ks[group * ROWS + r] * k_scale * delta;
  // 5. the gated RMSNorm of y = e^g S^T q + (k . q) delta over the head's DV values
  const float y = static_cast<float>(static_cast<T>(decay * read_q + kq * delta));
  float sq = group == 0 ? y * y : 0.0f;
  sq = warp_sum(sq);
  if (lane == 0) red_n[warp] = sq;
  __syncthreads();
  if (group == 0) {
    float total = 0.0f;
    for (int w = 0; w < (DV + 31) / 32; w++) total += red_n[w];  // (group 0's warps; past it, zeros)
    const float normed = static_cast<float>(static_cast<T>(y * rsqrtf(total / DV + params[1])));
    const float weighted = static_cast<float>(static_cast<T>(normed * static_cast<float>(norm_w[dv])));
    const float gate = silu(static_cast<float>(zz[(size_t)b * Z_STRIDE + Z_AT + hv * DV + dv]));
    out[(size_t)b * HV * DV + hv * DV + dv] = static_cast<T>(weighted * gate);
  }
"""


@lru_cache(maxsize=1)
def _kernel():
    return cuda_kernel(
        name="mlxcel_gated_delta_decode",
        input_names=["qkv", "zz", "bb", "aa", "conv_state", "conv_w", "a_log", "dt_bias", "norm_w", "state", "params"],
        output_names=["out", "new_conv", "new_state"],
        source=_SOURCE,
        header=_HEADER,
    )


def is_available(key_dim: int, value_dim: int, key_heads: int, value_heads: int) -> bool:
    """On MLX's CUDA backend with the GPU as the default device, for head sizes the block's layout
    takes, unless $MLXCEL_FUSED_DELTA=0 (on by default since the H100 passed
    tests/test_gated_delta_cuda.py; bench.lone_step: 161 -> 416 tok/s, Qwen 3.5 0.8B)."""
    if os.environ.get("MLXCEL_FUSED_DELTA", "1") != "1" or not fits_block(key_dim, value_dim, key_heads, value_heads):
        return False
    return mx.default_device() == mx.gpu and has_cuda_backend()


def fits_block(key_dim: int, value_dim: int, key_heads: int, value_heads: int) -> bool:
    """Whether a (row, value head)'s block takes these head sizes: GROUPS * Dv threads in whole
    warps and at most 1024 of them, the key rows in GROUPS equal parts, whole value heads a key head."""
    threads = GROUPS * value_dim
    return threads % 32 == 0 and threads <= 1024 and key_dim % GROUPS == 0 and value_heads % key_heads == 0


def decode_step(
    projections: list[tuple[mx.array, int]],
    conv_state: mx.array,
    conv_weight: mx.array,
    a_log: mx.array,
    dt_bias: mx.array,
    norm_weight: mx.array,
    state: mx.array,
    heads: tuple[int, int],
    head_dims: tuple[int, int],
    eps: tuple[float, float],
) -> tuple[mx.array, mx.array, mx.array]:
    """One token per row: projections [(array [B, 1, W], column offset)] of qkv, z, b and a (the
    same array four times when the input projection is fused); conv_state [B, K-1, C]; conv_weight
    [C, K, 1]; state [B, HV, DK, DV] float32; heads (HK, HV); head_dims (DK, DV); eps (the l2 norm's,
    the RMSNorm's). Returns (the gated, normed output [B, 1, HV * DV], the conv window, the state)."""
    (qkv, qkv_at), (z, z_at), (b, b_at), (a, a_at) = projections
    rows, channels = qkv.shape[0], conv_state.shape[-1]
    key_heads, value_heads = heads
    key_dim, value_dim = head_dims
    assert channels == 2 * key_heads * key_dim + value_heads * value_dim, "conv channels are q|k|v"
    conv_state = conv_state.astype(qkv.dtype)  # (the window keeps the activations' dtype, as causal_conv)
    template = [
        ("T", qkv.dtype),
        ("DK", key_dim),
        ("DV", value_dim),
        ("HK", key_heads),
        ("HV", value_heads),
        ("K", conv_weight.shape[1]),
        ("C", channels),
        ("GROUPS", GROUPS),
        *((f"{name}_STRIDE", array.shape[-1]) for name, array in (("QKV", qkv), ("Z", z), ("B", b), ("A", a))),
        *((f"{name}_AT", at) for name, at in (("QKV", qkv_at), ("Z", z_at), ("B", b_at), ("A", a_at))),
    ]
    threads = GROUPS * value_dim
    out, new_conv, new_state = _kernel()(
        inputs=[
            qkv,
            z,
            b,
            a,
            conv_state,
            conv_weight,
            a_log,
            dt_bias,
            norm_weight,
            state,
            constant_array(eps, mx.float32),
        ],
        template=template,
        grid=(threads, rows * value_heads, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(rows, 1, value_heads * value_dim), conv_state.shape, state.shape],
        output_dtypes=[qkv.dtype, qkv.dtype, mx.float32],
    )
    return out, new_conv, new_state
