// Device code for fused sampling (no torch: NVRTC compiles this file alone for sm_70 and sm_86).
//
// One block per row. Same contract as fused_sample_cpu.cpp: penalty (gathered from the row's previous tokens) ->
// / temperature -> top-k -> top-p -> the first kept token, in id order, whose cumulative mass exceeds u * Z_kept.
// No sort: top-k and top-p thresholds are found by bisection over the 32-bit order-preserving key of the fp32
// score (MSB first, one counting / mass-summing pass per bit), which lands exactly on the boundary score; ties
// with it are kept for top-k, and for top-p the lowest ids among them, as many as the remaining mass needs.
// 32 passes over a row that sits in L2 (600 KB at V = 151,936) cost less than one sort of it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define FS_THREADS 512

__device__ __forceinline__ float fs_load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float fs_load(const __half* p, long long i) { return __half2float(p[i]); }
__device__ __forceinline__ float fs_load(const __nv_bfloat16* p, long long i) { return __bfloat162float(p[i]); }

// Order-preserving map float -> uint32 (larger float, larger key; -inf is the smallest non-NaN key).
__device__ __forceinline__ unsigned int fs_key(float v) {
  const unsigned int b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float fs_unkey(unsigned int k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Sum over the block (every thread gets it); `sh` holds FS_THREADS doubles.
__device__ __forceinline__ double fs_block_sum(double v, double* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int s = FS_THREADS / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
    __syncthreads();
  }
  const double r = sh[0];
  __syncthreads();
  return r;
}

// Exclusive prefix sum over threads (thread order = id order of their chunks); `total` gets the block's sum.
__device__ __forceinline__ double fs_block_exclusive(double v, double* sh, double* total) {
  const int t = threadIdx.x;
  sh[t] = v;
  __syncthreads();
  for (int off = 1; off < FS_THREADS; off <<= 1) {
    const double add = t >= off ? sh[t - off] : 0.0;
    __syncthreads();
    sh[t] += add;
    __syncthreads();
  }
  const double before = t > 0 ? sh[t - 1] : 0.0;
  *total = sh[FS_THREADS - 1];
  __syncthreads();
  return before;
}

template <typename T>
__global__ void __launch_bounds__(FS_THREADS)
    fused_sample_kernel(const T* __restrict__ logits, long long V, const long long* __restrict__ prev, long long L,
                        const double* __restrict__ uniforms, float temperature, long long top_k, float top_p,
                        float penalty, float* __restrict__ work, long long* __restrict__ out) {
  __shared__ double sh[FS_THREADS];
  __shared__ float sh_v[FS_THREADS];
  __shared__ long long sh_i[FS_THREADS];
  __shared__ long long sh_pick;
  __shared__ int sh_first, sh_last;

  const int t = threadIdx.x;
  const long long row = blockIdx.x;
  const T* x = logits + row * V;
  float* y = work + row * V;
  const bool greedy = temperature == 0.0f;

  // 1. scores: penalty, then temperature (both as transformers computes them, in fp32)
  for (long long i = t; i < V; i += FS_THREADS) y[i] = greedy ? fs_load(x, i) : fs_load(x, i) / temperature;
  __syncthreads();
  if (penalty != 1.0f && prev != nullptr) {
    for (long long j = t; j < L; j += FS_THREADS) {
      const long long tok = prev[row * L + j];
      if (tok < 0 || tok >= V) continue;  // padding
      const float v = fs_load(x, tok);
      const float p = v < 0.0f ? v * penalty : v / penalty;
      y[tok] = greedy ? p : p / temperature;  // repeated ids write the same value
    }
  }
  __syncthreads();

  // 2. max and its first index
  float bv = 0.0f;
  long long bi = -1;
  for (long long i = t; i < V; i += FS_THREADS) {
    const float v = y[i];
    if (bi < 0 || v > bv) { bv = v; bi = i; }
  }
  sh_v[t] = bv;
  sh_i[t] = bi;
  __syncthreads();
  for (int s = FS_THREADS / 2; s > 0; s >>= 1) {
    if (t < s) {
      const float ov = sh_v[t + s];
      const long long oi = sh_i[t + s];
      if (oi >= 0 && (sh_i[t] < 0 || ov > sh_v[t] || (ov == sh_v[t] && oi < sh_i[t]))) {
        sh_v[t] = ov;
        sh_i[t] = oi;
      }
    }
    __syncthreads();
  }
  const float m = sh_v[0];
  const long long arg = sh_i[0];
  __syncthreads();
  // all -inf (or inf/NaN) rows have no distribution: their argmax, like the CPU kernel; uniform across the block
  if (greedy || (__float_as_uint(m) & 0x7f800000u) == 0x7f800000u) {
    if (t == 0) out[row] = arg;
    return;
  }

  // 3. top-k: the largest key K with count(key >= K) >= k, i.e. the k-th largest score
  unsigned int kk = 0u;
  if (top_k > 0 && top_k < V) {
    for (int bit = 31; bit >= 0; --bit) {
      const unsigned int cand = kk | (1u << bit);
      double c = 0.0;
      for (long long i = t; i < V; i += FS_THREADS) c += fs_key(y[i]) >= cand ? 1.0 : 0.0;
      if (fs_block_sum(c, sh) >= static_cast<double>(top_k)) kk = cand;
    }
  }

  // 4. top-p over the top-k survivors: the boundary key K and the last kept id among ties with it
  unsigned int kb = kk;      // kept: key > kb, or key == kb and id <= last_id
  long long last_id = V;     // V: every tie with kb is kept
  if (top_p < 1.0f) {
    double z = 0.0;
    for (long long i = t; i < V; i += FS_THREADS)
      if (fs_key(y[i]) >= kk) z += __expf(y[i] - m);
    const double pz = static_cast<double>(top_p) * fs_block_sum(z, sh);
    unsigned int kp = 0u;
    if (pz <= 0.0) {
      kp = fs_key(m);  // top_p 0: the first max alone
    } else {
      for (int bit = 31; bit >= 0; --bit) {
        const unsigned int cand = kp | (1u << bit);
        const unsigned int lo = cand > kk ? cand : kk;
        double s = 0.0;
        for (long long i = t; i < V; i += FS_THREADS)
          if (fs_key(y[i]) >= lo) s += __expf(y[i] - m);
        if (fs_block_sum(s, sh) >= pz) kp = cand;
      }
    }
    // kp >= kk: the mass over key >= kk is the very sum pz was taken from, and top_p < 1
    {
      kb = kp;
      double above = 0.0;
      for (long long i = t; i < V; i += FS_THREADS)
        if (fs_key(y[i]) > kp) above += __expf(y[i] - m);
      above = fs_block_sum(above, sh);
      const double e = __expf(fs_unkey(kp) - m);
      // ties (equal mass e, lowest ids first) kept while the mass before them is < top_p * Z; at least one
      double need = pz <= 0.0 ? 1.0 : ceil((pz - above) / e);
      if (!(need >= 1.0)) need = 1.0;
      if (e > 0.0 && need < static_cast<double>(V)) {
        // the need-th tie in id order: contiguous chunks per thread, an exclusive scan of their tie counts
        const long long chunk = (V + FS_THREADS - 1) / FS_THREADS;
        const long long b0 = t * chunk, b1 = b0 + chunk < V ? b0 + chunk : V;
        double cnt = 0.0;
        for (long long i = b0; i < b1; ++i) cnt += fs_key(y[i]) == kp ? 1.0 : 0.0;
        double total;
        const double before = fs_block_exclusive(cnt, sh, &total);
        if (t == 0) sh_pick = V;
        __syncthreads();
        if (before < need && need <= before + cnt) {
          double seen = before;
          for (long long i = b0; i < b1; ++i) {
            if (fs_key(y[i]) != kp) continue;
            seen += 1.0;
            if (seen >= need) { sh_pick = i; break; }
          }
        }
        __syncthreads();
        last_id = sh_pick;
      }
    }
  }

  // 5. inverse CDF in id order: per-thread chunk masses, their scan, one chunk scanned again in the same order
  const long long chunk = (V + FS_THREADS - 1) / FS_THREADS;
  const long long b0 = t * chunk, b1 = b0 + chunk < V ? b0 + chunk : V;
  float mine = 0.0f;
  for (long long i = b0; i < b1; ++i) {
    const unsigned int k = fs_key(y[i]);
    if (k > kb || (k == kb && i <= last_id)) mine += __expf(y[i] - m);
  }
  double total;
  const double before = fs_block_exclusive(static_cast<double>(mine), sh, &total);
  const double target = uniforms[row] * total;
  if (t == 0) { sh_first = FS_THREADS; sh_last = -1; }
  __syncthreads();
  if (mine > 0.0f) {
    atomicMax(&sh_last, t);
    if (target < before + mine) atomicMin(&sh_first, t);
  }
  __syncthreads();
  const int owner = sh_first < FS_THREADS ? sh_first : sh_last;
  if (t == owner) {
    float acc = 0.0f;  // the same sequential sum as `mine`, so the crossing lies in this chunk
    long long pick = -1;
    for (long long i = b0; i < b1; ++i) {
      const unsigned int k = fs_key(y[i]);
      if (!(k > kb || (k == kb && i <= last_id))) continue;
      const float e = __expf(y[i] - m);
      if (e <= 0.0f) continue;
      acc += e;
      pick = i;
      if (before + acc > target) break;
    }
    out[row] = pick >= 0 ? pick : arg;
  }
  if (owner < 0 && t == 0) out[row] = arg;
}

template __global__ void fused_sample_kernel<float>(const float*, long long, const long long*, long long,
                                                    const double*, float, long long, float, float, float*,
                                                    long long*);
template __global__ void fused_sample_kernel<__half>(const __half*, long long, const long long*, long long,
                                                     const double*, float, long long, float, float, float*,
                                                     long long*);
template __global__ void fused_sample_kernel<__nv_bfloat16>(const __nv_bfloat16*, long long, const long long*,
                                                            long long, const double*, float, long long, float,
                                                            float, float*, long long*);
