"""Compile and load one kernel's C++/CUDA sources as a Python extension (torch's JIT builder, cached).

Sources live in `ogrpo/kernels/<kernel>/csrc/`: `*.cpp` always, `*.cu` only for a CUDA build. The build is
cached under `$OGRPO_CACHE/kernels` (default ~/.cache/ogrpo/kernels), keyed by torch version, device kind and
a hash of the sources, so editing a source or upgrading torch rebuilds and nothing stale is ever loaded.
`make setup` and the images' builder stage pre-build (`python -m ogrpo.kernels build`), so a job never
compiles on its first step.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path

KERNELS_DIR = Path(__file__).parent
KERNELS = ("linear_logprobs", "fused_sample")

# Portable code, never -march=native: a prebuilt op must run on every x86-64 node of a cluster, not only on
# the build host. OpenMP for the token/row loops; -O3 lets GCC vectorize the inner loops.
CPU_CFLAGS = ["-O3", "-fopenmp", "-std=c++17"]
CPU_LDFLAGS = ["-fopenmp"]
# sm_70 (V100, fp16 only) and sm_86 (A40); TORCH_CUDA_ARCH_LIST in the image picks the one of its family.
CUDA_CFLAGS = ["-O3", "--use_fast_math", "-std=c++17"]


def sources(kernel: str, cuda: bool) -> list[Path]:
    csrc = KERNELS_DIR / kernel / "csrc"
    found = sorted(csrc.glob("*.cpp")) + (sorted(csrc.glob("*.cu")) if cuda else [])
    if not found:
        raise FileNotFoundError(f"no sources for kernel {kernel!r} in {csrc}")
    return found


def cache_root() -> Path:
    base = os.environ.get("OGRPO_CACHE") or Path.home() / ".cache" / "ogrpo"
    return Path(base) / "kernels"


def build_dir(kernel: str, cuda: bool) -> Path:
    import torch

    digest = hashlib.sha256()
    for src in sources(kernel, cuda):
        digest.update(src.name.encode())
        digest.update(src.read_bytes())
    for flag in (*CPU_CFLAGS, *(CUDA_CFLAGS if cuda else ())):
        digest.update(flag.encode())
    kind = f"cuda{torch.version.cuda}" if cuda else "cpu"
    return cache_root() / f"{kernel}-torch{torch.__version__}-{kind}-{digest.hexdigest()[:12]}"


@lru_cache(maxsize=None)
def load_extension(kernel: str, cuda: bool = False, verbose: bool = False):
    """The compiled module for `kernel` (building it first if needed). Raises on a compiler error."""
    from torch.utils import cpp_extension

    out = build_dir(kernel, cuda)
    out.mkdir(parents=True, exist_ok=True)
    # Module names must differ per variant: Python caches extension modules by name within a process.
    name = f"ogrpo_{kernel}_{'cuda' if cuda else 'cpu'}"
    return cpp_extension.load(
        name=name, sources=[str(s) for s in sources(kernel, cuda)], build_directory=str(out),
        extra_cflags=CPU_CFLAGS, extra_ldflags=CPU_LDFLAGS,
        extra_cuda_cflags=CUDA_CFLAGS if cuda else None, with_cuda=cuda, verbose=verbose)
