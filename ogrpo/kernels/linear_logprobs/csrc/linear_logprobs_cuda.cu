// Host launchers for the CUDA build: per token chunk, cuBLAS (at::matmul) for the logits and the two matmuls of
// the backward, the row kernels of linear_logprobs_kernels.cuh for everything else. Same contract as the CPU
// entry points in linear_logprobs_cpu.cpp (which routes CUDA tensors here). sm_70 (V100) has no bf16 math:
// bf16 is refused there, fp16/fp32 run.

#include <torch/extension.h>

// c10's stream/guard headers only (not ATen/cuda/CUDAContext.h, which pulls in cuSPARSE/cuSOLVER headers that
// a build host without the full toolkit lacks); cuBLAS is reached through at::matmul.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <vector>

#include "linear_logprobs_kernels.cuh"

// The three storage types the row kernels are instantiated for (fp64 is refused by check_cuda_inputs).
#define LL_DISPATCH(TYPE, NAME, ...)                          \
  AT_DISPATCH_SWITCH(TYPE, NAME,                              \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace {

template <typename T> struct CudaType { using type = T; };
template <> struct CudaType<c10::Half> { using type = __half; };
template <> struct CudaType<c10::BFloat16> { using type = __nv_bfloat16; };

void check_cuda_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets) {
  TORCH_CHECK(hidden.is_cuda() && weight.is_cuda() && targets.is_cuda(),
              "linear_logprobs: hidden, weight and targets must all be CUDA tensors");
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
              "linear_logprobs: hidden [N,H] and weight [V,H] expected");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == hidden.size(0) && targets.scalar_type() == at::kLong,
              "linear_logprobs: targets must be int64 [N]");
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(), "linear_logprobs: hidden and weight dtypes differ");
  const auto st = hidden.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16,
              "linear_logprobs (CUDA): fp32, fp16 or bf16 inputs only");
  if (st == at::kBFloat16) {
    int major = 0, minor = 0;
    const int dev = hidden.get_device();
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    TORCH_CHECK(major >= 8, "linear_logprobs (CUDA): bf16 needs sm_80+; this GPU is sm_", major, minor,
                " (use fp16 or fp32)");
  }
  TORCH_CHECK(weight.size(0) < (1LL << 31), "linear_logprobs: vocabulary too large");
}

}  // namespace

std::vector<at::Tensor> linear_logprobs_forward_cuda(const at::Tensor& hidden_in, const at::Tensor& weight,
                                                     const at::Tensor& targets_in, double temperature,
                                                     int64_t chunk_size) {
  check_cuda_inputs(hidden_in, weight, targets_in);
  const c10::cuda::CUDAGuard guard(hidden_in.device());
  const auto hidden = hidden_in.contiguous();
  const auto targets = targets_in.contiguous();
  const int64_t n = hidden.size(0);
  const int vocab = static_cast<int>(weight.size(0));
  auto f32 = hidden.options().dtype(at::kFloat);
  auto logp = at::empty({n}, f32), ent = at::empty({n}, f32), lse = at::empty({n}, f32);
  const float inv_t = static_cast<float>(1.0 / temperature);
  const auto wt = weight.t();
  auto stream = c10::cuda::getCurrentCUDAStream();
  for (int64_t start = 0; start < n; start += chunk_size) {
    const int64_t rows = std::min(chunk_size, n - start);
    const auto logits = at::matmul(hidden.narrow(0, start, rows), wt).contiguous();
    LL_DISPATCH(logits.scalar_type(), "linear_logprobs_fwd_cuda", [&] {
      using T = typename CudaType<scalar_t>::type;
      ll_forward_rows<T><<<static_cast<unsigned>(rows), LL_THREADS, 0, stream>>>(
          reinterpret_cast<const T*>(logits.data_ptr<scalar_t>()), vocab,
          reinterpret_cast<const long long*>(targets.data_ptr<int64_t>()) + start, vocab, inv_t,
          logp.data_ptr<float>() + start, ent.data_ptr<float>() + start, lse.data_ptr<float>() + start);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {logp, ent, lse};
}

std::vector<at::Tensor> linear_logprobs_backward_cuda(const at::Tensor& hidden_in, const at::Tensor& weight,
                                                      const at::Tensor& targets_in, const at::Tensor& lse_in,
                                                      const at::Tensor& ent_in, const at::Tensor& grad_logp_in,
                                                      const at::Tensor& grad_ent_in, double temperature,
                                                      int64_t chunk_size, bool need_hidden, bool need_weight) {
  check_cuda_inputs(hidden_in, weight, targets_in);
  const c10::cuda::CUDAGuard guard(hidden_in.device());
  const auto hidden = hidden_in.contiguous();
  const auto targets = targets_in.contiguous();
  const auto lse = lse_in.to(at::kFloat).contiguous(), ent = ent_in.to(at::kFloat).contiguous();
  const auto g_logp = grad_logp_in.to(at::kFloat).contiguous(), g_ent = grad_ent_in.to(at::kFloat).contiguous();
  const int64_t n = hidden.size(0);
  const int vocab = static_cast<int>(weight.size(0));
  auto grad_h = need_hidden ? at::empty_like(hidden) : at::empty({0}, hidden.options());
  auto grad_w = need_weight ? at::zeros(weight.sizes(), weight.options().memory_format(at::MemoryFormat::Contiguous))
                            : at::empty({0}, weight.options());
  const float inv_t = static_cast<float>(1.0 / temperature);
  const auto wt = weight.t();
  auto stream = c10::cuda::getCurrentCUDAStream();
  for (int64_t start = 0; start < n; start += chunk_size) {
    const int64_t rows = std::min(chunk_size, n - start);
    const auto h = hidden.narrow(0, start, rows);
    auto dlogits = at::matmul(h, wt).contiguous();
    LL_DISPATCH(dlogits.scalar_type(), "linear_logprobs_bwd_cuda", [&] {
      using T = typename CudaType<scalar_t>::type;
      ll_backward_rows<T><<<static_cast<unsigned>(rows), LL_THREADS, 0, stream>>>(
          reinterpret_cast<T*>(dlogits.data_ptr<scalar_t>()), vocab,
          reinterpret_cast<const long long*>(targets.data_ptr<int64_t>()) + start, vocab, inv_t,
          lse.data_ptr<float>() + start, ent.data_ptr<float>() + start, g_logp.data_ptr<float>() + start,
          g_ent.data_ptr<float>() + start);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (need_hidden) {
      auto out = grad_h.narrow(0, start, rows);
      at::matmul_out(out, dlogits, weight);
    }
    if (need_weight) grad_w.addmm_(dlogits.t(), h);
  }
  return {grad_h, grad_w};
}
