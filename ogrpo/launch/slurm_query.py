"""The Slurm backend's job handle (SlurmJob): find a job by id or run directory, read Slurm (squeue, sacct) and
its run dir, cancel it.

A job id maps to its run directory three ways, first hit wins: the run dir itself (`slurm/job_id`), the job's
working directory in squeue/sacct (submit sets `--chdir` to the run dir), and a small index written at submit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ogrpo import layout
from ogrpo.errors import LaunchError, OgrpoError
from ogrpo.launch.handle import Job

FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}


def _index_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ogrpo" / "slurm-jobs.jsonl"


def remember(job_id: str, job_dir: str | Path) -> None:
    path = _index_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps({"job_id": str(job_id), "job_dir": str(Path(job_dir).resolve())}) + "\n")


def _from_index(job_id: str) -> str | None:
    path = _index_path()
    if not path.exists():
        return None
    found = None
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("job_id") == job_id:
            found = rec.get("job_dir")
    return found


# A Slurm command that has not answered after this long gets its configuration and controller checked: a
# controller that is down makes squeue retry for ~18 s and sbatch ~9 s before they say so (Slurm 22.05), and a
# SLURM_CONF naming no file makes them retry reading it for 60 s.
PROBE_AFTER_S = 2.0
PROBE_TIMEOUT_S = 2.0
DEFAULT_CONF = "/etc/slurm/slurm.conf"


def conf_problem() -> str | None:
    """A SLURM_CONF that names no file (Slurm's commands would retry reading it for a minute)."""
    conf = os.environ.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):
        return (f"SLURM_CONF={conf} does not exist: point it at the cluster's slurm.conf (or unset it), or run "
                "this on a login node of the cluster")
    return None


def controllers(conf_text: str) -> tuple[list[str], int]:
    """The controller addresses and port of a slurm.conf (`SlurmctldHost=name(addr)`, or the older
    ControlMachine/ControlAddr/BackupController/BackupAddr; `SlurmctldPort=6817[-6818]`)."""
    hosts, port, legacy = [], 6817, {}
    for line in conf_text.splitlines():
        key, sep, value = line.split("#", 1)[0].strip().partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or not value:
            continue
        if key == "slurmctldhost":
            name, _, addr = value.partition("(")
            hosts.append(addr.rstrip(")") or name)
        elif key == "slurmctldport":
            first = value.split("-")[0]
            port = int(first) if first.isdigit() else port
        elif key in ("controlmachine", "controladdr", "backupcontroller", "backupaddr"):
            legacy[key] = value
    if not hosts:
        for name, addr in (("controlmachine", "controladdr"), ("backupcontroller", "backupaddr")):
            if legacy.get(addr) or legacy.get(name):
                hosts.append(legacy.get(addr) or legacy[name])
    return hosts, port


def controller_unreachable() -> str | None:
    """Why no controller of this cluster accepts a connection, or None (one does, or slurm.conf cannot tell:
    a configless site)."""
    import socket

    path = os.environ.get("SLURM_CONF") or DEFAULT_CONF
    try:
        hosts, port = controllers(Path(path).read_text())
    except OSError:
        return None
    errors = []
    for host in hosts:
        try:
            socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S).close()
            return None
        except OSError as exc:
            errors.append(f"{host}:{port}: {exc.strerror or type(exc).__name__}")
    if not errors:
        return None
    return (f"cannot reach the Slurm controller ({'; '.join(errors)}; SLURM_CONF={path}): check `scontrol ping` "
            "and that this is a login node of the cluster")


