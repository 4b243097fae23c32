// linear_logprobs row kernels (device code only: NVRTC compiles this file for sm_70 and sm_86 without torch).
//
// The logits of one token chunk come from cuBLAS (at::matmul in linear_logprobs_cuda.cu); these kernels do the
// per-row work with one block per row and fp32 math whatever the storage type (float, __half, __nv_bfloat16):
// - ll_forward_rows: max, log-sum-exp, the target's log-prob and the entropy (two passes over the row);
// - ll_backward_rows: turns the recomputed logits into dL/dlogits in place,
//     (g_logp * (onehot - p) - g_ent * p * (log p + H)) / T,   log p = z - lse,  z = logits / T.
// A target outside [0, V) gives NaN (forward) and no one-hot term (backward) rather than a stray read.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define LL_THREADS 256  // 8 warps: one row of V ~ 152k is ~600 elements per thread
// NVRTC has no <math.h>: the two IEEE constants by their bits.
#define LL_NEG_INF __int_as_float(static_cast<int>(0xff800000u))
#define LL_NAN __int_as_float(0x7fc00000)

namespace ogrpo_ll {

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

// The two reductions of a row, each with the value that leaves a result unchanged (for the unused lanes).
struct MaxOp {
  static __device__ __forceinline__ float identity() { return LL_NEG_INF; }
  static __device__ __forceinline__ float apply(float a, float b) { return fmaxf(a, b); }
};
struct SumOp {
  static __device__ __forceinline__ float identity() { return 0.0f; }
  static __device__ __forceinline__ float apply(float a, float b) { return a + b; }
};

template <typename Op> __device__ __forceinline__ float warp_reduce(float v) {
  for (int off = 16; off > 0; off >>= 1) v = Op::apply(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Block-wide reduction through one float per warp in shared memory; every thread gets the result.
// `scratch` holds 32 floats; the leading __syncthreads() makes back-to-back calls safe.
template <typename Op> __device__ __forceinline__ float block_reduce(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = warp_reduce<Op>(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : Op::identity();
  return warp_reduce<Op>(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) { return block_reduce<MaxOp>(v, scratch); }
__device__ __forceinline__ float block_sum(float v, float* scratch) { return block_reduce<SumOp>(v, scratch); }

}  // namespace ogrpo_ll

// logits [rows, vocab] (row stride `ld`), targets [rows] -> logp, ent, lse [rows] (fp32).
template <typename T>
__global__ void __launch_bounds__(LL_THREADS)
ll_forward_rows(const T* __restrict__ logits, long long ld, const long long* __restrict__ targets, int vocab,
                float inv_t, float* __restrict__ logp, float* __restrict__ ent, float* __restrict__ lse) {
  __shared__ float scratch[32];
  const long long row = blockIdx.x;
  const T* z = logits + row * ld;
  float m = LL_NEG_INF;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, ogrpo_ll::to_f(z[j]) * inv_t);
  m = ogrpo_ll::block_max(m, scratch);
  float s = 0.0f, t = 0.0f;  // s = sum e^(z-m), t = sum e^(z-m) (z-m)
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float d = ogrpo_ll::to_f(z[j]) * inv_t - m;
    const float e = __expf(d);
    s += e;
    t += e * d;
  }
  s = ogrpo_ll::block_sum(s, scratch);
  t = ogrpo_ll::block_sum(t, scratch);
  if (threadIdx.x == 0) {
    const float log_s = __logf(s);
    const long long tg = targets[row];
    lse[row] = m + log_s;
    ent[row] = log_s - t / s;
    logp[row] = (tg >= 0 && tg < vocab) ? ogrpo_ll::to_f(z[tg]) * inv_t - m - log_s : LL_NAN;
  }
}

// In place: logits [rows, vocab] -> dL/dlogits, from lse, ent and the upstream grads (all [rows], fp32).
template <typename T>
__global__ void __launch_bounds__(LL_THREADS)
ll_backward_rows(T* __restrict__ logits, long long ld, const long long* __restrict__ targets, int vocab, float inv_t,
                 const float* __restrict__ lse, const float* __restrict__ ent, const float* __restrict__ grad_logp,
                 const float* __restrict__ grad_ent) {
  const long long row = blockIdx.x;
  T* z = logits + row * ld;
  const float l = lse[row], h = ent[row], gl = grad_logp[row], ge = grad_ent[row];
  const long long tg = targets[row];
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float lp = ogrpo_ll::to_f(z[j]) * inv_t - l;
    const float p = __expf(lp);
    float d = -gl * p - ge * p * (lp + h);
    if (j == tg) d += gl;
    z[j] = ogrpo_ll::from_f<T>(d * inv_t);
  }
}

// NVRTC emits only instantiated templates: one per storage type the launcher dispatches.
template __global__ void ll_forward_rows<float>(const float*, long long, const long long*, int, float, float*, float*,
                                                float*);
template __global__ void ll_forward_rows<__half>(const __half*, long long, const long long*, int, float, float*,
                                                 float*, float*);
template __global__ void ll_forward_rows<__nv_bfloat16>(const __nv_bfloat16*, long long, const long long*, int, float,
                                                        float*, float*, float*);
template __global__ void ll_backward_rows<float>(float*, long long, const long long*, int, float, const float*,
                                                 const float*, const float*, const float*);
template __global__ void ll_backward_rows<__half>(__half*, long long, const long long*, int, float, const float*,
                                                  const float*, const float*, const float*);
template __global__ void ll_backward_rows<__nv_bfloat16>(__nv_bfloat16*, long long, const long long*, int, float,
                                                         const float*, const float*, const float*, const float*);
