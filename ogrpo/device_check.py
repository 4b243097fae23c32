"""A GPU plan's step refuses to start on devices it was not planned for.

A job that asks Slurm for GPUs can still land where the plan does not hold: a site that ignores the GPU type, a
mixed partition, a container without the driver, a node whose GPUs are not visible. Without this check such a
job trained on the CPU with fp16 settings to COMPLETED, or ran a bf16 + flash-attention plan on V100s until
its first kernel failed. The trainer and the server call `check_devices(plan, role)` before their heavy imports;
it raises OgrpoError (one line, exit 2) in the seconds torch's import takes.
"""

from __future__ import annotations

import os

from ogrpo.errors import OgrpoError
from ogrpo.hardware import CATALOG, match_device
from ogrpo.planner.device_rules import rules_of


def planned_gpu(plan) -> dict | None:
    """The catalog GPU a Plan was made for, as its dict form; None for a CPU plan or no plan."""
    if plan is None or not rules_of(plan).checks_devices:
        return None
    return plan.cluster.gpu.to_dict()


def device_problem(gpu: dict, rows: list[dict], spec: str, role: str) -> str | None:
    """Why ROWS (this process's CUDA devices, `gpu_rows`: name, catalog, memory_gib) cannot run a plan
    made for GPU; None when they can. Pure, for tests."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not rows:
        return (f"{role}: the plan is for {spec} but this process sees no CUDA device (CUDA_VISIBLE_DEVICES="
                f"{visible if visible is not None else 'unset'}): run it where Slurm gives it those GPUs "
                f"(--gres=gpu:TYPE:N) with their driver, or plan for this machine (--gpus cpu)")
    want = CATALOG.get(str(gpu.get("name", "")).upper())
    family = want.family if want else gpu.get("family")
    for row in rows:
        got = CATALOG.get(str(row.get("catalog") or "").upper())
        if got is None or got.family != family:
            return (f"{role}: the plan is for {spec} but CUDA device {row.get('index', 0)} is {row.get('name')} "
                    f"({row.get('memory_gib')} GiB): its precision, attention and memory settings do not hold there; "
                    f"re-plan with --gpus for these GPUs, or ask Slurm for {gpu.get('name')} (--gres-type)")
        planned = float(gpu.get("memory_gib") or 0.0)
        if float(row.get("memory_gib") or 0.0) < planned - 1.0:
            return (f"{role}: the plan is for {spec} ({planned:g} GiB each) but CUDA device {row.get('index', 0)} "
                    f"({row.get('name')}) has {row.get('memory_gib')} GiB: re-plan with --gpus "
                    f"for {got.name}")
    return None


def gpu_rows(torch) -> list[dict]:
    """This process's CUDA devices (index, name, catalog entry, sm, memory, bf16/TF32/FA2 by arch), as `doctor`,
    `selftest` and the device check read them; `torch` is passed in so this module imports it only when asked."""
    rows = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        major, minor = props.major, props.minor
        sm = major * 10 + minor
        name = props.name
        known = match_device(name, props.total_memory / 2**30)
        known = known.name if known else None
        rows.append({
            "index": i, "name": name, "catalog": known, "sm": sm,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "bf16": bool(sm >= 80), "tf32": bool(sm >= 80), "fa2_arch": bool(sm >= 80),
        })
    return rows


def visible_gpus() -> list[dict]:
    """This process's CUDA devices as `ogrpo doctor`/`selftest` read them (name, catalog, memory_gib)."""
    import torch

    return gpu_rows(torch) if torch.cuda.is_available() else []


def check_devices(plan, role: str) -> None:
    """Raise OgrpoError when a GPU plan finds no CUDA device, or devices of another model than planned."""
    gpu = planned_gpu(plan)
    if gpu is None:
        return
    rows = visible_gpus()
    spec = plan.cluster.spec or gpu.get("name")
    problem = device_problem(gpu, rows, spec, role)
    if problem:
        raise OgrpoError(problem)
