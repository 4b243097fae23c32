// Fused next-token sampling on CPU: repetition penalty -> temperature -> top-k -> top-p -> inverse-CDF draw,
// one row per OpenMP task, never sorting the full vocabulary.
//
// Semantics follow transformers' RepetitionPenalty/Temperature/TopK/TopP processors (see reference.py); the one
// free choice is the order among tied logits at the top-p boundary (torch.sort is unstable there): we rank equal
// logits by lower token id first, so top_p -> 0 keeps exactly torch.argmax's token.
//
// Per row (V = 151,936 floats = 600 KB, stays in L2 between passes):
//   1. y = float(logits) with the penalty gathered from the row's previous tokens (idempotent, so duplicates need
//      no token set), then y /= temperature.
//   2. top-k on: a candidate buffer filled with y >= running threshold, shrunk with nth_element when full
//      (blocks whose max is below the threshold are skipped), then top-p over the k sorted candidates.
//   3. top-k off: e = exp(y - max) (vectorized, with 256-element block sums); top-p by a 2048-bucket histogram of
//      probability mass over (max - y), so only the boundary bucket is sorted: at top_p 0.95 and V = 151,936,
//      598 / 344 / 104 tokens for N(0, s) logits with s = 1 / 2 / 3 (which keep 112k / 55k / 14k tokens).
//   4. one uniform per row (drawn by the caller from its torch.Generator): the first kept token, in token-id order,
//      whose cumulative mass exceeds u * Z_kept; the block sums find the block, one block is scanned.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// Defined by fused_sample_cuda.cu in the CUDA build only; weak, so the CPU build links with it null.
torch::Tensor fused_sample_cuda(const torch::Tensor& logits, const c10::optional<torch::Tensor>& previous_tokens,
                                const torch::Tensor& uniforms, double temperature, int64_t top_k, double top_p,
                                double repetition_penalty) __attribute__((weak));

namespace {

constexpr int64_t kBlock = 256;       // block sums for the inverse-CDF search
constexpr int64_t kSkipBlock = 64;    // top-k: blocks skipped when their max is below the threshold
constexpr int kBuckets = 2048;        // top-p histogram over d = max - y in [0, kRange)
constexpr float kRange = 24.0f;       // exp(-24) = 3.8e-11: tokens past it share the last bucket

// exp(x) for x <= 0 in plain arithmetic GCC vectorizes with baseline SSE2 (libm's expf is not vectorized without
// -ffast-math, and -ffast-math would also reorder the sums). Cody-Waite reduction + degree-6 polynomial:
// relative error < 2e-7 on [-87, 0]; exactly 0 below -87.3 (so -inf logits get zero mass, like softmax).
inline float exp_nonpos(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float t = xc * 1.44269504088896341f;
  const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest (default rounding mode)
  float r = xc - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.3f ? 0.0f : p * scale;
}

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

struct Params {
  float temperature;  // 0 = greedy
  int64_t top_k;      // 0 = off
  double top_p;       // 1 = off
  float penalty;      // 1 = off
};

struct Scratch {
  std::vector<float> y, e, block_sum;
  std::vector<int32_t> cand;
  std::vector<double> mass;
  std::vector<int64_t> count;
};

struct Kept {  // the last kept token in (value desc, id asc) order: kept <=> ranked at or above it
  float y;
  int64_t i;
  inline bool operator()(float v, int64_t j) const { return v > y || (v == y && j <= i); }
};

inline bool ranks_before(float ya, int64_t ia, float yb, int64_t ib) { return ya > yb || (ya == yb && ia < ib); }

int64_t argmax_first(const float* y, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 1; i < V; ++i)
    if (y[i] > y[best] || (std::isnan(y[i]) && !std::isnan(y[best]))) best = i;  // torch.argmax: NaN wins
  return best;
}

