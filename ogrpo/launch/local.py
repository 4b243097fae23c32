"""`--backend local`: run a JobSpec on this machine under the supervisor.

Local means every role shares this node, so the server binds to loopback (never 0.0.0.0: TRL's default host
exposes the dev-mode weight-update routes to the whole network) and both ports are fresh free ones, reserved so
that two local jobs at once cannot collide.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable, TextIO

from ogrpo.errors import OgrpoError
from ogrpo.jobspec import JobSpec, Step
from ogrpo.launch.ports import free_ports, release_ports
from ogrpo.launch.supervisor import JobResult, Supervisor

LOOPBACK = "127.0.0.1"
JOBSPEC_FILE = "jobspec.json"


def jobspec_from_dict(data: dict) -> JobSpec:
    data = dict(data)
    steps = [Step(**s) for s in data.pop("steps")]
    known = {k: v for k, v in data.items() if k in JobSpec.__dataclass_fields__}
    return JobSpec(steps=steps, **known)


def load_jobspec(job: str | os.PathLike) -> JobSpec:
    """A JobSpec from a job directory (its jobspec.json, else manifest.json's "jobspec") or a JSON file."""
    path = Path(job)
    candidates = [path] if path.is_file() else [path / JOBSPEC_FILE, path / "manifest.json"]
    for c in candidates:
        if c.is_file():
            data = json.loads(c.read_text())
            if c.name == "manifest.json" or "jobspec" in data and "steps" not in data:
                data = data.get("jobspec") or {}
            if "steps" in data:
                return jobspec_from_dict(data)
    raise OgrpoError(f"no job spec in {job}: expected {JOBSPEC_FILE} or manifest.json written by `ogrpo render`")


def local_step_env(step: Step) -> dict[str, str]:
    """Devices a step may see: its own GPUs only, so server and trainer never share a device by accident."""
    if step.gpus:
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in step.gpus)}
    return {}


def local_values(server_port: int, rendezvous_port: int, job_dir: str, group_port: int | None = None) -> dict[str, str]:
    values = {"server_host": LOOPBACK, "server_port": str(server_port), "rendezvous_host": LOOPBACK,
              "rendezvous_port": str(rendezvous_port), "job_dir": str(job_dir)}
    if group_port is not None:  # TRL's weight-sync group (vllm_group_port): its fixed default collides
        values["group_port"] = str(group_port)
    return values


def run_local_result(job: JobSpec | str | os.PathLike, *, health_timeout_s: float | None = None,
                     kill_grace_s: float = 10.0, out: TextIO | None = None,
                     wrap_step: Callable[[Step, list[str]], list[str]] | None = None,
                     follow: str | None = None) -> JobResult:
    spec = job if isinstance(job, JobSpec) else load_jobspec(job)
    Path(spec.job_dir).mkdir(parents=True, exist_ok=True)
    server_port, rdzv_port, group_port = free_ports(3, LOOPBACK)
    try:
        sup = Supervisor(spec, local_values(server_port, rdzv_port, spec.job_dir, group_port), wrap_step=wrap_step,
                         step_env=local_step_env, health_timeout_s=health_timeout_s, kill_grace_s=kill_grace_s,
                         out=out, follow=follow)
        return sup.run()
    finally:
        release_ports([server_port, rdzv_port, group_port])


def run_local(job: JobSpec | str | os.PathLike, *, health_timeout_s: float | None = None,
              out: TextIO | None = None, follow: str | None = "trainer") -> int:
    """Run the job here; returns its exit code (0 when the trainer finished cleanly). The trainer's output is
    echoed live to stdout (progress, final stage profile) unless `follow` is None."""
    result = run_local_result(job, health_timeout_s=health_timeout_s, out=out or sys.stderr, follow=follow)
    return result.rc
