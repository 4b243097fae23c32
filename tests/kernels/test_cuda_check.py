"""CUDA compile check with NVRTC (no GPU): the real kernels for sm_70 and sm_86, and a sample header that
shows the check can fail (a spilling kernel, one over its register budget, one without launch bounds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ogrpo.kernels import cuda_check

REPO = Path(__file__).resolve().parents[2]

SAMPLE_OK = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
template <typename T>
__global__ void __launch_bounds__(256) scale(const T* __restrict__ x, float* __restrict__ y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = static_cast<float>(x[i]) * 2.f;
}
template __global__ void scale<__half>(const __half*, float*, int);
template __global__ void scale<__nv_bfloat16>(const __nv_bfloat16*, float*, int);
"""

# 256 live floats per thread cannot fit in the 64 registers that 1024 threads per block leave each thread:
# ptxas obeys the bound and spills to local memory (about 1 KB of stores on sm_70 with NVRTC 12.9).
SPILLING = r"""
__global__ void __launch_bounds__(1024) spiller(float* out, int n) {
  float a[256];
  for (int i = 0; i < 256; ++i) a[i] = out[(i * 7 + n) % 997];
  float s = 0.f;
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < 256; ++i) s += a[(i * j) & 255] * a[i];
  out[threadIdx.x] = s;
}
"""

# 32 independent accumulators, unrolled: well over 32 registers, no spill (no launch bounds caps it).
UNBOUNDED = r"""
__global__ void heavy(const float* __restrict__ x, float* __restrict__ out, int n) {
  float acc[32];
#pragma unroll
  for (int k = 0; k < 32; ++k) acc[k] = 0.f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
#pragma unroll
    for (int k = 0; k < 32; ++k) acc[k] += x[i * 32 + k] * x[i * 32 + (k * 5) % 32];
  }
#pragma unroll
  for (int k = 0; k < 32; ++k) out[threadIdx.x * 32 + k] = acc[k];
}
"""


def write(tmp_path: Path, text: str, name: str = "sample") -> Path:
    path = tmp_path / name / "csrc" / f"{name}_kernels.cuh"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def test_budget_from_launch_bounds():
    # 65536 registers per SM / threads (rounded up to a warp) / min blocks, a multiple of 8, at most 255
    assert cuda_check.register_budget(256) == 255
    assert cuda_check.register_budget(1024) == 64
    assert cuda_check.register_budget(512, 2) == 64
    assert cuda_check.register_budget(384) == 168  # 65536 / 384 = 170.7 -> 168
    assert cuda_check.register_budget(100) == 255  # 100 threads hold 4 warps' registers


def test_parsers_read_ptxas_and_ptx():
    log = """nvrtc: warning: Architectures prior to '<compute/sm>_75' are deprecated
ptxas info    : Compiling entry function '_Z5spillPfi' for 'sm_70'
ptxas info    : Function properties for _Z5spillPfi
ptxas         .     2064 bytes stack frame, 1076 bytes spill stores, 1072 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 2064 bytes cumulative stack size, 364 bytes cmem[0]
ptxas info    : Compiling entry function 'plain' for 'sm_70'
ptxas info    : Function properties for plain
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers, 372 bytes cmem[0]
"""
    stats = cuda_check.parse_ptxas_log(log)
    assert stats["_Z5spillPfi"] == {"registers": 32, "spill_stores": 1076, "spill_loads": 1072, "stack_bytes": 2064}
    assert stats["plain"]["registers"] == 10 and stats["plain"]["spill_stores"] == 0
    ptx = """.visible .entry _Z5spillPfi(
\t.param .u64 _Z5spillPfi_param_0
)
\t.maxntid 1024, 1, 1
\t.minnctapersm 2
{
}
.visible .entry plain(
)
{
}"""
    assert cuda_check.parse_ptx_bounds(ptx) == {"_Z5spillPfi": (1024, 2), "plain": (None, None)}
    assert cuda_check.kernel_name("_Z5spillPfi") == "spill"
    assert cuda_check.kernel_name("_Z5scaleI6__halfEvPKT_Pfi") == "scale"
    assert cuda_check.kernel_name("_ZN5ogrpo3lseIfEEvPKT_") == "lse"
    assert cuda_check.kernel_name("plain") == "plain"