// First token of `ids` (ascending) whose cumulative mass exceeds target; the last positive one on rounding.
int64_t draw_sorted(const std::vector<int32_t>& ids, const std::vector<float>& mass, double target) {
  double cum = 0.0;
  int64_t last = ids.empty() ? 0 : ids[0];
  for (size_t j = 0; j < ids.size(); ++j) {
    if (mass[j] <= 0.0f) continue;
    cum += mass[j];
    last = ids[j];
    if (cum > target) return ids[j];
  }
  return last;
}

int64_t sample_topk(Scratch& s, int64_t V, float m, const Params& p, double u) {
  const float* y = s.y.data();
  const int64_t k = p.top_k;
  auto& cand = s.cand;
  cand.clear();
  size_t cap = static_cast<size_t>(std::max<int64_t>(2 * k, k + 1024));
  cand.reserve(cap);
  float thr = -std::numeric_limits<float>::infinity();
  auto by_value_desc = [y](int32_t a, int32_t b) { return ranks_before(y[a], a, y[b], b); };
  auto shrink = [&]() {
    std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), by_value_desc);
    thr = y[cand[k - 1]];
    size_t w = 0;
    for (size_t j = 0; j < cand.size(); ++j)
      if (y[cand[j]] >= thr) cand[w++] = cand[j];  // ties with the k-th value stay (transformers keeps them)
    cand.resize(w);
  };
  for (int64_t b0 = 0; b0 < V; b0 += kSkipBlock) {
    const int64_t b1 = std::min(V, b0 + kSkipBlock);
    {  // a block below the threshold has nothing to offer
      float bmax = y[b0];
#pragma omp simd reduction(max : bmax)
      for (int64_t i = b0 + 1; i < b1; ++i) bmax = y[i] > bmax ? y[i] : bmax;
      if (bmax < thr) continue;
    }
    for (int64_t i = b0; i < b1; ++i)
      if (y[i] >= thr) cand.push_back(static_cast<int32_t>(i));
    if (cand.size() >= cap) {
      shrink();
      if (cand.size() * 2 > cap) cap *= 2;  // many ties with the k-th value: grow instead of thrashing
    }
  }
  if (static_cast<int64_t>(cand.size()) > k) shrink();

  std::sort(cand.begin(), cand.end(), by_value_desc);
  const size_t n = cand.size();
  auto& mass = s.e;  // reused as the candidates' masses
  double Z = 0.0;
  for (size_t j = 0; j < n; ++j) {
    mass[j] = exp_nonpos(y[cand[j]] - m);
    Z += mass[j];
  }
  size_t keep = n;
  if (p.top_p < 1.0) {
    const double pZ = p.top_p * Z;
    double S = 0.0;
    keep = 0;
    while (keep < n && (keep == 0 || S < pZ)) S += mass[keep++];
    Z = S;
  }
  // Draw in token-id order, the same order as the full-vocabulary path and the CUDA kernel.
  std::vector<std::pair<int32_t, float>> kept(keep);
  for (size_t j = 0; j < keep; ++j) kept[j] = {cand[j], mass[j]};
  std::sort(kept.begin(), kept.end());
  std::vector<int32_t> ids(keep);
  std::vector<float> ms(keep);
  for (size_t j = 0; j < keep; ++j) {
    ids[j] = kept[j].first;
    ms[j] = kept[j].second;
  }
  return draw_sorted(ids, ms, u * Z);
}

inline int bucket_of(float v, float m) {
  const float d = m - v;  // >= 0; +inf for -inf logits
  return d < kRange ? static_cast<int>(d * (kBuckets / kRange)) : kBuckets - 1;
}

