// linear_logprobs on CPU: per token chunk, logits = h_chunk @ W^T goes to torch's BLAS, then one fused OpenMP
// loop per row does max, log-sum-exp, the target's log-prob and the entropy (forward), or turns the recomputed
// logits into their gradient in place (backward). Never more than one chunk of logits is alive: one buffer is
// allocated per call and every chunk's GEMM writes into it (a fresh 256 MiB tensor per chunk would be mmap'ed and
// zero-filled by the kernel page by page on first touch, ~0.15 s a chunk on a 2-core host).
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

// One row of forward: z = logits * inv_t; returns logp of `target`, the entropy and the lse.
template <typename T>
OGRPO_CLONES void row_forward(const T* __restrict__ row, int64_t vocab, int64_t target, float inv_t,
                              float* logp, float* ent, float* lse) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < vocab; ++j) {
    const float z = to_float(row[j]) * inv_t;
    m = z > m ? z : m;
  }
  // s = sum e^(z-m), t = sum e^(z-m) (z-m): H = log s - t / s, lse = m + log s.
  float s = 0.0f, t = 0.0f;
#pragma omp simd reduction(+ : s, t)
  for (int64_t j = 0; j < vocab; ++j) {
    const float d = to_float(row[j]) * inv_t - m;
    const float e = exp_neg(d);
    s += e;
    t += e * d;
  }
  const float log_s = std::log(s);
  *lse = m + log_s;
  *ent = log_s - t / s;
  *logp = (target >= 0 && target < vocab) ? to_float(row[target]) * inv_t - *lse : NAN;
}

// One row of backward, in place: logits -> dL/dlogits =
//   (g_logp * (onehot - p) - g_ent * p * (log p + H)) / T,   log p = z - lse.
// LOGP / ENT: whether g_logp / g_ent is nonzero. GRPO without an entropy bonus sends no entropy gradient (TRL
// computes the entropy under no_grad), so the common row skips that term; a zero term adds exactly 0 either way.
template <typename T, bool LOGP, bool ENT>
OGRPO_CLONES void row_backward(T* __restrict__ row, int64_t vocab, int64_t target, float inv_t, float lse,
                               float ent, float g_logp, float g_ent) {
  const float a = -g_logp * inv_t, b = -g_ent * inv_t;
#pragma omp simd
  for (int64_t j = 0; j < vocab; ++j) {
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
  if (LOGP && target >= 0 && target < vocab) row[target] = static_cast<T>(to_float(row[target]) + g_logp * inv_t);
}

void check_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2, "linear_logprobs: hidden [N,H] and weight [V,H] expected");
  TORCH_CHECK(hidden.size(1) == weight.size(1), "linear_logprobs: hidden and weight differ in H");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == hidden.size(0), "linear_logprobs: targets must be [N]");
  TORCH_CHECK(targets.scalar_type() == at::kLong, "linear_logprobs: targets must be int64");
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(), "linear_logprobs: hidden and weight dtypes differ");
}

// fp64 rows (gradcheck only): plain loops in double, no polynomial exp.
void row_forward_f64(const double* row, int64_t vocab, int64_t target, double inv_t, double* logp, double* ent,
                     double* lse) {
  double m = -INFINITY, s = 0.0, t = 0.0;
  for (int64_t j = 0; j < vocab; ++j) m = std::max(m, row[j] * inv_t);
  for (int64_t j = 0; j < vocab; ++j) {
    const double d = row[j] * inv_t - m, e = std::exp(d);
    s += e;
    t += e * d;
  }
  *lse = m + std::log(s);
  *ent = std::log(s) - t / s;
  *logp = (target >= 0 && target < vocab) ? row[target] * inv_t - *lse : NAN;
}

void row_backward_f64(double* row, int64_t vocab, int64_t target, double inv_t, double lse, double ent,
                      double g_logp, double g_ent) {
  for (int64_t j = 0; j < vocab; ++j) {
    const double lp = row[j] * inv_t - lse, p = std::exp(lp);
    row[j] = (-g_logp * p - g_ent * p * (lp + ent)) * inv_t;
  }
  if (target >= 0 && target < vocab) row[target] += g_logp * inv_t;
}

// A chunk of rows, OpenMP over rows (torch's thread count). Overloaded: fp64 rows take the plain-double path.
template <typename T>
void chunk_forward(const T* base, int64_t rows, int64_t vocab, const int64_t* tgt, float inv_t, float* lp, float* en,
                   float* ls) {
#pragma omp parallel for schedule(static) num_threads(threads())
  for (int64_t r = 0; r < rows; ++r) row_forward<T>(base + r * vocab, vocab, tgt[r], inv_t, lp + r, en + r, ls + r);
}

void chunk_forward(const double* base, int64_t rows, int64_t vocab, const int64_t* tgt, double inv_t, double* lp,
                   double* en, double* ls) {
#pragma omp parallel for schedule(static) num_threads(threads())
  for (int64_t r = 0; r < rows; ++r) row_forward_f64(base + r * vocab, vocab, tgt[r], inv_t, lp + r, en + r, ls + r);
}

