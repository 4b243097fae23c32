// linear_logprobs on CPU: per tile of logits (a token chunk by a vocabulary block, see Tiling), logits =
// h_chunk @ W_block^T goes to torch's BLAS, then one fused OpenMP loop per row does max, sum-exp, the target's logit
// and the entropy terms (forward, merged across blocks), or turns the recomputed logits into their gradient in
// place (backward). Never more than one chunk's worth of logits (chunk_size x V elements) is alive: one buffer is
// allocated per call and every tile's GEMM writes into it.
//
// Row math is fp32 whatever the input dtype (fp16/bf16 logits are upcast as they are read). The inner loops are
// `omp simd` reductions over a polynomial exp, so GCC vectorizes them without -ffast-math; `target_clones` builds
// AVX-512 and AVX2+FMA copies next to the baseline one and picks one at load time, keeping the binary portable.
//
// The CUDA build adds linear_logprobs_cuda.cu, which defines the *_cuda entry points declared weak below; the
// Python-facing forward/backward route CUDA tensors to them.

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>

std::vector<at::Tensor> linear_logprobs_forward_cuda(const at::Tensor& hidden, const at::Tensor& weight,
                                                     const at::Tensor& targets, double temperature,
                                                     int64_t chunk_size) __attribute__((weak));
std::vector<at::Tensor> linear_logprobs_backward_cuda(const at::Tensor& hidden, const at::Tensor& weight,
                                                      const at::Tensor& targets, const at::Tensor& lse,
                                                      const at::Tensor& ent, const at::Tensor& grad_logp,
                                                      const at::Tensor& grad_ent, double temperature,
                                                      int64_t chunk_size, bool need_hidden,
                                                      bool need_weight) __attribute__((weak));

namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define OGRPO_CLONES __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
#else
#define OGRPO_CLONES
#endif

// exp(x) for x <= 0 (all this file needs: x = z - max), Cephes-style: x = n ln2 + r, |r| <= ln2/2, a degree-6
// polynomial for e^r (relative error ~2e-7, like expf), then 2^n through the exponent bits. Inputs below -87
// give ~1e-38 instead of a denormal: such terms cannot move a float sum that contains e^0 = 1.
#pragma omp declare simd notinbranch
static inline float exp_neg(float x) {
  x = x < -87.0f ? -87.0f : x;
  // round to nearest via the 1.5*2^23 trick: vectorizes on baseline SSE2, where nearbyint does not
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

int threads() { return std::max(1, at::get_num_threads()); }

inline float to_float(float v) { return v; }
inline float to_float(c10::Half v) { return static_cast<float>(v); }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// A row's statistics over one vocabulary block, merged across blocks like an online softmax: m the max of
// z = logits * inv_t, s = sum e^(z-m), t = sum e^(z-m) (z-m); zt the target's z once its block is seen.
// At the end: lse = m + log s, H = log s - t / s, logp = zt - lse.
template <typename A>
struct RowStats {
  A m, s, t, zt;
};

template <typename A>
inline void merge(RowStats<A>& r, A mb, A sb, A tb) {
  if (!(r.m > -INFINITY)) {  // the row's first block
    r.m = mb, r.s = sb, r.t = tb;
    return;
  }
  const A big = std::max(r.m, mb), a = std::exp(r.m - big), b = std::exp(mb - big);
  r.t = a * (r.t + (r.m - big) * r.s) + b * (tb + (mb - big) * sb);
  r.s = a * r.s + b * sb;
  r.m = big;
}

template <typename A>
inline void finish(const RowStats<A>& r, A* logp, A* ent, A* lse) {
  const A log_s = std::log(r.s);
  *lse = r.m + log_s;
  *ent = log_s - r.t / r.s;
  *logp = r.zt - *lse;  // NaN for a target outside [0, V): zt never set
}

// One row of one block: its m, s, t; the target's z if the target (block-local index) lies in the block.
template <typename T>
OGRPO_CLONES void row_forward(const T* __restrict__ row, int64_t cols, int64_t target, float inv_t,
                              RowStats<float>* st) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < cols; ++j) {
    const float z = to_float(row[j]) * inv_t;
    m = z > m ? z : m;
  }
  float s = 0.0f, t = 0.0f;
