// Host launcher for the CUDA build: one block per row of fused_sample_kernels.cuh. Same contract as the CPU
// entry point in fused_sample_cpu.cpp, which routes CUDA tensors here. fp32/fp16 logits everywhere, bf16 on
// sm_80+ (the loads are plain conversions, but the images' V100 line runs fp16).

#include <torch/extension.h>

// c10's stream/guard headers only (ATen/cuda/CUDAContext.h pulls in cuSPARSE/cuSOLVER headers that a build host
// without the full toolkit lacks).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "fused_sample_kernels.cuh"

torch::Tensor fused_sample_cuda(const torch::Tensor& logits, const c10::optional<torch::Tensor>& previous_tokens,
                                const torch::Tensor& uniforms, double temperature, int64_t top_k, double top_p,
                                double repetition_penalty) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2, "fused_sample: logits must be a CUDA [B, V] tensor");
  const auto st = logits.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16,
              "fused_sample (CUDA): fp32, fp16 or bf16 logits only");
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.size(0) == B, "fused_sample: uniforms must be [B]");
  const c10::cuda::CUDAGuard guard(logits.device());
  auto x = logits.contiguous();
  auto u = uniforms.to(logits.device(), torch::kFloat64).contiguous();
  torch::Tensor prev;
  int64_t L = 0;
  if (previous_tokens.has_value() && previous_tokens->numel() > 0) {
    prev = previous_tokens->to(logits.device(), torch::kInt64).contiguous();
    TORCH_CHECK(prev.dim() == 2 && prev.size(0) == B, "fused_sample: previous_tokens must be [B, L]");
    L = prev.size(1);
  }
  auto out = torch::empty({B}, x.options().dtype(torch::kInt64));
  if (B == 0) return out;
  auto work = torch::empty({B, V}, x.options().dtype(torch::kFloat32));  // the row's processed scores
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const long long* pp = L > 0 ? reinterpret_cast<const long long*>(prev.data_ptr<int64_t>()) : nullptr;
  const double* up = u.data_ptr<double>();
  float* wp = work.data_ptr<float>();
  long long* op = reinterpret_cast<long long*>(out.data_ptr<int64_t>());
  const float t = static_cast<float>(temperature), p = static_cast<float>(top_p);
  const float pen = static_cast<float>(repetition_penalty);
  const dim3 grid(static_cast<unsigned int>(B)), block(FS_THREADS);
  if (st == at::kFloat) {
    fused_sample_kernel<float><<<grid, block, 0, stream>>>(x.data_ptr<float>(), V, pp, L, up, t, top_k, p, pen, wp,
                                                           op);
  } else if (st == at::kHalf) {
    fused_sample_kernel<__half><<<grid, block, 0, stream>>>(
        reinterpret_cast<const __half*>(x.data_ptr<at::Half>()), V, pp, L, up, t, top_k, p, pen, wp, op);
  } else {
    fused_sample_kernel<__nv_bfloat16><<<grid, block, 0, stream>>>(
        reinterpret_cast<const __nv_bfloat16*>(x.data_ptr<at::BFloat16>()), V, pp, L, up, t, top_k, p, pen, wp, op);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}