template <typename T>
void chunk_backward(T* base, int64_t rows, int64_t vocab, const int64_t* tgt, float inv_t, const float* ls,
                    const float* en, const float* gl, const float* ge) {
#pragma omp parallel for schedule(static) num_threads(threads())
  for (int64_t r = 0; r < rows; ++r) {
    T* row = base + r * vocab;
    const bool logp = gl[r] != 0.0f, entropy = ge[r] != 0.0f;
    if (logp && entropy) {
      row_backward<T, true, true>(row, vocab, tgt[r], inv_t, ls[r], en[r], gl[r], ge[r]);
    } else if (logp) {
      row_backward<T, true, false>(row, vocab, tgt[r], inv_t, ls[r], en[r], gl[r], ge[r]);
    } else if (entropy) {
      row_backward<T, false, true>(row, vocab, tgt[r], inv_t, ls[r], en[r], gl[r], ge[r]);
    } else {
      std::fill(row, row + vocab, static_cast<T>(0.0f));  // no upstream gradient (a masked token): no exp at all
    }
  }
}

void chunk_backward(double* base, int64_t rows, int64_t vocab, const int64_t* tgt, double inv_t, const double* ls,
                    const double* en, const double* gl, const double* ge) {
#pragma omp parallel for schedule(static) num_threads(threads())
  for (int64_t r = 0; r < rows; ++r) {
    row_backward_f64(base + r * vocab, vocab, tgt[r], inv_t, ls[r], en[r], gl[r], ge[r]);
  }
}

// Outputs are fp32, or fp64 for fp64 inputs (so gradcheck sees full precision).
at::ScalarType out_dtype(const at::Tensor& hidden) {
  return hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// Chunks run short one first, so the last one is full: forward keeps the last chunk's logits (when asked: a
// backward will follow), and backward starts from them instead of recomputing that chunk's GEMM. The kept logits
// are the one chunk buffer forward allocates anyway, and backward reuses it for the other chunks, so the peak
// stays at one chunk; what is saved is rows_last / N of the backward's recompute (43% at 1k tokens, V = 151,936).
int64_t first_chunk_rows(int64_t n, int64_t chunk_size) {
  const int64_t rest = n % chunk_size;
  return rest == 0 ? std::min(n, chunk_size) : rest;
}

std::vector<at::Tensor> forward_cpu(const at::Tensor& hidden_in, const at::Tensor& weight, const at::Tensor& targets_in,
                                    double temperature, int64_t chunk_size, bool keep_last) {
  check_inputs(hidden_in, weight, targets_in);
  const auto hidden = hidden_in.contiguous();
  const auto targets = targets_in.contiguous();
  const int64_t n = hidden.size(0), vocab = weight.size(0);
  auto opts = hidden.options().dtype(out_dtype(hidden));
  auto logp = at::empty({n}, opts), ent = at::empty({n}, opts), lse = at::empty({n}, opts);
  const auto wt = weight.t();  // a view: BLAS reads W transposed, no copy (also for a non-contiguous W)
  const int64_t* tgt = targets.data_ptr<int64_t>();
  auto buffer = at::empty({std::min(chunk_size, n), vocab}, hidden.options());
  for (int64_t start = 0, rows = first_chunk_rows(n, chunk_size); start < n; start += rows, rows = chunk_size) {
    auto logits = buffer.narrow(0, 0, rows);  // leading rows of a contiguous buffer: contiguous
    at::mm_out(logits, hidden.narrow(0, start, rows), wt);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "linear_logprobs_fwd", [&] {
      using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
      const scalar_t* base = logits.data_ptr<scalar_t>();
      acc_t *lp = logp.data_ptr<acc_t>() + start, *en = ent.data_ptr<acc_t>() + start,
            *ls = lse.data_ptr<acc_t>() + start;
      chunk_forward(base, rows, vocab, tgt + start, static_cast<acc_t>(1.0 / temperature), lp, en, ls);
    });
  }
  // the last chunk (a full one, or all n rows) is what the buffer holds now
  auto kept = keep_last ? buffer : at::empty({0, vocab}, hidden.options());
  return {logp, ent, lse, kept};
}