int64_t sample_full(Scratch& s, int64_t V, float m, const Params& p, double u) {
  const float* y = s.y.data();
  float* e = s.e.data();
  const int64_t nblk = (V + kBlock - 1) / kBlock;
  float* bs = s.block_sum.data();
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t b0 = b * kBlock, b1 = std::min(V, b0 + kBlock);
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = b0; i < b1; ++i) {
      const float v = exp_nonpos(y[i] - m);
      e[i] = v;
      acc += v;
    }
    bs[b] = acc;
  }

  Kept kept{-std::numeric_limits<float>::infinity(), V};  // everything
  bool filtered = false;
  if (p.top_p < 1.0) {
    double Z = 0.0;
    for (int64_t b = 0; b < nblk; ++b) Z += bs[b];
    const double pZ = p.top_p * Z;
    auto& mass = s.mass;
    auto& count = s.count;
    std::fill(mass.begin(), mass.end(), 0.0);
    std::fill(count.begin(), count.end(), 0);
    for (int64_t i = 0; i < V; ++i) {
      const int b = bucket_of(y[i], m);
      mass[b] += e[i];
      count[b] += 1;
    }
    double before = 0.0;
    int64_t n_before = 0;
    int bb = -1;
    for (int b = 0; b < kBuckets; ++b) {
      if (count[b] == 0) continue;
      if (before + mass[b] >= pZ) { bb = b; break; }
      before += mass[b];
      n_before += count[b];
    }
    if (bb >= 0) {
      auto& cand = s.cand;
      cand.clear();
      for (int64_t i = 0; i < V; ++i)
        if (bucket_of(y[i], m) == bb) cand.push_back(static_cast<int32_t>(i));
      std::sort(cand.begin(), cand.end(), [y](int32_t a, int32_t b) { return ranks_before(y[a], a, y[b], b); });
      double S = before;
      size_t last = 0;
      for (size_t j = 0; j < cand.size(); ++j) {
        if (!(S < pZ || (j == 0 && n_before == 0))) break;
        last = j;
        S += e[cand[j]];
      }
      kept = Kept{y[cand[last]], cand[last]};
      filtered = true;
    }  // else rounding left the total short of top_p * Z: keep all
  }

  if (filtered) {
    const float ky = kept.y;
    const int64_t ki = kept.i;
    for (int64_t b = 0; b < nblk; ++b) {
      const int64_t b0 = b * kBlock, b1 = std::min(V, b0 + kBlock);
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = b0; i < b1; ++i) acc += (y[i] > ky || (y[i] == ky && i <= ki)) ? e[i] : 0.0f;
      bs[b] = acc;
    }
  }
  double Z = 0.0;
  for (int64_t b = 0; b < nblk; ++b) Z += bs[b];
  const double target = u * Z;
  double cum = 0.0;
  int64_t last_block = -1;
  for (int64_t b = 0; b < nblk; ++b) {
    if (bs[b] <= 0.0f) continue;
    last_block = b;
    if (cum + bs[b] > target || b == nblk - 1) break;
    cum += bs[b];
  }
  if (last_block < 0) return argmax_first(y, V);
  // Scan the chosen block only; on rounding, its last positive kept token.
  const int64_t b0 = last_block * kBlock, b1 = std::min(V, b0 + kBlock);
  const double local = target - cum;
  double acc = 0.0;
  int64_t last = -1;
  for (int64_t i = b0; i < b1; ++i) {
    if (e[i] <= 0.0f || !kept(y[i], i)) continue;
    acc += e[i];
    last = i;
    if (acc > local) return i;
  }
  return last >= 0 ? last : argmax_first(y, V);
}

template <typename T>
int64_t sample_row(const T* x, int64_t V, const int64_t* prev, int64_t L, double u, const Params& p, Scratch& s) {
  float* y = s.y.data();
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(y, x, sizeof(float) * V);
  } else {
    for (int64_t i = 0; i < V; ++i) y[i] = to_f(x[i]);
  }
  if (p.penalty != 1.0f && prev != nullptr) {
    // Gathered from the unpenalized logits, so a token repeated in `prev` is penalized once (transformers'
    // gather/scatter); ids outside [0, V) are padding and ignored.
    for (int64_t j = 0; j < L; ++j) {
      const int64_t t = prev[j];
      if (t < 0 || t >= V) continue;
      const float v = to_f(x[t]);
      y[t] = v < 0.0f ? v * p.penalty : v / p.penalty;
    }
  }
  if (p.temperature == 0.0f) return argmax_first(y, V);
  if (p.temperature != 1.0f) {
    const float t = p.temperature;
#pragma omp simd
    for (int64_t i = 0; i < V; ++i) y[i] = y[i] / t;
  }
  float m = y[0];