def test_sample_passes_and_records_every_instantiation(tmp_path):
    report = cuda_check.run_check(files=[write(tmp_path, SAMPLE_OK)])
    assert report["ok"], report["problems"]
    assert report["nvrtc"].startswith("12.")
    got = {(k["arch"], k["demangled"]) for k in report["kernels"]}
    for arch in ("sm_70", "sm_86"):
        assert any(a == arch and "__half" in d for a, d in got)
        assert any(a == arch and "__nv_bfloat16" in d for a, d in got)
    for k in report["kernels"]:
        assert k["max_threads"] == 256 and k["budget"] == 255 and 0 < k["registers"] <= 255


def test_spilling_kernel_fails(tmp_path):
    report = cuda_check.run_check(files=[write(tmp_path, SPILLING)])
    assert not report["ok"]
    assert {k["arch"] for k in report["kernels"] if k["problems"]} == {"sm_70", "sm_86"}
    assert all("spiller" in p and "spills" in p for p in report["problems"])
    spill = next(k for k in report["kernels"] if k["arch"] == "sm_86")
    assert spill["max_threads"] == 1024 and spill["budget"] == 64 and spill["spill_stores"] > 0


def test_register_budget_and_launch_bounds_are_enforced(tmp_path, monkeypatch):
    path = write(tmp_path, UNBOUNDED)
    report = cuda_check.run_check(archs=["sm_86"], files=[path])
    (kernel,) = report["kernels"]
    assert kernel["max_threads"] is None and kernel["registers"] > 32
    assert any("no __launch_bounds__" in p for p in kernel["problems"])
    monkeypatch.setitem(cuda_check.REGISTER_BUDGETS, "heavy", 32)
    (kernel,) = cuda_check.run_check(archs=["sm_86"], files=[path])["kernels"]
    assert kernel["problems"] == [f"uses {kernel['registers']} registers, budget 32"]


def test_a_source_that_does_not_compile_is_an_error(tmp_path):
    path = write(tmp_path, "__global__ void broken(int* x) { x[0] = undefined_name; }\n")
    with pytest.raises(cuda_check.CudaCheckError, match="does not compile for sm_70"):
        cuda_check.run_check(files=[path])
    # a template kernel never instantiated emits no code: say how to fix it instead of passing vacuously
    path = write(tmp_path, "template <typename T> __global__ void k(T* x) { x[0] = T(1); }\n", "noinst")
    with pytest.raises(cuda_check.CudaCheckError, match="explicitly instantiated"):
        cuda_check.run_check(files=[path])


def test_cli_exit_codes_and_json_report(tmp_path):
    bad = write(tmp_path, SPILLING)
    run = lambda *a: subprocess.run([sys.executable, "-m", "ogrpo.kernels", "check-cuda", *a],  # noqa: E731
                                    capture_output=True, text=True, cwd=REPO)
    out = tmp_path / "report.json"
    proc = run("--arch", "sm_86", "--report", str(out), "--source", str(bad))
    assert proc.returncode == 1, proc.stderr
    assert "FAIL: sample_kernels.cuh: spiller(float*, int) on sm_86: spills" in proc.stdout
    report = json.loads(out.read_text())
    assert report["archs"] == ["sm_86"] and not report["ok"] and report["files"] == [str(bad)]
    ok = run("--arch", "sm_70", "--json", "--source", str(write(tmp_path, SAMPLE_OK, "fine")))
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ok"] is True
    proc = run("--arch", "70")
    assert proc.returncode == 2 and "sm_70 sm_86" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_nvrtc_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("OGRPO_NVRTC_LIB", str(tmp_path / "libnvrtc.so.12"))
    with pytest.raises(cuda_check.CudaCheckError, match="nvidia-cuda-nvrtc-cu12==12.9.86"):
        cuda_check.Nvrtc()


@pytest.mark.slow
def test_real_kernels_compile_for_v100_and_a40_within_budget():
    headers = cuda_check.kernel_headers()
    assert {h.parent.parent.name for h in headers} == {"fused_sample", "linear_logprobs"}, headers
    report = cuda_check.run_check()
    assert report["ok"], "\n".join(report["problems"])
    for header in headers:
        archs = {k["arch"] for k in report["kernels"] if k["source"] == str(header)}
        assert archs == {"sm_70", "sm_86"}, header