std::vector<at::Tensor> backward_cpu(const at::Tensor& hidden_in, const at::Tensor& weight,
                                     const at::Tensor& targets_in, const at::Tensor& lse_in, const at::Tensor& ent_in,
                                     const at::Tensor& grad_logp_in, const at::Tensor& grad_ent_in, double temperature,
                                     int64_t chunk_size, bool need_hidden, bool need_weight, at::Tensor kept) {
  check_inputs(hidden_in, weight, targets_in);
  const auto hidden = hidden_in.contiguous();
  const auto targets = targets_in.contiguous();
  const auto acc = out_dtype(hidden);
  const auto lse = lse_in.to(acc).contiguous(), ent = ent_in.to(acc).contiguous();
  const auto g_logp = grad_logp_in.to(acc).contiguous(), g_ent = grad_ent_in.to(acc).contiguous();
  const int64_t n = hidden.size(0), vocab = weight.size(0);
  const bool have_kept = kept.numel() > 0;
  if (have_kept) {
    TORCH_CHECK(kept.dim() == 2 && kept.size(0) == std::min(chunk_size, n) && kept.size(1) == vocab &&
                    kept.scalar_type() == hidden.scalar_type() && kept.is_contiguous(),
                "linear_logprobs: the kept logits do not belong to this call (", kept.sizes(), ")");
  }
  auto grad_h = need_hidden ? at::empty_like(hidden) : at::empty({0}, hidden.options());
  // grad_w: the first chunk's GEMM writes it (beta = 0), later ones accumulate into it; no zero fill of [V, H]
  auto grad_w = need_weight ? at::empty(weight.sizes(), weight.options().memory_format(at::MemoryFormat::Contiguous))
                            : at::empty({0}, weight.options());
  if (need_weight && n == 0) grad_w.zero_();
  const auto wt = weight.t();
  const int64_t* tgt = targets.data_ptr<int64_t>();
  // the forward's last chunk first (from its kept logits, no GEMM), then the others, recomputed into that buffer
  auto buffer = have_kept ? kept : at::empty({std::min(chunk_size, n), vocab}, hidden.options());
  const int64_t first = first_chunk_rows(n, chunk_size);
  bool first_grad_w = true;
  for (int64_t end = n; end > 0;) {
    const int64_t rows = end <= first ? end : chunk_size, start = end - rows;
    end = start;
    const auto h = hidden.narrow(0, start, rows);
    auto dlogits = buffer.narrow(0, 0, rows);  // the chunk's logits; become dL/dlogits in place
    if (!(have_kept && start + rows == n)) at::mm_out(dlogits, h, wt);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dlogits.scalar_type(), "linear_logprobs_bwd", [&] {
      using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
      scalar_t* base = dlogits.data_ptr<scalar_t>();
      const acc_t *ls = lse.data_ptr<acc_t>() + start, *en = ent.data_ptr<acc_t>() + start,
                  *gl = g_logp.data_ptr<acc_t>() + start, *ge = g_ent.data_ptr<acc_t>() + start;
      chunk_backward(base, rows, vocab, tgt + start, static_cast<acc_t>(1.0 / temperature), ls, en, gl, ge);
    });
    if (need_hidden) {
      auto out = grad_h.narrow(0, start, rows);
      at::matmul_out(out, dlogits, weight);
    }
    if (need_weight) {
      if (first_grad_w) {
        at::mm_out(grad_w, dlogits.t(), h);
        first_grad_w = false;
      } else {
        grad_w.addmm_(dlogits.t(), h);
      }
    }
  }
  return {grad_h, grad_w};
}

bool is_cuda(const at::Tensor& t) { return t.is_cuda(); }

// keep_last / kept: the CPU kernel's saved last chunk (above); the CUDA kernels recompute every chunk, so they
// return no kept logits and ignore any.
std::vector<at::Tensor> forward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                double temperature, int64_t chunk_size, bool keep_last) {
  TORCH_CHECK(chunk_size > 0 && temperature > 0, "linear_logprobs: chunk_size and temperature must be positive");
  if (is_cuda(hidden)) {
    TORCH_CHECK(linear_logprobs_forward_cuda != nullptr, "linear_logprobs: this build has no CUDA kernels");
    auto out = linear_logprobs_forward_cuda(hidden, weight, targets, temperature, chunk_size);
    out.push_back(at::empty({0, weight.size(0)}, hidden.options()));
    return out;
  }
  return forward_cpu(hidden, weight, targets, temperature, chunk_size, keep_last);
}

std::vector<at::Tensor> backward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                 const at::Tensor& lse, const at::Tensor& ent, const at::Tensor& grad_logp,
                                 const at::Tensor& grad_ent, double temperature, int64_t chunk_size, bool need_hidden,
                                 bool need_weight, const at::Tensor& kept) {
  TORCH_CHECK(chunk_size > 0 && temperature > 0, "linear_logprobs: chunk_size and temperature must be positive");
  if (is_cuda(hidden)) {
    TORCH_CHECK(linear_logprobs_backward_cuda != nullptr, "linear_logprobs: this build has no CUDA kernels");
    return linear_logprobs_backward_cuda(hidden, weight, targets, lse, ent, grad_logp, grad_ent, temperature,
                                         chunk_size, need_hidden, need_weight);
  }
  return backward_cpu(hidden, weight, targets, lse, ent, grad_logp, grad_ent, temperature, chunk_size, need_hidden,
                      need_weight, kept);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward,
        "(hidden[N,H], weight[V,H], targets[N], T, chunk, keep_last) -> [logp, entropy, lse] fp32, kept logits");
  m.def("backward", &backward,
        "kept chunk + recomputed chunks, in-place dlogits (kept is overwritten) -> [grad_hidden, grad_weight]");
  m.def("has_cuda", [] { return linear_logprobs_forward_cuda != nullptr; });
}