#pragma omp simd reduction(+ : s, t)
  for (int64_t j = 0; j < cols; ++j) {
    const float d = to_float(row[j]) * inv_t - m;
    const float e = exp_neg(d);
    s += e;
    t += e * d;
  }
  merge(*st, m, s, t);
  if (target >= 0 && target < cols) st->zt = to_float(row[target]) * inv_t;
}

// fp64 rows (gradcheck only): plain loops in double, no polynomial exp.
void row_forward(const double* row, int64_t cols, int64_t target, double inv_t, RowStats<double>* st) {
  double m = -INFINITY, s = 0.0, t = 0.0;
  for (int64_t j = 0; j < cols; ++j) m = std::max(m, row[j] * inv_t);
  for (int64_t j = 0; j < cols; ++j) {
    const double d = row[j] * inv_t - m, e = std::exp(d);
    s += e;
    t += e * d;
  }
  merge(*st, m, s, t);
  if (target >= 0 && target < cols) st->zt = row[target] * inv_t;
}

// One row of one block, in place: logits -> dL/dlogits =
//   (g_logp * (onehot - p) - g_ent * p * (log p + H)) / T,   log p = z - lse.
// LOGP / ENT: whether g_logp / g_ent is nonzero. GRPO without an entropy bonus sends no entropy gradient (TRL
// computes the entropy under no_grad), so the common row skips that term; a zero term adds exactly 0 either way.
template <typename T, bool LOGP, bool ENT>
OGRPO_CLONES void row_backward(T* __restrict__ row, int64_t cols, int64_t target, float inv_t, float lse,
                               float ent, float g_logp, float g_ent) {
  const float a = -g_logp * inv_t, b = -g_ent * inv_t;
#pragma omp simd
  for (int64_t j = 0; j < cols; ++j) {
    const float lp = to_float(row[j]) * inv_t - lse;
    const float p = exp_neg(lp);
    float d;
    if constexpr (LOGP && ENT) {
      d = p * (a + b * (lp + ent));
    } else if constexpr (LOGP) {
      d = a * p;
    } else {
      d = b * p * (lp + ent);
    }
    row[j] = static_cast<T>(d);
  }
  if (LOGP && target >= 0 && target < cols) row[target] = static_cast<T>(to_float(row[target]) + g_logp * inv_t);
}

void row_backward_f64(double* row, int64_t cols, int64_t target, double inv_t, double lse, double ent,
                      double g_logp, double g_ent) {
  for (int64_t j = 0; j < cols; ++j) {
    const double lp = row[j] * inv_t - lse, p = std::exp(lp);
    row[j] = (-g_logp * p - g_ent * p * (lp + ent)) * inv_t;
  }
  if (target >= 0 && target < cols) row[target] += g_logp * inv_t;
}

void check_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2, "linear_logprobs: hidden [N,H] and weight [V,H] expected");
  TORCH_CHECK(hidden.size(1) == weight.size(1), "linear_logprobs: hidden and weight differ in H");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == hidden.size(0), "linear_logprobs: targets must be [N]");
  TORCH_CHECK(targets.scalar_type() == at::kLong, "linear_logprobs: targets must be int64");
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(), "linear_logprobs: hidden and weight dtypes differ");
}

// One tile (rows x cols of logits, vocabulary offset v0), OpenMP over rows (torch's thread count).
template <typename T, typename A>
void tile_forward(const T* base, int64_t rows, int64_t cols, int64_t v0, const int64_t* tgt, A inv_t,
                  RowStats<A>* st) {
#pragma omp parallel for schedule(static) num_threads(threads())
  for (int64_t r = 0; r < rows; ++r) row_forward(base + r * cols, cols, tgt[r] - v0, inv_t, st + r);
}

