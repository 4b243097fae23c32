"""GPU catalog (data) and the `--gpus` grammar.

Grammar: ``[NODESx]COUNTx TYPE[-MEM][-LINK]``, case-insensitive, spaces ignored:
``3xA40``, ``4xV100``, ``4xV100-16G``, ``2x8xA100-80G``, ``1xH100``, ``4xV100-32G-pcie``; and ``cpu``,
``2xcpu``, ``cpu-16G`` (CPU "devices" are processes on one machine: the embedded default and CI), ``2x1xcpu``
(two CPU nodes, e.g. the two-node test cluster).

Each type's facts drive the plan's settings: bf16/TF32/FA2 need sm_80+, Triton's tl.dot
has no tensor cores below sm_80 (so torch.compile is off there), and PCIe boxes need NCCL P2P off for the
trainer→vLLM weight broadcast (TRL #5865, #2923).
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import asdict, dataclass, replace

from ogrpo.errors import OgrpoError


@dataclass(frozen=True)
class GpuType:
    name: str  # canonical catalog name, e.g. "A40", "V100-32G"
    family: str  # "V100", "A40", ... ("cpu" for CPU processes)
    memory_gib: float  # total memory as nvidia-smi reports it (host RAM for cpu)
    sm: int  # compute capability x10 (70 = sm_70); 0 for cpu
    bf16: bool
    tf32: bool
    fa2: bool  # flash-attn 2 kernels exist for this arch
    interconnect: str  # "nvlink" | "pcie" | "none"
    is_cpu: bool = False

    @property
    def triton_tensor_cores(self) -> bool:
        # Triton >= 3.2 lowers tl.dot to tensor-core MMA only from sm_80 on.
        return self.sm >= 80

    @property
    def fp16(self) -> bool:
        return not self.is_cpu

    @property
    def gres_type(self) -> str | None:
        """The GRES type a job asks Slurm for (`--gres=gpu:a40:3`): the family in lower case, the name most sites
        give their gres.conf `Type=` (a site that spells it otherwise says so: ogrpo.gres_type / --gres-type).
        Both V100 sizes are one type: the plan's memory check at the step's start tells them apart."""
        return None if self.is_cpu else GRES_TYPES.get(self.family, self.family.lower())

    def to_dict(self) -> dict:
        d = asdict(self)
        d["triton_tensor_cores"] = self.triton_tensor_cores
        d["gres_type"] = self.gres_type
        return d


# memory_gib values are the totals nvidia-smi prints (MiB / 1024): the A40 and L40S show 46068 MiB, not 48 GB.
# V100 defaults to NVLink (SXM2, the common cluster part); say `-pcie` for PCIe cards.
_CATALOG: tuple[GpuType, ...] = (
    GpuType("V100-16G", "V100", 16.0, 70, bf16=False, tf32=False, fa2=False, interconnect="nvlink"),
    GpuType("V100-32G", "V100", 32.0, 70, bf16=False, tf32=False, fa2=False, interconnect="nvlink"),
    GpuType("T4", "T4", 15.0, 75, bf16=False, tf32=False, fa2=False, interconnect="pcie"),
    GpuType("A40", "A40", 45.0, 86, bf16=True, tf32=True, fa2=True, interconnect="pcie"),
    GpuType("A10", "A10", 22.0, 86, bf16=True, tf32=True, fa2=True, interconnect="pcie"),
    GpuType("A6000", "A6000", 47.5, 86, bf16=True, tf32=True, fa2=True, interconnect="pcie"),
    GpuType("L40S", "L40S", 45.0, 89, bf16=True, tf32=True, fa2=True, interconnect="pcie"),
    GpuType("A100-40G", "A100", 40.0, 80, bf16=True, tf32=True, fa2=True, interconnect="nvlink"),
    GpuType("A100-80G", "A100", 80.0, 80, bf16=True, tf32=True, fa2=True, interconnect="nvlink"),
    GpuType("H100", "H100", 79.6, 90, bf16=True, tf32=True, fa2=True, interconnect="nvlink"),
    GpuType("H200", "H200", 139.8, 90, bf16=True, tf32=True, fa2=True, interconnect="nvlink"),
)

# GRES type per family where it is not the family's name in lower case (none so far: data, so a site's common
# spelling can be added in one line).
GRES_TYPES: dict[str, str] = {}

# A family named without memory picks this variant (the larger/common one).
_DEFAULT_VARIANT = {"V100": "V100-32G", "A100": "A100-80G"}

CATALOG: dict[str, GpuType] = {g.name.upper(): g for g in _CATALOG}
FAMILIES: dict[str, list[GpuType]] = {}
for _g in _CATALOG:
    FAMILIES.setdefault(_g.family.upper(), []).append(_g)


def cpu_type(memory_gib: float | None = None) -> GpuType:
    """The CPU "device": memory is the host's RAM (shared by all processes)."""
    if memory_gib is None:
        memory_gib = host_memory_gib()
    return GpuType("cpu", "cpu", float(memory_gib), 0, bf16=False, tf32=False, fa2=False, interconnect="none",
                   is_cpu=True)


def host_memory_gib() -> float:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return 16.0


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu: GpuType
    spec: str  # canonical spelling, e.g. "2x8xA100-80G"

    @property
    def is_cpu(self) -> bool:
        return self.gpu.is_cpu

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def to_dict(self) -> dict:
        return {"spec": self.spec, "nodes": self.nodes, "gpus_per_node": self.gpus_per_node,
                "total_gpus": self.total_gpus, "gpu": self.gpu.to_dict()}