def run_slurm(cmd: list[str], timeout: float = 30, **popen) -> subprocess.CompletedProcess:
    """Run a Slurm client command; OgrpoError (one line, exit 2) within seconds when the cluster cannot answer:
    SLURM_CONF names no file, no controller accepts a connection, or the command hangs past `timeout`."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    try:
        try:
            out, err = proc.communicate(timeout=min(PROBE_AFTER_S, timeout))
        except subprocess.TimeoutExpired:
            # only a command that is slow to answer is looked into: a healthy cluster answers in milliseconds
            problem = conf_problem() or controller_unreachable()
            if problem:
                raise OgrpoError(problem) from None
            out, err = proc.communicate(timeout=max(0.0, timeout - PROBE_AFTER_S))
    except subprocess.TimeoutExpired:
        raise OgrpoError(f"`{' '.join(cmd[:3])}` did not answer within {timeout:.0f} s: the Slurm controller is "
                         "overloaded or unreachable (scontrol ping)") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _run(cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return run_slurm(cmd, timeout)


@dataclass
class JobRef:
    job_id: str
    job_dir: Path | None


def resolve(ref: str) -> JobRef:
    """A job id or a run directory → JobRef."""
    p = Path(ref)
    if p.is_dir():
        f = p / "slurm" / "job_id"
        if not f.exists():
            raise OgrpoError(f"{ref} has no slurm/job_id: it was not submitted with `ogrpo submit --backend slurm`")
        return JobRef(f.read_text().strip(), p.resolve())
    if not ref.split("_")[0].isdigit():
        raise OgrpoError(f"{ref!r} is neither a Slurm job id nor a run directory")
    job_dir = _from_index(ref)
    if job_dir is None and shutil.which("squeue"):
        out = _run(["squeue", "-h", "-j", ref, "-o", "%Z"])
        job_dir = out.stdout.strip() or None if out.returncode == 0 else None
    if job_dir is None and shutil.which("sacct"):
        out = _run(["sacct", "-n", "-P", "-X", "-j", ref, "-o", "WorkDir"])
        job_dir = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    return JobRef(ref, Path(job_dir) if job_dir and Path(job_dir).is_dir() else None)


def _require(tool: str) -> None:
    if shutil.which(tool) is None:
        raise OgrpoError(f"`{tool}` is not on PATH: run this on a Slurm login node")


def slurm_state(job_id: str) -> dict:
    """{state, reason, elapsed, exit_code, nodes, steps: [{id, name, state}]} from squeue, else sacct."""
    _require("squeue")
    info: dict = {"job_id": job_id, "state": "UNKNOWN", "steps": []}
    # -t all: the controller keeps ended jobs for MinJobAge and its state is final at once, while slurmdbd
    # records asynchronously (sacct can say RUNNING for a moment after the job has ended)
    q = _run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T|%r|%M|%N"])
    if q.returncode != 0 and _unreachable(q.stderr):
        raise OgrpoError(f"cannot reach the Slurm controller ({_first_line(q.stderr)}); check `scontrol ping` "
                         "and that this is a login node of the cluster")
    if q.returncode == 0 and q.stdout.strip():
        state, reason, elapsed, nodes = q.stdout.strip().splitlines()[0].split("|")
        info.update(state=state, reason=reason, elapsed=elapsed, nodes=nodes, source="squeue")
        restarts = _restarts(job_id)
        if restarts is not None:
            info["restarts"] = restarts
    if shutil.which("sacct"):
        a = _run(["sacct", "-n", "-P", "-j", job_id, "-o", "JobID,JobName,State,ExitCode,Elapsed,NodeList"])
        if a.returncode == 0:
            for line in a.stdout.strip().splitlines():
                jid, name, state, exit_code, elapsed, nodes = line.split("|")
                if jid == job_id:
                    if info.get("source") != "squeue":
                        info.update(state=state.split()[0], exit_code=exit_code, elapsed=elapsed, nodes=nodes,
                                    source="sacct")
                    else:
                        info["exit_code"] = exit_code
                elif jid.startswith(job_id + "."):
                    info["steps"].append({"id": jid, "name": name, "state": state.split()[0],
                                          "exit_code": exit_code})
    if info.get("source") is None:
        raise OgrpoError(f"job {job_id} is not known to Slurm (neither the controller nor the accounting "
                         "database has it); check the id with `squeue --me` or `sacct`")
    return info


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or ["no output"])[0]


def _unreachable(stderr: str) -> bool:
    return any(w in stderr for w in ("Unable to contact slurm controller", "Connection refused",
                                     "Socket timed out", "Zero Bytes were transmitted"))


def _restarts(job_id: str) -> int | None:
    """How often Slurm restarted (requeued) the job: scontrol's Restarts, which counts requeues of every kind
    (time limit, preemption, `scontrol requeue`), unlike the run directory's own records."""
    out = _run(["scontrol", "show", "job", "-o", job_id])
    for word in out.stdout.split() if out.returncode == 0 else ():
        if word.startswith("Restarts="):
            return int(word.split("=", 1)[1])
    return None


