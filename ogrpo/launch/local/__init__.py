"""`--backend local`: run a JobSpec on this machine under the supervisor, in the foreground or detached, and the
local job handle (LocalJob, ogrpo.launch.handle.Job) that `ogrpo status/logs/cancel RUN_DIR` use.

Local means every role shares this node, so the server binds to loopback (never 0.0.0.0: TRL's default host
exposes the dev-mode weight-update routes to the whole network) and both ports are fresh free ones, reserved so
that two local jobs at once cannot collide.

Either way the run records itself in JOB_DIR/local/state.json (ogrpo.launch.local.state) and writes the
supervisor's messages to JOB_DIR/logs/supervisor.log, so a foreground run can be watched and stopped from another
terminal just like a detached one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, TextIO

from ogrpo import layout
from ogrpo.errors import LaunchError, OgrpoError
from ogrpo.jobspec import JobSpec, Step
from ogrpo.launch import cpu_slots, stopping
from ogrpo.launch.handle import ENDED, Job
from ogrpo.launch.local import state as ls
from ogrpo.launch.local.state import STATE_FILE
from ogrpo.launch.ports import free_ports, release_ports, release_stale
from ogrpo.launch.procs import describe, group_members
from ogrpo.launch.run_state import record_status, run_dir_state
from ogrpo.launch.supervisor import JobResult, Supervisor, log_tail
from ogrpo.launch.teardown import exit_on_signals

LOOPBACK = "127.0.0.1"
JOBSPEC_FILE = layout.JOBSPEC


def jobspec_from_dict(data: dict) -> JobSpec:
    data = dict(data)
    steps = [Step(**s) for s in data.pop("steps")]
    known = {k: v for k, v in data.items() if k in JobSpec.__dataclass_fields__}
    return JobSpec(steps=steps, **known)


def load_jobspec(job: str | os.PathLike) -> JobSpec:
    """A JobSpec from a job directory (its jobspec.json, else manifest.json's "jobspec") or a JSON file."""
    path = Path(job)
    candidates = [path] if path.is_file() else [path / JOBSPEC_FILE, layout.job_manifest(path)]
    for c in candidates:
        if c.is_file():
            data = json.loads(c.read_text())
            if c.name == layout.MANIFEST or "jobspec" in data and "steps" not in data:
                data = data.get("jobspec") or {}
            if "steps" in data:
                return jobspec_from_dict(data)
    raise OgrpoError(f"no job spec in {job}: expected {JOBSPEC_FILE} or manifest.json written by `ogrpo render`")


def local_step_env(step: Step) -> dict[str, str]:
    """Devices a step may see: its own GPUs (or, on CPU, cores) only, so server and trainer never share one by
    accident."""
    if step.gpus:
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in step.gpus)}

    return cpu_slots.step_env(step.role, step.env.get(cpu_slots.SLOTS_ENV))  # a CPU plan: its own cores


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


def supervisor_log(job_dir: str | os.PathLike) -> Path:
    return layout.supervisor_log(job_dir)


class _Tee:
    """The supervisor's messages on the terminal and in the run's supervisor.log."""

    def __init__(self, *streams: TextIO):
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


def _refuse_if_running(job_dir: Path) -> None:
    rec = ls.read_state(job_dir)
    if (rec and rec.get("state") == "RUNNING" and rec.get("pid") != os.getpid()
            and (not ls.on_this_host(rec) or ls.record_alive(rec))):
        raise OgrpoError(f"{job_dir} already has a running job (pid {rec.get('pid')} on {rec.get('host')}): "
                         f"`ogrpo cancel {job_dir}` first, or pick another --output")


def run_local(job: JobSpec | str | os.PathLike, *, health_timeout_s: float | None = None,
              out: TextIO | None = None, follow: str | None = "trainer", detached: bool = False) -> int:
    """Run the job here; returns its exit code (0 when the trainer finished cleanly). The trainer's output is
    echoed live to stdout (progress, final stage profile) unless `follow` is None. `detached`: this process was
    started by `start_detached`, its stdout/stderr already are the supervisor log."""
    spec = job if isinstance(job, JobSpec) else load_jobspec(job)
    job_dir = Path(spec.job_dir)
    _refuse_if_running(job_dir)
    log_path = supervisor_log(job_dir)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    record = ls.running_record()
    ls.write_state(job_dir, record)
    rc, message = 1, "the run stopped before its supervisor returned"
    # SIGTERM/SIGHUP before the supervisor takes them over would kill us on the spot, leaving RUNNING behind
    with open(log_path, "a") as log, exit_on_signals():
        sink = (out or sys.stderr) if detached else _Tee(out or sys.stderr, log)
        try:
            result = run_local_result(spec, health_timeout_s=health_timeout_s, out=sink, follow=follow)
            rc, message = result.rc, result.message
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
            message = f"stopped by signal {rc - 128}" if rc > 128 else f"exited with {rc}"
            raise
        except KeyboardInterrupt:
            rc, message = 128 + signal.SIGINT, "interrupted (Ctrl-C)"
            raise
        except BaseException as exc:
            message = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            first = (message.splitlines() or [""])[0]
            ls.write_state(job_dir, ls.ended_record(record, rc, first))
            _record_run_end(job_dir, rc, first)
    return rc