template <typename T>
void tile_backward(T* base, int64_t rows, int64_t cols, int64_t v0, const int64_t* tgt, float inv_t,
                   const float* ls, const float* en, const float* gl, const float* ge) {
#pragma omp parallel for schedule(static) num_threads(threads())
  for (int64_t r = 0; r < rows; ++r) {
    T* row = base + r * cols;
    const int64_t target = tgt[r] - v0;
    const bool logp = gl[r] != 0.0f, entropy = ge[r] != 0.0f;
    if (logp && entropy) {
      row_backward<T, true, true>(row, cols, target, inv_t, ls[r], en[r], gl[r], ge[r]);
    } else if (logp) {
      row_backward<T, true, false>(row, cols, target, inv_t, ls[r], en[r], gl[r], ge[r]);
    } else if (entropy) {
      row_backward<T, false, true>(row, cols, target, inv_t, ls[r], en[r], gl[r], ge[r]);
    } else {
      std::fill(row, row + cols, static_cast<T>(0.0f));  // no upstream gradient (a masked token): no exp at all
    }
  }
}

void tile_backward(double* base, int64_t rows, int64_t cols, int64_t v0, const int64_t* tgt, double inv_t,
                   const double* ls, const double* en, const double* gl, const double* ge) {
#pragma omp parallel for schedule(static) num_threads(threads())
  for (int64_t r = 0; r < rows; ++r) {
    row_backward_f64(base + r * cols, cols, tgt[r] - v0, inv_t, ls[r], en[r], gl[r], ge[r]);
  }
}

// Outputs are fp32, or fp64 for fp64 inputs (so gradcheck sees full precision).
at::ScalarType out_dtype(const at::Tensor& hidden) {
  return hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// The logits are computed one tile at a time: up to `max_rows` tokens by as many vocabulary columns as keep the
// tile within chunk_size * V elements (the op's one-chunk bound). Tall tiles keep the BLAS efficient: a GEMM of a
// few hundred rows against the whole [V, H] head ran 10-20% slower than one of 1-4k rows against a vocabulary
// block, and MKL kept up to 86 MiB of packing buffers for the short ones. The price is an online softmax across
// blocks (RowStats). Token chunks and vocabulary blocks run short one first, so the last tile is a full one:
// forward keeps it (when a backward will follow) and backward starts from it instead of recomputing its GEMM.
struct Tiling {
  int64_t rows, cols;  // the full tile; the first chunk / block may be shorter
  int64_t first_rows, first_cols;
  int64_t elements() const { return rows * cols; }
};

Tiling tiling(int64_t n, int64_t vocab, int64_t chunk_size, int64_t max_rows) {
  Tiling t;
  t.rows = std::max<int64_t>(1, std::min(n, max_rows));
  t.cols = std::max<int64_t>(1, std::min(vocab, chunk_size * vocab / t.rows));
  const int64_t rest_rows = n % t.rows, rest_cols = vocab % t.cols;
  t.first_rows = rest_rows == 0 ? std::min(n, t.rows) : rest_rows;
  t.first_cols = rest_cols == 0 ? std::min(vocab, t.cols) : rest_cols;
  return t;
}

std::vector<at::Tensor> forward_cpu(const at::Tensor& hidden_in, const at::Tensor& weight, const at::Tensor& targets_in,
                                    double temperature, int64_t chunk_size, bool keep_last, int64_t max_rows) {
  check_inputs(hidden_in, weight, targets_in);
  const auto hidden = hidden_in.contiguous();
  const auto targets = targets_in.contiguous();
  const int64_t n = hidden.size(0), vocab = weight.size(0);
  const Tiling tl = tiling(n, vocab, chunk_size, max_rows);
  auto opts = hidden.options().dtype(out_dtype(hidden));
  auto logp = at::empty({n}, opts), ent = at::empty({n}, opts), lse = at::empty({n}, opts);
  const int64_t* tgt = targets.data_ptr<int64_t>();
  // one buffer for every tile (a fresh 192 MiB tensor per tile would be mmap'ed and zero-filled by the kernel page
  // by page on first touch, ~0.15 s each on a 2-core host)
  auto buffer = at::empty({n == 0 ? 0 : tl.elements()}, hidden.options());
  for (int64_t start = 0, rows = tl.first_rows; start < n; start += rows, rows = tl.rows) {
    const auto h = hidden.narrow(0, start, rows);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, hidden.scalar_type(), "linear_logprobs_fwd", [&] {
      using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
      const auto nan = std::numeric_limits<acc_t>::quiet_NaN();
      std::vector<RowStats<acc_t>> stats(rows, RowStats<acc_t>{-INFINITY, 0, 0, nan});
      const acc_t inv_t = static_cast<acc_t>(1.0 / temperature);
      for (int64_t v0 = 0, cols = tl.first_cols; v0 < vocab; v0 += cols, cols = tl.cols) {
        auto tile = buffer.narrow(0, 0, rows * cols).view({rows, cols});
        at::mm_out(tile, h, weight.narrow(0, v0, cols).t());  // a view: BLAS reads W transposed, no copy
        tile_forward(tile.data_ptr<scalar_t>(), rows, cols, v0, tgt + start, inv_t, stats.data());
      }
      acc_t *lp = logp.data_ptr<acc_t>() + start, *en = ent.data_ptr<acc_t>() + start,
            *ls = lse.data_ptr<acc_t>() + start;
      for (int64_t r = 0; r < rows; ++r) finish(stats[r], lp + r, en + r, ls + r);
    });
  }
  // the last tile (a full one) is what the buffer holds now
  auto kept = keep_last ? buffer : at::empty({0}, hidden.options());
  return {logp, ent, lse, kept};
}