def run_dir_state(job_dir: Path | None) -> dict:
    """Attempts, requeues, role device records, checkpoints and the last metrics line from the run dir."""
    if job_dir is None:
        return {}
    out: dict = {"job_dir": str(job_dir)}
    sl = job_dir / "slurm"
    out["attempts"] = len(list(sl.glob("attempt-*.json")))
    requeues = [json.loads(p.read_text()) for p in sorted(sl.glob("requeue-*.json"))]
    out["requeues"] = sum(1 for r in requeues if r.get("requeued"))
    if requeues:
        out["max_requeues"] = requeues[-1].get("max_requeues")
    if (sl / "result.json").exists():
        out["result"] = json.loads((sl / "result.json").read_text())
    run = layout.run_dir(job_dir)
    roles = {}
    # <role>.step.json: written inside each srun step, so it holds the devices Slurm gave that step
    for p in sorted(layout.roles_dir(job_dir).glob("*.step*.json")):
        try:
            rec = json.loads(p.read_text())
        except ValueError:
            continue
        role, task = p.name[: -len(".json")].split(".step")
        roles[role + (f".{task}" if task else "")] = rec.get("cuda_visible_devices")
    out["devices"] = roles
    ckpts = sorted((p for p in run.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()),
                   key=lambda p: int(p.name.split("-")[-1]))
    if ckpts:
        out["last_checkpoint"] = ckpts[-1].name
    if layout.preempted_file(job_dir).exists():
        out["preempted"] = json.loads(layout.preempted_file(job_dir).read_text())
    metrics = run / layout.METRICS
    if metrics.exists():
        lines = metrics.read_text().strip().splitlines()
        if lines:
            try:
                out["last_metrics"] = json.loads(lines[-1])
            except ValueError:
                pass
    return out


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


def is_finished(job_id: str) -> bool:
    q = _run(["squeue", "-h", "-j", job_id, "-o", "%T"])
    return q.returncode != 0 or not q.stdout.strip()


def has_ended(job_id: str) -> bool:
    """Ended for good: not pending, running, or COMPLETING (Slurm still killing its processes)."""
    q = _run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"])
    state = q.stdout.strip().split()[0] if q.returncode == 0 and q.stdout.strip() else ""
    return not state or state in FINAL_STATES


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
    from ogrpo.launch import procs
    from ogrpo.launch.procs import group_members

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
    """The handle of a Slurm job (ogrpo.launch.handle.Job)."""

    backend = "slurm"

    def __init__(self, ref: JobRef):
        self.ref = ref
        self.job_id = ref.job_id
        self.job_dir = ref.job_dir

    @classmethod
    def from_ref(cls, ref: str) -> "SlurmJob":
        return cls(resolve(ref))

    def state(self) -> str:
        return slurm_state(self.job_id)["state"]

    def done(self) -> bool:
        return is_finished(self.job_id)

    def status(self) -> dict:
        info = {**slurm_state(self.job_id), **run_dir_state(self.job_dir)}
        if info.get("restarts") is not None:
            info["requeues"] = max(info["restarts"], info.get("requeues", 0))  # Slurm's count, as Slurm reports it
        return info

    def log_files(self, role: str | None = None) -> list[Path]:
        return log_files(self.ref, role)

    def cancel(self, wait_s: float | None = None) -> None:
        """scancel the job; return once Slurm has ended it and no process of it is left on this machine (a
        process that escaped Slurm's tracking would be). LaunchError (exit 1) naming what is still alive after
        `wait_s` (default: the cluster's KillWait + 60 s). Records `cancelled` in the run's manifest."""
        from ogrpo.launch import ports, procs, stopping
        from ogrpo.train.rundir import record_status

        _require("scancel")
        # scancel answers 0 for an id the controller does not know: ask first, so a typo is not "cancelled".
        state = slurm_state(self.job_id)["state"]
        if state in FINAL_STATES:
            raise OgrpoError(f"job {self.job_id} already ended ({state}); nothing to cancel")
        run = layout.run_dir(self.job_dir) if self.job_dir is not None else None
        if run is not None:  # before the signals: the trainer then stops at once, not as for a requeue
            stopping.request_cancel(run, self.job_id)
        out = _run(["scancel", self.job_id])
        if out.returncode != 0:
            raise OgrpoError(f"scancel {self.job_id} failed: {out.stderr.strip() or out.returncode}")
        if wait_s is None:
            from ogrpo.launch.grace import query

            grace = query()
            wait_s = (grace.kill_wait_s if grace else 30) + 60
        deadline = time.monotonic() + wait_s
        while not has_ended(self.job_id):
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


# Entry points kept for callers that hold a Slurm id (tests/slurm, ogrpo.reproduce); `ogrpo status/logs/cancel`
# go through ogrpo.launch.handle.find, which also knows local runs.
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
    _run(["scancel", "--batch", "--signal=USR2", job_id]).check_returncode()