def _record_run_end(job_dir: Path, rc: int, message: str) -> None:
    """The run manifest's status when the trainer could not write it itself (killed, or stopped first)."""
    if rc == 0:
        return
    if rc in ls.CANCEL_CODES:
        record_status(layout.run_dir(job_dir), "cancelled", message)
    else:
        record_status(layout.run_dir(job_dir), "failed", message)


def start_detached(job: JobSpec | str | os.PathLike, start_timeout_s: float = 60.0) -> "LocalJob":
    """Run the job in the background, in its own session (it outlives this process and the terminal), and return
    its handle once the run has recorded itself."""
    spec = job if isinstance(job, JobSpec) else load_jobspec(job)
    job_dir = Path(spec.job_dir).resolve()
    if isinstance(job, JobSpec) or not (job_dir / JOBSPEC_FILE).exists():
        job_dir.mkdir(parents=True, exist_ok=True)
        (job_dir / JOBSPEC_FILE).write_text(json.dumps(spec.to_dict(), indent=2) + "\n")
    _refuse_if_running(job_dir)
    log_path = supervisor_log(job_dir)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ogrpo.launch.local", "run", str(job_dir)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + start_timeout_s
    while time.monotonic() < deadline:
        rec = ls.read_state(job_dir)
        if rec and rec.get("pid") == proc.pid:
            return LocalJob(job_dir)
        if proc.poll() is not None:
            raise LaunchError(f"the background run exited with code {proc.returncode} before it started; "
                              f"{log_path}:\n{log_tail(log_path, 10)}")
        time.sleep(0.1)
    proc.kill()
    raise LaunchError(f"the background run did not record itself in {ls.state_path(job_dir)} within "
                      f"{start_timeout_s:.0f} s; see {log_path}")


