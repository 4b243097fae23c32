"""The Slurm backend's job handle (SlurmJob): find a job by id or run directory, follow it through submitit
(ogrpo.launch.slurm.submitit_adapter: its SlurmJob and batched sacct watcher), add what O-GRPO knows on top (requeue
count, steps, the run directory's records), cancel it.

A job id maps to its run directory three ways: the run dir itself (`slurm/job_id`); the job's working directory
as sacct or squeue have it (submit sets `--chdir` to the run dir); else a small index written at submit, whose
entries carry the cluster (ClusterName and controller) they were submitted to, since job ids repeat across
clusters.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ogrpo import layout
from ogrpo.errors import LaunchError, OgrpoError
from ogrpo.launch import ports, procs, stopping
from ogrpo.launch.handle import ENDED, Job
from ogrpo.launch.procs import group_members
from ogrpo.launch.run_state import record_status, run_dir_state
from ogrpo.launch.slurm import grace as slurm_grace
from ogrpo.launch.slurm import submitit_adapter
from ogrpo.launch.slurm.cli import require, run_slurm, unanswered
from ogrpo.launch.slurm.grace import QUERY_TIMEOUT_S
from ogrpo.launch.slurm.parse import key_values

__all__ = ["SlurmJob", "JobRef", "resolve", "remember", "cluster_identity", "run_slurm", "status", "stream_logs",
           "cancel", "interrupt"]


def _index_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ogrpo" / "slurm-jobs.jsonl"


def cluster_identity() -> dict[str, str]:
    """This machine's Slurm cluster: {cluster: ClusterName, controller: the first SlurmctldHost} from `scontrol
    show config`. A job id names a job only within its cluster (a new or a second cluster counts from 1 again).
    OgrpoError (one line) when Slurm is not installed here or cannot answer."""
    out = run_slurm(["scontrol", "show", "config"], timeout=QUERY_TIMEOUT_S)
    unanswered(out)
    cfg = key_values(out.stdout, lines=True) if out.returncode == 0 else {}
    if not cfg.get("ClusterName"):
        why = (out.stderr.strip().splitlines() or ["no ClusterName in its output"])[-1]
        raise OgrpoError(f"cannot tell which Slurm cluster this is (`scontrol show config`: {why})")
    return {"cluster": cfg["ClusterName"], "controller": cfg.get("SlurmctldHost[0]") or cfg.get("ControlMachine", "")}


def _where(entry: dict) -> str:
    return f"cluster {entry.get('cluster')} (controller {entry.get('controller') or '?'})"


def remember(job_id: str, job_dir: str | Path) -> None:
    """Add a submitted job to the index, with the cluster it went to (left out when Slurm cannot say: the job is
    submitted already, and sacct still finds its run directory)."""
    try:
        here = cluster_identity()
    except OgrpoError:
        here = {}
    path = _index_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps({"job_id": str(job_id), "job_dir": str(Path(job_dir).resolve()), **here}) + "\n")


def _from_index(job_id: str) -> list[dict]:
    """The index's entries for `job_id`, oldest first (one per cluster it was submitted to, or more)."""
    path = _index_path()
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("job_id") == job_id and rec.get("job_dir"):
            found.append(rec)
    return found


@dataclass
class JobRef:
    job_id: str
    job_dir: Path | None


def resolve(ref: str) -> JobRef:
    """A job id or a run directory → JobRef. An id is this cluster's: its run directory is the job's working
    directory as Slurm has it (submit sets --chdir to the run dir), else the index's entry recorded for this
    cluster; an id that only another cluster's entries know is refused (one line naming that cluster), so that
    status, logs and cancel never act on this cluster's job for another cluster's run."""
    p = Path(ref)
    if p.is_dir():
        f = p / "slurm" / "job_id"
        if not f.exists():
            raise OgrpoError(f"{ref} has no slurm/job_id: it was not submitted with `ogrpo submit --backend slurm`")
        return JobRef(f.read_text().strip(), p.resolve())
    if not ref.split("_")[0].isdigit():
        raise OgrpoError(f"{ref!r} is neither a Slurm job id nor a run directory")
    row = submitit_adapter.job(".", ref).info()
    queued = None if row else _controller(ref)  # not in the accounting database (yet, or the site has none)
    job_dir = row.get("WorkDir") or (queued or ("", ""))[1] or None
    entries = _from_index(ref)
    if entries and job_dir is None:
        here = cluster_identity()
        mine = [e for e in entries if e.get("cluster") == here["cluster"]
                and e.get("controller", "") == here["controller"]]
        if mine:
            job_dir = mine[-1]["job_dir"]
        elif not row and queued is None and any(e.get("cluster") for e in entries):
            other = [e for e in entries if e.get("cluster")][-1]
            raise OgrpoError(f"job {ref} was submitted to {_where(other)}, not to this one ({_where(here)}), "
                             f"which does not know it: run this on a login node of {other['cluster']}, or pass "
                             f"its run directory {other['job_dir']}")
    return JobRef(ref, Path(job_dir) if job_dir and Path(job_dir).is_dir() else None)


def _controller(job_id: str) -> tuple[str, str] | None:
    """(state, working directory) of the job as the controller has it; None once it has forgotten the job
    (MinJobAge). OgrpoError when the controller cannot be reached (squeue then fails the same way)."""
    out = run_slurm(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T|%Z"])
    unanswered(out)
    line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    return tuple(line.split("|", 1)) if "|" in line else None


def _restarts(job_id: str) -> int | None:
    """How often Slurm restarted (requeued) the job: scontrol's Restarts, which counts requeues of every kind
    (time limit, preemption, `scontrol requeue`), unlike the run directory's own records."""
    out = run_slurm(["scontrol", "show", "job", "-o", job_id])
    unanswered(out)
    restarts = key_values(out.stdout).get("Restarts") if out.returncode == 0 else None
    return int(restarts) if restarts is not None else None


def log_files(job: JobRef, role: str | None) -> list[Path]:
    if job.job_dir is None:
        raise OgrpoError(f"no run directory found for job {job.job_id}: pass the run directory instead of the id")
    logs = layout.step_logs(job.job_dir)
    supervisor = layout.slurm_output(job.job_dir, job.job_id)  # job.sbatch's #SBATCH --output
    if role == "supervisor":
        return [supervisor]
    if role:
        return [logs / f"{role}.log"]
    return [supervisor, *sorted(logs.glob("*.log"))]


def _ancestors() -> set[int]:
    out, pid = set(), os.getpid()
    while pid > 1:
        out.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def leftover_processes(job_id: str, job_dir: Path | None) -> list[int]:
    """Processes of the job still alive on this machine: those with its SLURM_JOB_ID in their environment, and
    the members of the process groups its steps recorded (run/roles/*.step*.json, written by the step wrapper
    with this kernel's boot id when they ran here). Other nodes' processes are Slurm's to see."""
    found = set(procs.of_slurm_job(str(job_id), os.environ.get("SLURM_CONF")))
    here = procs.boot_id()
    records = []
    if job_dir is not None:
        records = [*layout.roles_dir(job_dir).glob("*.step*.json"), *(job_dir / layout.SLURM).glob("attempt-*.json")]
    for path in records:
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not here or rec.get("boot_id") != here or str(rec.get("slurm_job_id", rec.get("job_id"))) != str(job_id):
            continue
        for key in ("pid", "supervisor_pid"):
            if rec.get(key) and procs.alive(int(rec[key])):
                found.add(int(rec[key]))
        if rec.get("pgid"):
            found.update(group_members(int(rec["pgid"])))
    return sorted(found - _ancestors())


class SlurmJob(Job):
    """The handle of a Slurm job (ogrpo.launch.handle.Job) on submitit's: state from its watcher (one `sacct`
    for every job this process follows), `scancel` through its `cancel`."""

    backend = "slurm"

    def __init__(self, ref: JobRef):
        self.ref = ref
        self.job_id = ref.job_id
        self.job_dir = ref.job_dir
        self._job = submitit_adapter.job(ref.job_dir or ".", ref.job_id)

    @classmethod
    def from_ref(cls, ref: str) -> "SlurmJob":
        return cls(resolve(ref))

    def state(self) -> str:
        state, self.source = self._job.state(), "sacct"
        if state not in ENDED:
            # slurmdbd records asynchronously: a moment after the controller has a new job, and after it ended
            # (sacct may still say RUNNING); the controller's word, while it has the job, is current
            queued = _controller(self.job_id)
            if queued:
                state, self.source = queued[0], "squeue"
        return state

    def status(self) -> dict:
        state = self.state()
        if state == "UNKNOWN":
            raise OgrpoError(f"job {self.job_id} is not known to Slurm (neither the controller nor the accounting "
                             "database has it); check the id with `squeue --me` or `sacct`")
        row = self._job.info(fresh=False)
        info = {"job_id": self.job_id, "backend": self.backend, "state": state, "source": self.source,
                "reason": row.get("Reason"),
                "elapsed": row.get("Elapsed"), "exit_code": row.get("ExitCode"), "nodes": row.get("NodeList"),
                "steps": self._job.steps()}
        info = {k: v for k, v in info.items() if v is not None}
        restarts = _restarts(self.job_id)  # None once the controller has forgotten the job (MinJobAge)
        info.update(run_dir_state(self.job_dir))
        if restarts is not None:
            info["restarts"] = restarts
            info["requeues"] = max(restarts, info.get("requeues", 0))  # Slurm's count, as Slurm reports it
        return info

    def log_files(self, role: str | None = None) -> list[Path]:
        return log_files(self.ref, role)

    def cancel(self, wait_s: float | None = None) -> None:
        """scancel the job; return once Slurm has ended it and no process of it is left on this machine (a
        process that escaped Slurm's tracking would be). LaunchError (exit 1) naming what is still alive after
        `wait_s` (default: the cluster's KillWait + 60 s). Records `cancelled` in the run's manifest."""
        require("scancel")
        # scancel answers 0 for an id the controller does not know: ask first, so a typo is not "cancelled".
        state = self.status()["state"]
        if state in ENDED:
            raise OgrpoError(f"job {self.job_id} already ended ({state}); nothing to cancel")
        run = layout.run_dir(self.job_dir) if self.job_dir is not None else None
        if run is not None:  # before the signals: the trainer then stops at once, not as for a requeue
            stopping.request_cancel(run, self.job_id)
        self._job.cancel()
        if wait_s is None:
            grace = slurm_grace.query()
            wait_s = (grace.kill_wait_s if grace else 30) + 60
        deadline = time.monotonic() + wait_s
        while self.state() not in ENDED:
            if time.monotonic() > deadline:
                left = leftover_processes(self.job_id, self.job_dir)
                raise LaunchError(f"job {self.job_id} is still ending {wait_s:.0f} s after scancel (squeue -j "
                                  f"{self.job_id})" + (f"; alive here: {procs.describe(left)}" if left else ""))
            time.sleep(0.5)
        # Slurm has killed what it tracks; SIGKILLed processes take a moment to be gone
        left = leftover_processes(self.job_id, self.job_dir)
        settle = time.monotonic() + 10
        while left and time.monotonic() < settle:
            time.sleep(0.2)
            left = leftover_processes(self.job_id, self.job_dir)
        if left:
            raise LaunchError(f"job {self.job_id} ended in Slurm, but processes of it are still alive on this "
                              f"machine: {procs.describe(left)}")
        ports.release_stale()  # claims of a batch step killed before it could release them (when it ran here)
        if run is not None:
            record_status(run, "cancelled", "cancelled by ogrpo cancel")


# Entry points for callers that hold a Slurm id (tests/slurm, ogrpo.reproduce); `ogrpo status/logs/cancel` go
# through ogrpo.launch.executor.find, which also knows local runs.
def status(ref: str) -> dict:
    return SlurmJob.from_ref(ref).status()


def stream_logs(ref: str, role: str | None, follow: bool, write) -> None:
    SlurmJob.from_ref(ref).logs(role, follow, write)


def cancel(ref: str, wait_s: float | None = None) -> JobRef:
    job = SlurmJob.from_ref(ref)
    job.cancel(wait_s)
    return job.ref


def interrupt(job_id: str) -> None:
    """Send what Slurm sends near the time limit (USR2 to the batch step): checkpoint, then requeue."""
    run_slurm(["scancel", "--batch", "--signal=USR2", job_id]).check_returncode()
