"""Compile and load one kernel's C++/CUDA sources as a Python extension (torch's JIT builder, cached).

Sources live in `ogrpo/kernels/<kernel>/csrc/`: `*.cpp` always, `*.cu` only for a CUDA build. The build is
cached under `$OGRPO_CACHE/kernels` (default ~/.cache/ogrpo/kernels), keyed by torch version, device kind and
a hash of every file in csrc/ (headers included: a `.cuh` edit must rebuild the `.cu` that includes it), so
editing a source or upgrading torch rebuilds and nothing stale is ever loaded.
`make setup` and the images' builder stage pre-build (`python -m ogrpo.kernels build`), so a job never
compiles on its first step. An image ships its builds read-only in `$OGRPO_KERNELS_PREBUILT` (searched
first): a built module is imported directly, without torch's builder, which would need a compiler (the
runtime stage has no nvcc) and a writable directory (it takes a lock file in the build directory).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
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


def available(cuda: bool = False) -> list[str]:
    """The kernels whose sources are present (for a CPU build: a .cpp; for CUDA: a .cu as well)."""
    csrc = lambda k: KERNELS_DIR / k / "csrc"  # noqa: E731
    return [k for k in KERNELS if any(csrc(k).glob("*.cpp")) and (not cuda or any(csrc(k).glob("*.cu")))]


def cache_root() -> Path:
    base = os.environ.get("OGRPO_CACHE") or Path.home() / ".cache" / "ogrpo"
    return Path(base) / "kernels"


def prebuilt_root() -> Path | None:
    env = os.environ.get("OGRPO_KERNELS_PREBUILT")
    return Path(env) if env else None


def module_name(kernel: str, cuda: bool) -> str:
    # Module names must differ per variant: Python caches extension modules by name within a process.
    return f"ogrpo_{kernel}_{'cuda' if cuda else 'cpu'}"


def build_key(kernel: str, cuda: bool) -> str:
    """The build's directory name: kernel, torch version, device kind and a hash of csrc/ and the flags."""
    import torch

    sources(kernel, cuda)  # raises when there is nothing to build
    digest = hashlib.sha256()
    # top-level files only: what the wheel ships (package-data `kernels/*/csrc/*`), so an installed image
    # computes the key its builder computed from the checkout
    for src in sorted(p for p in (KERNELS_DIR / kernel / "csrc").glob("*") if p.is_file()):
        if not cuda and src.suffix in (".cu",):
            continue
        digest.update(src.name.encode())
        digest.update(src.read_bytes())
    for flag in (*CPU_CFLAGS, *(CUDA_CFLAGS if cuda else ())):
        digest.update(flag.encode())
    if cuda:
        # the arch list decides which cubins the module holds: a V100 build is not an A40 build (a shared home
        # on a cluster sees both). Unset, torch compiles for the visible GPUs, so those are the key.
        digest.update(cuda_archs().encode())
    kind = f"cuda{torch.version.cuda}" if cuda else "cpu"
    return f"{kernel}-torch{torch.__version__}-{kind}-{digest.hexdigest()[:12]}"


def cuda_archs() -> str:
    """What a CUDA build targets: TORCH_CUDA_ARCH_LIST, else the visible GPUs' compute capabilities."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        return env
    import torch

    if not torch.cuda.is_available():
        return ""
    return ";".join(sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}))


def build_dir(kernel: str, cuda: bool, root: Path | None = None) -> Path:
    return (root or cache_root()) / build_key(kernel, cuda)


def built_module(kernel: str, cuda: bool, root: Path | None = None) -> Path | None:
    """The already built module file for this exact key, searched in `root`, the prebuilt dir, the cache."""
    key, name = build_key(kernel, cuda), module_name(kernel, cuda)
    for base in (root, prebuilt_root(), cache_root()):
        if base is not None and (base / key / f"{name}.so").is_file():
            return base / key / f"{name}.so"
    return None


def _import(name: str, path: Path):
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "")) == path:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    sys.modules[name] = module
    return module


@lru_cache(maxsize=None)
def load_extension(kernel: str, cuda: bool = False, verbose: bool = False, root: Path | None = None):
    """The compiled module for `kernel` (building it into `root`, default the cache, if needed).
    Raises on a compiler error."""
    name = module_name(kernel, cuda)
    found = built_module(kernel, cuda, root)
    if found is not None:
        # the key hashes every source, flag and the torch version: a module under it is this build
        return _import(name, found)
    from torch.utils import cpp_extension

    out = build_dir(kernel, cuda, root)
    out.mkdir(parents=True, exist_ok=True)
    # torch renames a module rebuilt in one process with other inputs to <name>_v1 ...; our key directory
    # already tells builds apart, and the loader above looks for <name>.so
    cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)
    module = cpp_extension.load(
        name=name, sources=[str(s) for s in sources(kernel, cuda)], build_directory=str(out),
        extra_cflags=CPU_CFLAGS, extra_ldflags=CPU_LDFLAGS,
        extra_cuda_cflags=CUDA_CFLAGS if cuda else None, with_cuda=cuda, verbose=verbose)
    sys.modules[name] = module
    return module
