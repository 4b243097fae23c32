"""Compile-check the CUDA kernels for sm_70 and sm_86 without a GPU, and hold each to its register budget.

    python -m ogrpo.kernels check-cuda [--arch sm_70 sm_86] [--json] [--report PATH]

Every `ogrpo/kernels/*/csrc/*_kernels.cuh` (device code only, by the kernel conventions) is compiled to a
CUBIN with NVRTC from PyPI's CUDA 12 wheels, never the machine's nvcc: CUDA 13 dropped sm_70, and NVRTC needs
no toolkit, no GPU and no driver. Two packages, both `pip install --no-deps`:
- `nvidia-cuda-nvrtc-cu12==12.9.86`: libnvrtc.so.12 (+ its builtins), loaded here with ctypes;
- `nvidia-cuda-runtime-cu12==12.9.79`: only for its include/ folder. NVRTC 12.9 has no built-in
  cuda_fp16.h / cuda_bf16.h ("could not open source file", checked), and the machine's CUDA 13 headers are
  another release than the compiler.

ptxas' verbose log (`--ptxas-options=-v`) gives, per kernel and arch, the registers used and the spill
stores/loads; the PTX gives each kernel's `.maxntid` / `.minnctapersm`, i.e. its `__launch_bounds__`, already
resolved by the compiler (a bound written as a constant or a template parameter needs no parsing here).
A kernel fails the check when
- it spills (any spill store or load): local-memory traffic in the inner loop of a bandwidth-bound kernel;
- it uses more registers than its budget: `REGISTER_BUDGETS[name]` when listed, else from its launch bounds,
  65536 registers per SM (sm_70 and sm_86 alike) / (threads rounded up to a warp x min blocks per SM),
  rounded down to the allocation unit of 8 and capped at 255 (the per-thread maximum). ptxas itself obeys
  launch bounds by spilling, so for a bounded kernel the spill rule is what usually fires;
- it has no `__launch_bounds__` and no `REGISTER_BUDGETS` entry (the kernel conventions require one: without
  it ptxas may take 255 registers and a launch with more threads than it assumed fails at run time).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ogrpo.errors import OgrpoError
from ogrpo.tables import format_table

KERNELS_DIR = Path(__file__).parent
ARCHS = ("sm_70", "sm_86")
REGISTERS_PER_SM = 65536
MAX_REGISTERS_PER_THREAD = 255
REGISTER_ALLOC_UNIT = 8
# Per-kernel register budgets by (unmangled) kernel name, for a kernel whose budget is not its launch bounds'
# (e.g. one that must keep 2 blocks per SM resident for latency hiding). Empty: every kernel uses its bounds.
REGISTER_BUDGETS: dict[str, int] = {}
# Same flags as the real build (_build.CUDA_CFLAGS) where NVRTC has them, so registers match what ships.
NVRTC_OPTIONS = ("-std=c++17", "--use_fast_math", "--ptxas-options=-v")
INSTALL_HINT = ("pip install --no-deps nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79 "
                "(or set OGRPO_NVRTC_LIB and OGRPO_CUDA_INCLUDE)")


class CudaCheckError(OgrpoError):
    """A kernel source does not compile, or NVRTC is missing (exit 2: nothing was checked)."""


@dataclass
class KernelReport:
    kernel: str  # unmangled name, e.g. "lse_forward"
    symbol: str  # mangled entry name (one per template instantiation)
    source: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    max_threads: int | None
    min_blocks: int | None
    budget: int | None
    problems: list[str] = field(default_factory=list)


# --- locating NVRTC and the CUDA 12 headers ------------------------------------------------------------


def _nvidia_dirs() -> list[Path]:
    spec = importlib.util.find_spec("nvidia")
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []


def nvrtc_library() -> Path:
    env = os.environ.get("OGRPO_NVRTC_LIB")
    if env:
        return Path(env)
    for root in _nvidia_dirs():
        lib = root / "cuda_nvrtc" / "lib" / "libnvrtc.so.12"
        if lib.exists():
            return lib
    raise CudaCheckError(f"NVRTC (CUDA 12) not found: {INSTALL_HINT}")


def cuda_include_dir() -> Path:
    env = os.environ.get("OGRPO_CUDA_INCLUDE")
    if env:
        return Path(env)
    for root in _nvidia_dirs():
        inc = root / "cuda_runtime" / "include"
        if (inc / "cuda_fp16.h").exists():
            return inc
    raise CudaCheckError(f"CUDA 12 headers (cuda_fp16.h) not found: {INSTALL_HINT}")


class Nvrtc:
    """The five NVRTC calls a compile check needs, through ctypes (no CUDA Python bindings)."""

    def __init__(self, library: Path | None = None):
        path = library or nvrtc_library()
        try:
            self.lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise CudaCheckError(f"cannot load {path}: {exc}; {INSTALL_HINT}") from exc
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def version(self) -> str:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        return f"{major.value}.{minor.value}"

    def _text(self, prog, size_fn, get_fn) -> str:
        size = ctypes.c_size_t()
        if getattr(self.lib, size_fn)(prog, ctypes.byref(size)) != 0:
            return ""
        buf = ctypes.create_string_buffer(size.value)
        getattr(self.lib, get_fn)(prog, buf)
        return buf.value.decode(errors="replace")

    def compile(self, source: str, name: str, options: list[str]) -> tuple[bool, str, str, int]:
        """(ok, log, ptx, cubin bytes) for one source and one option set."""
        prog = ctypes.c_void_p()
        rc = self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
        if rc != 0:
            raise CudaCheckError(f"nvrtcCreateProgram failed: {self.lib.nvrtcGetErrorString(rc).decode()}")
        try:
            opts = [o.encode() for o in options]
            rc = self.lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            log = self._text(prog, "nvrtcGetProgramLogSize", "nvrtcGetProgramLog")
            if rc != 0:
                return False, log, "", 0
            ptx = self._text(prog, "nvrtcGetPTXSize", "nvrtcGetPTX")
            cubin = ctypes.c_size_t()
            self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(cubin))
            return True, log, ptx, cubin.value
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


# --- parsing (pure) ---------------------------------------------------------------------------------------

_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+)'")
_SPILL_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS_RE = re.compile(r"Used (\d+) registers")
_PTX_ENTRY_RE = re.compile(r"\.entry\s+([\w$]+)\s*\(")
_PTX_BOUND_RE = re.compile(r"\.(maxntid|minnctapersm)\s+([\d,\s]+)")


def parse_ptxas_log(log: str) -> dict[str, dict[str, int]]:
    """{mangled entry: {registers, spill_stores, spill_loads, stack_bytes}} from ptxas' verbose output."""
    found: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        m = _ENTRY_RE.search(line)
        if m:
            current = found.setdefault(m.group(1), {"registers": 0, "spill_stores": 0, "spill_loads": 0,
                                                    "stack_bytes": 0})
            continue
        if current is None:
            continue
        if m := _SPILL_RE.search(line):
            current.update(stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif m := _REGS_RE.search(line):
            current["registers"] = int(m.group(1))
    return found


def parse_ptx_bounds(ptx: str) -> dict[str, tuple[int | None, int | None]]:
    """{mangled entry: (max threads per block, min blocks per SM)} from the PTX directives that
    `__launch_bounds__(threads, min_blocks)` compiles to; (None, None) for an unbounded kernel."""
    bounds: dict[str, tuple[int | None, int | None]] = {}
    entries = list(_PTX_ENTRY_RE.finditer(ptx))
    for i, m in enumerate(entries):
        # the directives sit between the parameter list and the body's opening brace
        end = entries[i + 1].start() if i + 1 < len(entries) else len(ptx)
        head = ptx[m.end():end]
        head = head[:head.find("{")] if "{" in head else head
        threads = blocks = None
        for d in _PTX_BOUND_RE.finditer(head):
            values = [int(v) for v in d.group(2).replace(",", " ").split()]
            if d.group(1) == "maxntid":
                threads = 1
                for v in values:
                    threads *= v
            else:
                blocks = values[0]
        bounds[m.group(1)] = (threads, blocks)
    return bounds


def register_budget(max_threads: int, min_blocks: int | None = None) -> int:
    """Registers per thread that let `min_blocks` blocks of `max_threads` threads be resident on one SM.

    Registers are allocated per warp, so threads round up to 32; the per-thread count to a multiple of 8.
    E.g. 256 threads: 65536 / 256 = 256 -> capped at 255; 1024 threads: 64; 512 threads x 2 blocks: 64.
    """
    warps_threads = -(-max_threads // 32) * 32 * max(1, min_blocks or 1)
    budget = REGISTERS_PER_SM // warps_threads
    budget -= budget % REGISTER_ALLOC_UNIT
    return min(budget, MAX_REGISTERS_PER_THREAD)


def kernel_name(symbol: str) -> str:
    """The unqualified function name of an Itanium-mangled entry (`_Z5spillPfi` -> spill,
    `_ZN5ogrpo3lseIfEEvPKT_` -> lse); an extern "C" name is returned as is."""
    if not symbol.startswith("_Z"):
        return symbol
    rest = symbol[2:]
    nested = rest.startswith("N")
    if nested:
        rest = rest[1:]
    name = symbol
    while rest and rest[0].isdigit():
        m = re.match(r"(\d+)", rest)
        length = int(m.group(1))  # type: ignore[union-attr]
        start = len(m.group(1))  # type: ignore[union-attr]
        name = rest[start:start + length]
        rest = rest[start + length:]
        if not nested:
            break
    return name


def demangle(symbols: list[str]) -> dict[str, str]:
    """Readable names via c++filt when binutils is there (display only)."""
    tool = shutil.which("c++filt")
    if not tool or not symbols:
        return {s: s for s in symbols}
    out = subprocess.run([tool], input="\n".join(symbols), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(symbols, out)) if len(out) == len(symbols) else {s: s for s in symbols}


def judge(report: KernelReport) -> KernelReport:
    """Fill report.budget and report.problems (pure)."""
    if report.kernel in REGISTER_BUDGETS:
        report.budget = REGISTER_BUDGETS[report.kernel]
    elif report.max_threads:
        report.budget = register_budget(report.max_threads, report.min_blocks)
    else:
        report.problems.append("no __launch_bounds__ and no REGISTER_BUDGETS entry: add __launch_bounds__(threads)")
    if report.spill_stores or report.spill_loads:
        report.problems.append(f"spills {report.spill_stores} B stores / {report.spill_loads} B loads")
    if report.budget is not None and report.registers > report.budget:
        report.problems.append(f"uses {report.registers} registers, budget {report.budget}")
    return report


# --- checking ---------------------------------------------------------------------------------------------


def kernel_headers(root: Path = KERNELS_DIR) -> list[Path]:
    return sorted(root.glob("*/csrc/*_kernels.cuh"))


def check_source(path: Path, archs=ARCHS, nvrtc: Nvrtc | None = None,
                 include: Path | None = None) -> list[KernelReport]:
    """Compile one .cuh for each arch and judge every kernel it instantiates."""
    nvrtc = nvrtc or Nvrtc()
    include = include or cuda_include_dir()
    source = path.read_text()
    reports: list[KernelReport] = []
    for arch in archs:
        options = [f"-arch={arch}", *NVRTC_OPTIONS, f"-I{include}", f"-I{path.parent}"]
        ok, log, ptx, cubin = nvrtc.compile(source, path.name, options)
        if not ok:
            raise CudaCheckError(f"{path} does not compile for {arch} with NVRTC {nvrtc.version()}:\n{log.strip()}")
        stats = parse_ptxas_log(log)
        bounds = parse_ptx_bounds(ptx)
        if not stats or not cubin:
            raise CudaCheckError(f"{path} compiled for {arch} to no kernel: template kernels must be explicitly "
                                 "instantiated at the end of the file (template __global__ void k<__half>(...);)")
        for symbol, s in sorted(stats.items()):
            threads, blocks = bounds.get(symbol, (None, None))
            reports.append(judge(KernelReport(kernel=kernel_name(symbol), symbol=symbol, source=str(path),
                                              arch=arch, max_threads=threads, min_blocks=blocks, budget=None,
                                              **s)))
    return reports


def run_check(archs=ARCHS, files: list[Path] | None = None) -> dict:
    """The JSON report for every kernel header (or FILES): {"ok", "nvrtc", "archs", "files", "kernels",
    "problems"}; raises CudaCheckError when a source does not compile or there is nothing to check."""
    files = list(files) if files is not None else kernel_headers()
    if not files:
        raise CudaCheckError(f"no *_kernels.cuh under {KERNELS_DIR}/*/csrc/: nothing to check")
    nvrtc = Nvrtc()
    include = cuda_include_dir()
    kernels: list[KernelReport] = []
    for path in files:
        kernels += check_source(Path(path), archs, nvrtc, include)
    readable = demangle(sorted({k.symbol for k in kernels}))
    problems = [f"{Path(k.source).name}: {readable[k.symbol]} on {k.arch}: {p}" for k in kernels for p in k.problems]
    return {"ok": not problems, "nvrtc": nvrtc.version(), "archs": list(archs), "options": list(NVRTC_OPTIONS),
            "files": [str(f) for f in files],
            "kernels": [dict(asdict(k), demangled=readable[k.symbol]) for k in kernels], "problems": problems}


def format_report(report: dict) -> str:
    rows = [[k["demangled"], k["arch"], str(k["registers"]), str(k["budget"] if k["budget"] is not None else "-"),
             str(k["max_threads"] or "-"), f"{k['spill_stores']}/{k['spill_loads']}", str(k["stack_bytes"]),
             "ok" if not k["problems"] else "FAIL"] for k in report["kernels"]]
    table = format_table(["kernel", "arch", "regs", "budget", "threads", "spill st/ld B", "stack B", ""], rows)
    tail = [f"FAIL: {p}" for p in report["problems"]] or [
        f"OK: {len(report['kernels'])} kernel builds, no spills, within budgets (NVRTC {report['nvrtc']})"]
    return "\n".join([table, *tail])