std::vector<at::Tensor> backward_cpu(const at::Tensor& hidden_in, const at::Tensor& weight,
                                     const at::Tensor& targets_in, const at::Tensor& lse_in, const at::Tensor& ent_in,
                                     const at::Tensor& grad_logp_in, const at::Tensor& grad_ent_in, double temperature,
                                     int64_t chunk_size, bool need_hidden, bool need_weight, at::Tensor kept,
                                     int64_t max_rows) {
  check_inputs(hidden_in, weight, targets_in);
  const auto hidden = hidden_in.contiguous();
  const auto targets = targets_in.contiguous();
  const auto acc = out_dtype(hidden);
  const auto lse = lse_in.to(acc).contiguous(), ent = ent_in.to(acc).contiguous();
  const auto g_logp = grad_logp_in.to(acc).contiguous(), g_ent = grad_ent_in.to(acc).contiguous();
  const int64_t n = hidden.size(0), vocab = weight.size(0);
  const Tiling tl = tiling(n, vocab, chunk_size, max_rows);
  const bool have_kept = kept.numel() > 0;
  if (have_kept) {
    TORCH_CHECK(kept.dim() == 1 && kept.numel() == tl.elements() && kept.scalar_type() == hidden.scalar_type() &&
                    kept.is_contiguous(),
                "linear_logprobs: the kept logits do not belong to this call (", kept.sizes(), ")");
  }
  auto grad_h = need_hidden ? at::empty_like(hidden) : at::empty({0}, hidden.options());
  // the first token chunk's GEMMs write grad_w (beta = 0), later ones accumulate into it: no zero fill of [V, H]
  auto grad_w = need_weight ? at::empty(weight.sizes(), weight.options().memory_format(at::MemoryFormat::Contiguous))
                            : at::empty({0}, weight.options());
  if (need_weight && n == 0) grad_w.zero_();
  const int64_t* tgt = targets.data_ptr<int64_t>();
  // the forward's last tile first (from its kept logits, no GEMM), then the others, recomputed into that buffer
  auto buffer = have_kept ? kept : at::empty({n == 0 ? 0 : tl.elements()}, hidden.options());
  bool first_chunk = true, from_kept = have_kept;
  for (int64_t end = n; end > 0; first_chunk = false) {
    const int64_t rows = end <= tl.first_rows ? end : tl.rows, start = end - rows;
    end = start;
    const auto h = hidden.narrow(0, start, rows);
    auto gh = need_hidden ? grad_h.narrow(0, start, rows) : grad_h;
    for (int64_t stop = vocab; stop > 0;) {
      const int64_t cols = stop <= tl.first_cols ? stop : tl.cols, v0 = stop - cols;
      const bool last_block = stop == vocab;
      stop = v0;
      const auto w = weight.narrow(0, v0, cols);
      auto dlogits = buffer.narrow(0, 0, rows * cols).view({rows, cols});  // become dL/dlogits in place
      if (!from_kept) at::mm_out(dlogits, h, w.t());
      from_kept = false;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dlogits.scalar_type(), "linear_logprobs_bwd", [&] {
        using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
        const acc_t *ls = lse.data_ptr<acc_t>() + start, *en = ent.data_ptr<acc_t>() + start,
                    *gl = g_logp.data_ptr<acc_t>() + start, *ge = g_ent.data_ptr<acc_t>() + start;
        tile_backward(dlogits.data_ptr<scalar_t>(), rows, cols, v0, tgt + start,
                      static_cast<acc_t>(1.0 / temperature), ls, en, gl, ge);
      });
      if (need_hidden) {
        if (last_block) {
          at::mm_out(gh, dlogits, w);
        } else {
          gh.addmm_(dlogits, w);
        }
      }
      if (need_weight) {
        auto gw = grad_w.narrow(0, v0, cols);
        if (first_chunk) {
          at::mm_out(gw, dlogits.t(), h);
        } else {
          gw.addmm_(dlogits.t(), h);
        }
      }
    }
  }
  return {grad_h, grad_w};
}