#pragma omp simd reduction(max : m)
  for (int64_t i = 1; i < V; ++i) m = y[i] > m ? y[i] : m;
  if (!std::isfinite(m)) return argmax_first(y, V);  // all -inf (or +inf): no distribution to sample
  if (p.top_k > 0 && p.top_k < V) return sample_topk(s, V, m, p, u);
  return sample_full(s, V, m, p, u);
}

// OpenMP pragmas cannot sit inside AT_DISPATCH's lambda (a macro argument), hence this function.
template <typename T>
void run_rows(const T* xp, int64_t B, int64_t V, const int64_t* pp, int64_t L, const double* up, const Params& p,
              int64_t* op) {
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), B)));
#pragma omp parallel num_threads(threads)
  {
    Scratch s;  // one per thread, reused across its rows
    s.y.resize(V);
    s.e.resize(V);
    s.block_sum.resize((V + kBlock - 1) / kBlock);
    s.mass.resize(kBuckets);
    s.count.resize(kBuckets);
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < B; ++r) op[r] = sample_row(xp + r * V, V, pp ? pp + r * L : nullptr, L, up[r], p, s);
  }
}

torch::Tensor fused_sample_cpu(const torch::Tensor& logits, const c10::optional<torch::Tensor>& previous_tokens,
                               const torch::Tensor& uniforms, double temperature, int64_t top_k, double top_p,
                               double repetition_penalty) {
  TORCH_CHECK(logits.dim() == 2, "logits must be [B, V]");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == logits.size(0), "uniforms must be [B]");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V < std::numeric_limits<int32_t>::max(), "vocabulary size out of range");
  auto x = logits.contiguous();
  auto u = uniforms.to(torch::kFloat64).contiguous();
  torch::Tensor prev;
  int64_t L = 0;
  if (previous_tokens.has_value() && previous_tokens->numel() > 0) {
    prev = previous_tokens->to(torch::kInt64).contiguous();
    TORCH_CHECK(prev.dim() == 2 && prev.size(0) == B, "previous_tokens must be [B, L]");
    L = prev.size(1);
  }
  auto out = torch::empty({B}, logits.options().dtype(torch::kInt64));
  const Params p{static_cast<float>(temperature), top_k, top_p, static_cast<float>(repetition_penalty)};
  const double* up = u.data_ptr<double>();
  const int64_t* pp = L > 0 ? prev.data_ptr<int64_t>() : nullptr;
  int64_t* op = out.data_ptr<int64_t>();

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fused_sample_cpu", [&] {
    run_rows(x.data_ptr<scalar_t>(), B, V, pp, L, up, p, op);
  });
  return out;
}

torch::Tensor fused_sample(const torch::Tensor& logits, const c10::optional<torch::Tensor>& previous_tokens,
                           const torch::Tensor& uniforms, double temperature, int64_t top_k, double top_p,
                           double repetition_penalty) {
  if (logits.is_cuda()) {
    TORCH_CHECK(fused_sample_cuda != nullptr, "fused_sample: this build has no CUDA kernels");
    return fused_sample_cuda(logits, previous_tokens, uniforms, temperature, top_k, top_p, repetition_penalty);
  }
  TORCH_CHECK(logits.device().is_cpu(), "fused_sample: logits must be on CPU or CUDA");
  return fused_sample_cpu(logits, previous_tokens, uniforms, temperature, top_k, top_p, repetition_penalty);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_cuda", [] { return fused_sample_cuda != nullptr; });
  m.def("fused_sample", &fused_sample, "fused repetition penalty/temperature/top-k/top-p sampling (CPU)",
        py::arg("logits"), py::arg("previous_tokens"), py::arg("uniforms"), py::arg("temperature"),
        py::arg("top_k"), py::arg("top_p"), py::arg("repetition_penalty"));
}