_SPEC = re.compile(
    r"^(?:(?P<a>\d+)x)?(?:(?P<b>\d+)x)?(?P<type>[a-z][a-z0-9]*?)(?:-(?P<mem>\d+(?:\.\d+)?)g(?:b|ib)?)?"
    r"(?:-(?P<link>nvlink|pcie|sxm\d?))?$"
)

_HINT = "write --gpus as [NODESx]COUNTxTYPE[-MEM], e.g. 3xA40, 4xV100-16G, 2x8xA100-80G or 2xcpu"


def known_types() -> list[str]:
    return [g.name for g in _CATALOG] + ["cpu"]


MAX_GPUS_PER_NODE = 16  # the largest GPU nodes sold (HGX boards) carry 8-16
MAX_CPU_PROCESSES = 256  # NxCPU: N trainer processes on one machine
MAX_NODES = 1024


def parse_gpus(spec: str) -> Cluster:
    """Parse a `--gpus` value into a Cluster; OgrpoError (one line, naming the fix) when it is not valid."""
    if spec is None or not str(spec).strip():
        raise OgrpoError(f"--gpus is empty: {_HINT}")
    text = re.sub(r"\s+", "", str(spec)).lower().replace("×", "x")
    if text.startswith("-") or re.search(r"(^|x)-", text):
        raise OgrpoError(f"--gpus {spec!r}: counts must be positive integers; {_HINT}")
    m = _SPEC.match(text)
    if not m:
        raise OgrpoError(f"--gpus {spec!r} is malformed: {_HINT}")
    a, b = m.group("a"), m.group("b")
    if a is not None and b is not None:
        nodes, count = int(a), int(b)
    elif a is not None:
        nodes, count = 1, int(a)
    else:
        nodes, count = 1, 1
    if nodes <= 0 or count <= 0:
        raise OgrpoError(f"--gpus {spec!r}: node and GPU counts must be at least 1; {_HINT}")
    # Bounds a real allocation can have; without them a typo like 999999999999xA40 reaches list building
    # (MemoryError) instead of a one-line answer.
    per_node = MAX_CPU_PROCESSES if m.group("type") == "cpu" else MAX_GPUS_PER_NODE
    if count > per_node or nodes > MAX_NODES:
        raise OgrpoError(f"--gpus {spec!r}: at most {per_node} per node and {MAX_NODES} nodes; {_HINT}")
    tname = m.group("type")
    mem = m.group("mem")
    link = m.group("link")
    if tname == "cpu":
        if link:
            raise OgrpoError(f"--gpus {spec!r}: cpu takes no interconnect suffix")
        gpu = cpu_type(float(mem) if mem else None)
        # NODESxCOUNTxcpu: CPU nodes of a Slurm partition (the server gets node 0, as with GPU nodes)
        canon = (f"{nodes}x{count}xcpu" if nodes > 1 else f"{count}xcpu" if count > 1 else "cpu") + (
            f"-{_fmt_mem(float(mem))}G" if mem else "")
        return Cluster(nodes, count, gpu, canon)
    gpu = _lookup(tname, mem, spec)
    if link:
        gpu = replace(gpu, interconnect="nvlink" if link.startswith(("nvlink", "sxm")) else "pcie")
    canon = (f"{nodes}x" if nodes > 1 else "") + f"{count}x{gpu.name}" + (f"-{link}" if link else "")
    return Cluster(nodes, count, gpu, canon)


def _fmt_mem(mem: float) -> str:
    return str(int(mem)) if float(mem).is_integer() else str(mem)


def _lookup(tname: str, mem: str | None, spec: str) -> GpuType:
    fam = FAMILIES.get(tname.upper())
    if fam is None:
        exact = CATALOG.get(tname.upper())
        if exact is not None:
            return exact
        close = difflib.get_close_matches(tname.upper(), list(FAMILIES) + ["CPU"], n=1, cutoff=0.5)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise OgrpoError(
            f"--gpus {spec!r}: unknown GPU type {tname.upper()}{hint}; known types: {', '.join(known_types())}"
        )
    if mem is None:
        name = _DEFAULT_VARIANT.get(tname.upper())
        return CATALOG[name.upper()] if name else fam[0]
    want = float(mem)
    for g in fam:
        # Accept the nominal size (48G for an A40 that reports 45 GiB) as well as the reported one.
        nominal = {45.0: 48.0, 79.6: 80.0, 139.8: 141.0, 47.5: 48.0, 22.0: 24.0, 15.0: 16.0}.get(g.memory_gib,
                                                                                                    g.memory_gib)
        if abs(want - g.memory_gib) < 0.5 or abs(want - nominal) < 0.5:
            return g
    variants = ", ".join(g.name for g in fam)
    raise OgrpoError(f"--gpus {spec!r}: no {tname.upper()} with {_fmt_mem(want)} GB; known variants: {variants}")


def match_device(device_name: str, memory_gib: float) -> GpuType | None:
    """The catalog entry for a device as torch/nvidia-smi names it ("NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-32GB"):
    the longest family name it contains (so A100 is not taken for A10), then the variant nearest in memory."""
    text = re.sub(r"[\s_]+", "", device_name.upper())
    fams = [f for f in FAMILIES if f in text]
    if not fams:
        return None
    fam = max(fams, key=len)
    return min(FAMILIES[fam], key=lambda g: abs(g.memory_gib - memory_gib))