bool is_cuda(const at::Tensor& t) { return t.is_cuda(); }

// keep_last / kept: the CPU kernel's saved last tile (above); the CUDA kernels recompute every chunk, so they
// return no kept logits and ignore any, and tile by token chunks only (max_rows unused).
std::vector<at::Tensor> forward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                double temperature, int64_t chunk_size, bool keep_last, int64_t max_rows) {
  TORCH_CHECK(chunk_size > 0 && temperature > 0, "linear_logprobs: chunk_size and temperature must be positive");
  if (is_cuda(hidden)) {
    TORCH_CHECK(linear_logprobs_forward_cuda != nullptr, "linear_logprobs: this build has no CUDA kernels");
    auto out = linear_logprobs_forward_cuda(hidden, weight, targets, temperature, chunk_size);
    out.push_back(at::empty({0}, hidden.options()));
    return out;
  }
  TORCH_CHECK(max_rows > 0, "linear_logprobs: max_rows must be positive");
  return forward_cpu(hidden, weight, targets, temperature, chunk_size, keep_last, max_rows);
}

std::vector<at::Tensor> backward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                 const at::Tensor& lse, const at::Tensor& ent, const at::Tensor& grad_logp,
                                 const at::Tensor& grad_ent, double temperature, int64_t chunk_size, bool need_hidden,
                                 bool need_weight, const at::Tensor& kept, int64_t max_rows) {
  TORCH_CHECK(chunk_size > 0 && temperature > 0, "linear_logprobs: chunk_size and temperature must be positive");
  if (is_cuda(hidden)) {
    TORCH_CHECK(linear_logprobs_backward_cuda != nullptr, "linear_logprobs: this build has no CUDA kernels");
    return linear_logprobs_backward_cuda(hidden, weight, targets, lse, ent, grad_logp, grad_ent, temperature,
                                         chunk_size, need_hidden, need_weight);
  }
  TORCH_CHECK(max_rows > 0, "linear_logprobs: max_rows must be positive");
  return backward_cpu(hidden, weight, targets, lse, ent, grad_logp, grad_ent, temperature, chunk_size, need_hidden,
                      need_weight, kept, max_rows);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward,
        "(hidden[N,H], weight[V,H], targets[N], T, chunk, keep_last, max_rows) -> [logp, entropy, lse] fp32, "
        "kept logits (the last tile, flat)");
  m.def("backward", &backward,
        "kept tile + recomputed tiles, in-place dlogits (kept is overwritten) -> [grad_hidden, grad_weight]");
  m.def("has_cuda", [] { return linear_logprobs_forward_cuda != nullptr; });
}