class LocalJob(Job):
    """The handle of a run on this machine, found again from its run directory."""

    backend = "local"

    def __init__(self, job_dir: str | os.PathLike):
        self.job_dir = Path(job_dir).resolve()
        self.job_id = self.job_dir.name
        self.record()  # a directory without a readable record is no local run: say so now, not mid-command

    def record(self) -> dict:
        rec = ls.read_state(self.job_dir)
        if rec is None:
            raise OgrpoError(f"{self.job_dir} has no readable {STATE_FILE}: it is not a run started by "
                             "`ogrpo submit --backend local`")
        return rec

    def state(self) -> str:
        rec = self.record()
        if rec.get("state") != "RUNNING" or not ls.on_this_host(rec) or ls.record_alive(rec):
            return rec.get("state", "UNKNOWN")
        rec = self.record()  # it may have recorded its end between the two reads
        return "LOST" if rec.get("state") == "RUNNING" else rec.get("state", "UNKNOWN")

    def exit_code(self) -> int | None:
        return self.record().get("exit_code")

    def status(self) -> dict:
        rec = self.record()
        state = self.state()
        info = {"job_id": self.job_id, "backend": "local", "state": state, "pid": rec.get("pid"),
                "host": rec.get("host"), "started": rec.get("started"), "elapsed": ls.elapsed(rec)}
        if rec.get("exit_code") is not None:
            info["exit_code"] = str(rec["exit_code"])
        if rec.get("message") and state != "COMPLETED":
            info["message"] = rec["message"]
        if state == "LOST":
            info["message"] = (f"the run's process {rec.get('pid')} is gone and recorded no end (killed with "
                               "SIGKILL, or the machine restarted)")
            left = self._leftover_groups(rec)
            if left:
                info["message"] += f"; its steps still run (process groups {left}): ogrpo cancel {self.job_dir}"
        elif state == "RUNNING" and not ls.on_this_host(rec):
            info["message"] = f"runs on {rec.get('host')}: its process can only be checked there"
        run = {k: v for k, v in run_dir_state(self.job_dir).items()
               if k not in ("attempts", "requeues", "max_requeues", "devices")}
        info.update(run)
        info["devices"] = self._devices()
        return info

    def _devices(self) -> dict:
        out = {}
        for p in sorted(layout.roles_dir(self.job_dir).glob("*.json")):
            if ".step" in p.name:
                continue
            try:
                dev = json.loads(p.read_text()).get("env", {}).get("CUDA_VISIBLE_DEVICES")
            except ValueError:
                continue
            if dev is not None:
                out[p.stem] = dev
        return out

    def log_files(self, role: str | None = None) -> list[Path]:
        logs = layout.step_logs(self.job_dir)
        if role == "supervisor":
            return [supervisor_log(self.job_dir)]
        if role:
            several = sorted(p for p in logs.glob(f"{role}*.log") if p.stem[len(role):].isdigit())
            return several or [logs / f"{role}.log"]
        return [supervisor_log(self.job_dir), *sorted(logs.glob("*.log"))]

    def _signal(self, rec: dict, sig: int) -> None:
        try:
            if rec.get("pgid"):
                os.killpg(int(rec["pgid"]), sig)
            else:
                os.kill(int(rec["pid"]), sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _leftover_groups(self, rec: dict) -> list[int]:
        """Process groups of this run's steps that still have live members. Each step leads its own group
        (supervisor.py), recorded in run/roles/<name>.json right after it started."""
        out = []
        for p in sorted(layout.roles_dir(self.job_dir).glob("*.json")):
            if ".step" in p.name or p.stat().st_mtime < float(rec.get("started_at") or 0) - 1:
                continue  # a Slurm step record, or a step of an earlier run in this directory
            try:
                pgid = int(json.loads(p.read_text())["pid"])
            except (ValueError, KeyError, TypeError):
                continue
            members = group_members(pgid)
            if not members:
                continue
            if pgid in members:  # the leader is alive: make sure it is our step, not a reused pid
                started = ls.process_start(pgid)
                if started is not None and abs(started - p.stat().st_mtime) > 10:
                    continue
            out.append(pgid)
        return out

    def _kill_groups(self, groups: list[int], grace_s: float = 5.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for g in groups:
                try:
                    os.killpg(g, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + grace_s
            while any(group_members(g) for g in groups) and time.monotonic() < deadline:
                time.sleep(0.1)

    def cancel(self, wait_s: float | None = None) -> None:
        """SIGTERM the run (its supervisor stops the steps: the usual teardown), SIGKILL it after `wait_s`, then
        kill any step group still alive; returns when none of the run's processes is left (LaunchError naming
        the survivors otherwise) and records `cancelled` in the run's manifest."""
        rec = self.record()
        if not ls.on_this_host(rec):
            raise OgrpoError(f"job {self.job_id} runs on {rec.get('host')}: run `ogrpo cancel` there")
        state = self.state()
        if state == "LOST":
            left = self._leftover_groups(rec)
            if not left:
                raise OgrpoError(f"job {self.job_id} already ended (LOST: its process died without recording "
                                 "an end); nothing to cancel")
            self._kill_groups(left)
            self._check_gone(rec)
            record_status(layout.run_dir(self.job_dir), "cancelled", "cancelled by ogrpo cancel")
            return
        if state in ENDED:
            raise OgrpoError(f"job {self.job_id} already ended ({state}); nothing to cancel")
        # before any signal: the trainer then stops at once instead of checkpointing as for a preemption
        stopping.request_cancel(layout.run_dir(self.job_dir))
        wait_s = 60.0 if wait_s is None else wait_s
        self._signal(rec, signal.SIGTERM)
        deadline = time.monotonic() + wait_s
        while ls.record_alive(rec) and time.monotonic() < deadline:
            time.sleep(0.2)
        if ls.record_alive(rec):
            self._signal(rec, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while ls.record_alive(rec) and time.monotonic() < deadline:
                time.sleep(0.1)
        left = self._leftover_groups(rec)
        if left:
            self._kill_groups(left)
        if (ls.read_state(self.job_dir) or {}).get("state") == "RUNNING":  # killed before it could record its end
            ls.write_state(self.job_dir, ls.ended_record(rec, 128 + signal.SIGKILL,
                                                         f"killed by ogrpo cancel after {wait_s:.0f} s"))
        self._check_gone(rec)

        release_stale()  # the claims of a run killed before it could release its ports
        record_status(layout.run_dir(self.job_dir), "cancelled", "cancelled by ogrpo cancel")

    def _check_gone(self, rec: dict) -> None:
        """Nothing of the run may be left: its supervisor, or any member of its steps' process groups."""
        alive = [int(rec["pid"])] if ls.record_alive(rec) else []
        for g in self._leftover_groups(rec):
            alive += group_members(g)
        if alive:
            raise LaunchError(f"job {self.job_id}: still alive after cancel: {describe(sorted(set(alive)))}")


def _main(argv: list[str]) -> int:
    """`python -m ogrpo.launch.local run JOB_DIR`: the background run `start_detached` starts."""
    if len(argv) != 2 or argv[0] != "run":
        raise SystemExit("usage: python -m ogrpo.launch.local run JOB_DIR")
    try:
        rc = run_local(argv[1], follow=None, detached=True)
    except OgrpoError as exc:
        print(f"ogrpo: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return rc if 0 <= rc < 256 else 1

