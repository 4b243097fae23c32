"""Why a job's processes got SIGTERM: a cancel, a requeue, the time limit, or a signal to the steps only.

Slurm sends the same SIGTERM (then SIGKILL after KillWait) for `scancel`, `scontrol requeue`, a preemption and
the time limit, and `scancel --signal=TERM` sends it to the steps alone. What a trainer should do differs: a
cancel stops now (nothing will resume it); everything else checkpoints, because the job comes back (a requeue
by Slurm, or by our supervisor when only the steps were signalled) or can be resubmitted. Slurm's controller
tells them apart while the signals are delivered (measured on Slurm 22.05):

    scancel JOB                JobState=COMPLETING Reason=None       Restarts unchanged
    scontrol requeue JOB       JobState=COMPLETING Reason=None       Restarts = SLURM_RESTART_COUNT + 1
    time limit                 JobState=COMPLETING Reason=TimeLimit  Restarts unchanged
    scancel --signal=TERM JOB  JobState=RUNNING

`ogrpo cancel` also leaves a marker in the run directory before it signals anything, so that a cancel is
recognised where the nodes cannot ask the controller, and on the local backend, which has no controller.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from ogrpo import atomic_file
from ogrpo.launch.slurm.parse import key_values

CANCEL_MARKER = "cancel.json"
SCONTROL_TIMEOUT_S = 5

CANCEL = "cancel"  # stop now: nothing resumes this run
REQUEUE = "requeue"  # Slurm requeues the job by itself (scontrol requeue, preemption with requeue)
STEPS = "steps"  # only the steps were signalled (scancel --signal=TERM): the supervisor requeues
TIMEOUT = "timeout"  # the time limit: the job ends; a resubmission resumes
PREEMPT = "preempt"  # preempted without requeue
UNKNOWN = "unknown"  # no Slurm to ask (a plain SIGTERM, e.g. a pod eviction): checkpoint, as for a requeue


def marker_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CANCEL_MARKER


def request_cancel(run_dir: str | os.PathLike, job_id: str | None = None) -> None:
    """Record, before any signal is sent, that this run is being cancelled (read by `cancel_requested`)."""
    atomic_file.write_json(marker_path(run_dir), {"time": time.time(), "job_id": job_id, "by": "ogrpo cancel"},
                           indent=None)


def cancel_requested(run_dir: str | os.PathLike | None, since: float | None = None,
                     job_id: str | None = None) -> bool:
    """Whether `ogrpo cancel` marked this run: a marker written after `since` (this process's start: an older
    one belongs to an earlier run in the same directory) and, under Slurm, for this job id."""
    if run_dir is None:
        return False
    try:
        data = json.loads(marker_path(run_dir).read_text())
    except (OSError, ValueError):
        return False
    if job_id and data.get("job_id") not in (None, str(job_id)):
        return False
    return since is None or float(data.get("time") or 0) >= since - 1.0


def classify(job: dict[str, str], restart_count: int) -> str:
    """A reason from `scontrol show job` fields, for an attempt that started as restart `restart_count`."""
    state = job.get("JobState", "")
    reason = job.get("Reason", "")
    restarts = job.get("Restarts", "")
    if restarts.isdigit() and int(restarts) > restart_count:
        return REQUEUE
    if state in ("RUNNING", "SUSPENDED", "CONFIGURING"):
        return STEPS
    if state == "PREEMPTED" or reason.startswith("Preempt"):
        return PREEMPT
    if state == "TIMEOUT" or reason == "TimeLimit":
        return TIMEOUT
    if state in ("COMPLETING", "CANCELLED") and reason in ("None", ""):
        return CANCEL
    return UNKNOWN


def slurm_reason(job_id: str, restart_count: int, timeout: float = SCONTROL_TIMEOUT_S) -> str:
    """Ask the controller why job `job_id` is being signalled; UNKNOWN when it cannot answer in time."""
    if shutil.which("scontrol") is None:
        return UNKNOWN
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                             timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN
    if out.returncode != 0:
        return UNKNOWN
    return classify(key_values(out.stdout), restart_count)


def sigterm_reason(run_dir: str | os.PathLike | None, since: float | None = None) -> str:
    """Why this process (a step of a job, or a local run) got SIGTERM."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if cancel_requested(run_dir, since, job_id):
        return CANCEL
    if not job_id:
        return UNKNOWN
    return slurm_reason(job_id, int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))


DESCRIBE = {
    CANCEL: "the job was cancelled",
    REQUEUE: "Slurm is requeueing the job",
    STEPS: "a signal to the job's steps",
    TIMEOUT: "the time limit was reached",
    PREEMPT: "the job was preempted",
    UNKNOWN: "SIGTERM",
}
