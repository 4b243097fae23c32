"""One home for the job directory's layout: what `render` writes, what the job's steps write, where to find it.

    JOB_DIR/
      job.sbatch, manifest.json (render), jobspec.json (a JobSpec built in code), job.key (mode 0600)
      logs/            slurm-<id>.out (the batch step, #SBATCH --output), supervisor.log (local backend)
      slurm/           the job's attempt-N.json and requeue-N.json (one per start, one per requeue)
      run/             the run directory (ogrpo.trainer.rundir): manifest.json, profile.jsonl, metrics.jsonl,
                       checkpoint-N/, ports.json, preempted.json
        logs/<role>.log    each step's output
        logs/<role>.console  what the supervisor echoes of the step it follows (O-GRPO's own lines)
        roles/<role>.json  each step's exit record

Pure path arithmetic: nothing here creates or reads a file.
"""

from __future__ import annotations

import os
from pathlib import Path

RUN = "run"
LOGS = "logs"
ROLES = "roles"
SLURM = "slurm"
MANIFEST = "manifest.json"
JOBSPEC = "jobspec.json"
SBATCH = "job.sbatch"
PROFILE = "profile.jsonl"
METRICS = "metrics.jsonl"
PORTS = "ports.json"
PREEMPTED = "preempted.json"
# the supervisor and the step it follows (ogrpo.trainer.quiet): where the step writes its echoed lines, its whole log
CONSOLE_ENV = "OGRPO_CONSOLE"
LOG_ENV = "OGRPO_STEP_LOG"

PathLike = str | os.PathLike

# Sub-directories a job needs before its first step starts.
JOB_SUBDIRS = (SLURM, LOGS, f"{RUN}/{LOGS}", f"{RUN}/{ROLES}")


def run_dir(job_dir: PathLike) -> Path:
    return Path(job_dir) / RUN


def job_logs(job_dir: PathLike) -> Path:
    """The job's own logs (batch step, supervisor), next to job.sbatch."""
    return Path(job_dir) / LOGS


def step_logs(job_dir: PathLike) -> Path:
    """One `<role>.log` per step."""
    return run_dir(job_dir) / LOGS


def roles_dir(job_dir: PathLike) -> Path:
    """One `<role>...json` exit record per step."""
    return run_dir(job_dir) / ROLES


def job_manifest(job_dir: PathLike) -> Path:
    """render's manifest (plan, inputs, files)."""
    return Path(job_dir) / MANIFEST


def run_manifest(job_dir: PathLike) -> Path:
    """The trainer's manifest (versions, hardware, resolved config)."""
    return run_dir(job_dir) / MANIFEST


def profile(job_dir: PathLike) -> Path:
    return run_dir(job_dir) / PROFILE


def ports_file(job_dir: PathLike) -> Path:
    return run_dir(job_dir) / PORTS


def preempted_file(job_dir: PathLike) -> Path:
    return run_dir(job_dir) / PREEMPTED


def slurm_output(job_dir: PathLike, job_id: str | int) -> Path:
    """The batch step's output (`#SBATCH --output`)."""
    return job_logs(job_dir) / f"slurm-{job_id}.out"


def supervisor_log(job_dir: PathLike) -> Path:
    """The local backend's supervisor output."""
    return job_logs(job_dir) / "supervisor.log"


def console_for(log_path) -> Path:
    """The console file beside a step's log: `trainer.log` -> `trainer.console`."""
    return Path(log_path).with_suffix(".console")
