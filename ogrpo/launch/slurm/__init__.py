"""Slurm backend: job.sbatch's batch step runs the supervisor, which starts one `srun --exact` step per role.

One batch script: `ogrpo render`, `ogrpo submit --dry-run` and `ogrpo submit` write the same job.sbatch
(ogrpo.launch.slurm.sbatch.render_script: submitit's rendering of the supervisor command), and `submit` here hands that
file to `sbatch`, so `sbatch job.sbatch` by hand runs exactly the same job. Its body `exec`s
`python -m ogrpo.launch.slurm supervise JOB_DIR`: the shared `ogrpo.launch.supervisor.Supervisor` (server and
trainer started together, health wait, watchdog, teardown), with each step's command wrapped in `srun --exact`
and its own GPU count, so Slurm hands each step disjoint devices and sets CUDA_VISIBLE_DEVICES.

Signals: the job asks for `--signal=B:USR2@delay`, i.e. only the batch step is warned before the time limit.
The batch shell `exec`s python, so the supervisor's USR2 handler receives it: it forwards USR2 to the trainer
step only (vLLM would die of it), waits for the trainer to save a checkpoint and exit, stops the server, and
runs `scontrol requeue` — at most `max_requeues` times (SLURM_RESTART_COUNT counts them). SIGTERM means
different things (ogrpo.launch.stopping asks the controller which): a forced requeue or a preemption needs no
help (the trainer saves at the end of its step if it can, and Slurm requeues); a SIGTERM to the steps only
(`scancel --signal=TERM`, a site's warning) kills the server, so the supervisor has the trainer checkpoint and
requeues as on USR2; a cancel stops everything at once, logged as a cancel. Either way the requeued job
restarts every step and the trainer resumes with `--resume auto` from the last complete checkpoint, on the ports
recorded in run/ports.json.

Each step runs under `python -m ogrpo.launch.slurm step ...` (ogrpo.launch.reaper): a child subreaper that keeps
every process the step starts inside it — accelerate's launcher dies of SIGTERM at once, and its worker would
otherwise be reparented to PID 1, out of Slurm's reach — and that ends a server step with 0 when the supervisor
asks it to stop after the trainer finished (COMPLETED in sacct, not CANCELLED).

Module import is cheap: the same file is the per-step wrapper that runs inside each srun step
(`python -m ogrpo.launch.slurm step ...`), recording which devices the step saw before running its command.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ogrpo import atomic_file, layout
from ogrpo.errors import LaunchError, OgrpoError
from ogrpo.jobspec import JobSpec, Step, fill
from ogrpo.launch import procs, stopping
from ogrpo.launch.containers import Container, make_container, wrap
from ogrpo.launch.ports import pick_slurm_ports, release_ports
from ogrpo.launch.slurm.parse import key_values, parsable_job_id
from ogrpo.launch.slurm.sbatch import (  # noqa: F401  (the options API, re-exported for callers of this backend)
    MIN_SIGNAL_DELAY_S, SlurmOptions, check_requeue_options, job_mem_gib, job_nodes, options_for,
    parse_passthrough, parse_time,
    request_flags,
)
from ogrpo.launch.slurm.cli import run_slurm

# The step whose end ends the job, and the one that checkpoints on the preemption signal.
MAIN_ROLE = "trainer"
# The trainer's exit code after a checkpoint for requeue (ogrpo.trainer.preemption.EXIT_PREEMPTED, not imported:
# that module needs transformers)
EXIT_PREEMPTED = 75
# A step's processes all receive the USR2 that srun forwards. vLLM and the accelerate/torchrun launcher would
# die of it, so every step starts with USR2 ignored; only the trainer workers install a handler
# (ogrpo.trainer.preemption), which replaces the inherited SIG_IGN.
IGNORE_USR2_ROLES = ("server", "trainer")


# ------------------------------------------------------------------------------------------ step commands


def step_resources(steps: list[Step], cpus_per_node: int, mem_mb_per_node: int | None) -> dict[str, tuple[int, int | None]]:
    """Split the allocation's CPUs (and memory, when the job asked for some) between steps that share a node,
    so that `--exact` steps can all start: CPUs in proportion to their GPUs, memory in proportion to each step's
    host-memory need (ogrpo.planner.host_memory; GPUs when a step has none). role → (cpus per task, mem MB)."""
    weight = {s.role: max(1, len(s.gpus)) for s in steps}
    mem_weight = {s.role: float(s.host_mem_gib) for s in steps} if all(s.host_mem_gib for s in steps) else weight
    out: dict[str, tuple[int, int | None]] = {}
    for s in steps:
        sharing = [t for t in steps if set(t.nodes) & set(s.nodes)]
        total_w = sum(weight[t.role] for t in sharing)
        total_m = sum(mem_weight[t.role] for t in sharing)
        tasks_per_node = max(1, -(-s.ntasks // max(1, len(s.nodes))))
        cpus = max(1, cpus_per_node * weight[s.role] // total_w // tasks_per_node)
        mem = None if not mem_mb_per_node else max(256, int(mem_mb_per_node * mem_weight[s.role] // total_m))
        out[s.role] = (cpus, mem)
    return out


def srun_argv(
    step: Step,
    *,
    job_dir: str,
    hosts: list[str],
    values: dict[str, object],
    cpus: int,
    mem_mb: int | None,
    container: Container | None = None,
    python: str | None = None,
    argv: list[str] | None = None,
) -> list[str]:
    """The `srun` command line for one step (pure): what the supervisor runs and what the tests compare.
    argv: the step's command when already filled (the Supervisor's hook), else step.argv filled here."""
    step_hosts = [hosts[i] for i in step.nodes]
    srun = [
        "srun", "--exact", f"--job-name={step.role}",
        f"--nodes={len(step.nodes)}", f"--ntasks={step.ntasks}",
        *(["--ntasks-per-node=1"] if len(step.nodes) > 1 else []),
        f"--nodelist={','.join(step_hosts)}", f"--cpus-per-task={cpus}",
        # per-node GPU count: Slurm picks disjoint devices for concurrent steps and sets CUDA_VISIBLE_DEVICES
        f"--gres=gpu:{len(step.gpus)}" if step.gpus else "--gres=none",
        # task output comes back through srun, into the role's log the Supervisor opened
        "--unbuffered",
        # one dead task must take the step down, or accelerate waits forever for its peer
        "--kill-on-bad-exit=1",
    ]
    if mem_mb:
        srun.append(f"--mem={mem_mb}M")
    # step.env reaches the tasks through srun's default --export=ALL (the Supervisor sets it on the srun client)
    in_container = container is not None and container.runtime != "none"
    py = "python3" if in_container else (python or sys.executable)
    wrapper = [py, "-m", "ogrpo.launch.slurm", "step", "--role", step.role, "--job-dir", job_dir]
    if step.role in IGNORE_USR2_ROLES:
        wrapper.append("--ignore-usr2")
    if step.role != MAIN_ROLE:
        # the supervisor asks a server to stop through this file once the trainer has finished, so that the
        # step ends with 0 (COMPLETED), not CANCELLED as a signal through srun would record it
        wrapper += ["--stop-file", str(stop_file(job_dir, step.role))]
    extra_srun, cmd = wrap(container, [*wrapper, "--", *fill(step.argv if argv is None else argv, values)])
    return [*srun, *extra_srun, *cmd]


def stop_file(job_dir: str | Path, role: str) -> Path:
    """Where the supervisor asks a step to end normally (ogrpo.launch.reaper)."""
    return layout.roles_dir(job_dir) / f"{role}.stop"


def placeholder_values(spec: JobSpec, hosts: list[str], ports: dict[str, int],
                       addrs: dict[str, str] | None = None) -> dict[str, object]:
    """Placeholder values for this allocation: hosts are Slurm's node names, `addrs` their NodeAddr (what the
    server binds and the trainer connects to), `ports` the job's {server, rendezvous, group}."""
    addrs = addrs or {}
    server = spec.step("server")
    trainer = spec.step(MAIN_ROLE) or spec.steps[-1]
    server_node = hosts[server.nodes[0]] if server else hosts[0]
    rdzv_node = hosts[trainer.nodes[0]]
    return {
        "server_host": addrs.get(server_node, server_node),
        "server_port": ports["server"],
        "rendezvous_host": addrs.get(rdzv_node, rdzv_node),
        "rendezvous_port": ports["rendezvous"],
        "group_port": ports["group"],
        "job_dir": spec.job_dir,
    }


# -------------------------------------------------------------------------------- the in-job supervisor


def _hostnames() -> list[str]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
    if not nodelist:
        return [socket.gethostname()]
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()


def node_addr(host: str) -> str:
    """The address Slurm knows for a node (NodeAddr; the node name where it sets none). A node's first
    `hostname -I` address can be a container bridge or a management network the other nodes cannot reach."""
    out = subprocess.run(["scontrol", "show", "node", host, "-o"], capture_output=True, text=True)
    return (key_values(out.stdout).get("NodeAddr") if out.returncode == 0 else None) or host


def _log(msg: str) -> None:
    print(f"[ogrpo supervisor {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _write_json(path: Path, data: dict) -> None:
    atomic_file.write_json(path, data, sort_keys=True)


def _restarts() -> int:
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


class _Requeued(Exception):
    """The USR2 path requeued the job: this attempt ends here, quietly."""


class _Ended(Exception):
    """The USR2 path stopped the job without a requeue: the attempt ends with the trainer's code."""

    def __init__(self, rc: int, message: str):
        super().__init__(message)
        self.rc = rc


class SlurmSupervisor:
    """What the batch step runs (`python -m ogrpo.launch.slurm supervise JOB_DIR`): the shared Supervisor with
    each step wrapped in `srun`, the job's ports, and the USR2 → checkpoint → requeue path."""

    def __init__(self, spec: JobSpec, *, max_requeues: int = 3, signal_delay_s: int = 90,
                 container: Container | None = None):
        self.spec = spec
        self.max_requeues = max_requeues
        self.signal_delay_s = signal_delay_s
        self.container = container
        self._sup = None  # the running Supervisor
        self._ports: dict[str, int] = {}
        self._why: str | None = None  # why this batch step was told to stop (ogrpo.launch.stopping)
        self._preempting = False
        self._started = 0.0
        self._job_id = 0

    # -- planning inside the allocation
    def wrapper(self, hosts: list[str], ports: dict[str, int], cpus_per_node: int, mem_mb: int | None,
                addrs: dict[str, str] | None = None):
        """(placeholder values, wrap_step hook) for this allocation."""
        values = placeholder_values(self.spec, hosts, ports, addrs)
        res = step_resources(self.spec.steps, cpus_per_node, mem_mb)

        def wrap_step(step: Step, argv: list[str]) -> list[str]:
            return srun_argv(step, job_dir=self.spec.job_dir, hosts=hosts, values=values, cpus=res[step.role][0],
                             mem_mb=res[step.role][1], container=self.container, argv=argv)

        return values, wrap_step

    def commands(self, hosts: list[str], ports: dict[str, int], cpus_per_node: int, mem_mb: int | None,
                 addrs: dict[str, str] | None = None) -> dict[str, list[str]]:
        values, wrap_step = self.wrapper(hosts, ports, cpus_per_node, mem_mb, addrs)
        return {s.role: wrap_step(s, fill(s.argv, values)) for s in self.spec.steps}

    def job_ports(self, job_id: int) -> dict[str, int]:
        """This attempt's ports: the ones run/ports.json recorded for this job when still free on this node,
        else the job id's slot or the next free one (ogrpo.launch.ports). Checked on the batch step's node,
        which runs the server and the trainer's first rank in every one-node plan."""
        path = layout.ports_file(self.spec.job_dir)
        recorded = None
        try:
            data = json.loads(path.read_text())
            if int(data.get("job_id", -1)) == job_id:
                recorded = data
        except (OSError, ValueError):
            pass
        try:
            return pick_slurm_ports(job_id, recorded)
        except OSError as exc:
            raise LaunchError(f"{exc}: this node's ports are taken (ss -ltn)") from exc

    def run(self) -> int:
        # CLI latency: `ogrpo plan`/`render` import this module, not this
        from ogrpo.launch.supervisor import Supervisor

        job_id = self._job_id = int(os.environ["SLURM_JOB_ID"])
        restarts = _restarts()
        hosts = _hostnames()
        addrs = {h: node_addr(h) for h in hosts}
        cpus = int(os.environ.get("SLURM_CPUS_PER_TASK") or os.environ.get("SLURM_CPUS_ON_NODE") or 1)
        mem = int(os.environ["SLURM_MEM_PER_NODE"]) if os.environ.get("SLURM_MEM_PER_NODE") else None
        job_dir = Path(self.spec.job_dir)
        (job_dir / layout.SLURM).mkdir(parents=True, exist_ok=True)
        # what `ogrpo status/logs/cancel RUN_DIR` read, also for a job submitted with plain `sbatch job.sbatch`
        (job_dir / "slurm" / "job_id").write_text(f"{job_id}\n")
        for step in self.spec.steps:  # an earlier attempt's stop requests
            stop_file(job_dir, step.role).unlink(missing_ok=True)
        ports = self._ports = self.job_ports(job_id)
        try:
            values, wrap_step = self.wrapper(hosts, ports, cpus, mem, addrs)
            _write_json(layout.ports_file(job_dir), {
                "job_id": job_id, "attempt": restarts, **ports,
                "server_host": values["server_host"], "rendezvous_host": values["rendezvous_host"]})
            _write_json(job_dir / "slurm" / f"attempt-{restarts}.json", {
                "job_id": job_id, "restart_count": restarts, "hosts": hosts, "addrs": addrs, "started": time.time(),
                "ports": ports, "commands": self.commands(hosts, ports, cpus, mem, addrs),
                "supervisor_pid": os.getpid(), "boot_id": procs.boot_id(),
            })
            _log(f"job {job_id} attempt {restarts} on {','.join(hosts)}; server {values['server_host']}:"
                 f"{ports['server']}, rendezvous {values['rendezvous_host']}:{ports['rendezvous']}, weight-sync "
                 f"group port {ports['group']}")
            self._sup = Supervisor(self.spec, {k: str(v) for k, v in values.items()}, wrap_step=wrap_step,
                                   log_dir=layout.step_logs(job_dir), out=sys.stdout,
                                   on_signal=self._on_stop_signal, on_server_exit=self._on_server_exit,
                                   request_stop=self._request_stop)
            self._started = time.time()
            old = signal.signal(signal.SIGUSR2, self._on_usr2)
            try:
                result = self._sup.run()
                rc, message = result.rc, result.message
            except _Requeued:
                return 0
            except _Ended as end:
                rc, message = end.rc, str(end)
            finally:
                signal.signal(signal.SIGUSR2, old)
        finally:
            release_ports(list(ports.values()))
        if (rc != 0 and not self._preempting and self._sup.signalled is None and self._why is None
                and (rc == EXIT_PREEMPTED or self._preempted_marker() is not None)):
            # The trainer saved on a signal that reached the steps but not this batch step (a site that signals
            # the steps only: `scancel --signal=TERM`) and exited before the server did: requeue. When this
            # step was signalled too, `_on_stop_signal` knows why and Slurm decides.
            if self._requeue_allowed(rc):
                subprocess.run(["scontrol", "requeue", str(job_id)], check=False)
                time.sleep(120)  # Slurm kills this batch step as part of the requeue
        _write_json(job_dir / "slurm" / "result.json", {"job_id": job_id, "restart_count": restarts, "rc": rc,
                                                      "message": message, "stop_reason": self._why,
                                                      "finished": time.time()})
        if self._why in (stopping.CANCEL, stopping.REQUEUE):
            _log("job cancelled: every step stopped" if self._why == stopping.CANCEL else
                 "this attempt stopped for Slurm's requeue; the next resumes from the last complete checkpoint")
        elif rc != 0:
            first = message.splitlines()[0] if message else str(rc)
            _log(f"job failed: {first}")
            self._record("failed", first)
        return rc

    # -- why the job ends, when this step did not decide it

    def _record(self, status: str, reason: str) -> None:
        """The run manifest's status (ogrpo.launch.run_state), unless the trainer already wrote how it ended."""
        # CLI latency: `ogrpo plan`/`render` import this module, not this
        from ogrpo.launch.run_state import record_status

        record_status(layout.run_dir(self.spec.job_dir), status, reason)

    def _on_stop_signal(self, signum: int) -> None:
        """SIGTERM/SIGINT/SIGHUP to the batch step (runs in the signal handler). Slurm's SIGKILL follows after
        KillWait, possibly before the steps are down: free the ports and say why first."""
        release_ports(list(self._ports.values()))
        name = signal.Signals(signum).name
        why = stopping.sigterm_reason(layout.run_dir(self.spec.job_dir), self._started) \
            if signum == signal.SIGTERM else stopping.UNKNOWN
        self._why = why
        if why == stopping.CANCEL:
            _log(f"{name}: the job was cancelled; stopping every step")
            self._record("cancelled", "cancelled (scancel or ogrpo cancel)")
        elif why == stopping.REQUEUE:
            _log(f"{name}: Slurm is requeueing the job (scontrol requeue or a preemption); the trainer "
                 "checkpoints if it can, the next attempt resumes")
        elif why == stopping.STEPS and signum == signal.SIGTERM and not self._preempting:
            # `scancel -b --signal=TERM`, a site's warning: the job runs on and nobody will SIGKILL it, so the
            # trainer gets to save the step it is in, as on USR2, and the job requeues (ends the run by raising)
            _log(f"{name} to the batch step while the job runs on: the trainer checkpoints, then the job requeues")
            self._checkpoint_and_requeue(name)
        else:
            _log(f"{name}: {stopping.DESCRIBE[why] if why != stopping.UNKNOWN else 'stop'}; stopping every step")
            if why in (stopping.TIMEOUT, stopping.PREEMPT):
                self._record("failed", stopping.DESCRIBE[why])

    def _on_server_exit(self, server) -> None:
        """A server step ended mid-run. Of SIGTERM while the job runs on: the steps were signalled (`scancel
        --signal=TERM`, a site's warning), and the trainer, which got it too, is checkpointing: requeue as on
        USR2. Of SIGTERM because the job is ending (cancel, requeue, time limit): stop, not a server failure."""
        if server.proc.returncode != 128 + signal.SIGTERM or self._preempting:
            return
        why = stopping.sigterm_reason(layout.run_dir(self.spec.job_dir), self._started)
        if why in (stopping.STEPS, stopping.UNKNOWN):
            _log(f"the {server.name} step got SIGTERM while the job runs on: a signal to the job's steps "
                 "(scancel --signal=TERM), which the trainer got too")
            self._checkpoint_and_requeue("SIGTERM")
        self._why = why
        raise _Ended(128 + signal.SIGTERM, f"stopped: {stopping.DESCRIBE[why]}")

    def _request_stop(self, running) -> bool:
        if running.step.role == MAIN_ROLE:
            return False
        path = stop_file(self.spec.job_dir, running.step.role)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{time.time()}\n")
        return True

    def _on_usr2(self, signum, frame) -> None:
        if self._preempting:  # a second warning while the first is being handled
            return
        self._checkpoint_and_requeue("USR2")

    def _checkpoint_and_requeue(self, signal_name: str) -> None:
        """Have the trainer checkpoint and exit, stop the server, requeue (bounded); ends the run by raising."""
        trainer_rc = self.checkpoint(signal_name)
        if trainer_rc == 0 and self._preempted_marker() is None:
            _log("the trainer finished before the signal: nothing to resume")
            raise _Ended(0, "trainer finished")
        if not self._requeue_allowed(trainer_rc):
            self._record("failed", f"stopped for a requeue and not requeued ({_restarts()} requeues used)")
            raise _Ended(trainer_rc or 1, f"stopped on {signal_name} and not requeued ({_restarts()} "
                                          f"requeues used of {self.max_requeues}); resume by submitting the job "
                                          "again")
        out = subprocess.run(["scontrol", "requeue", str(self._job_id)], capture_output=True, text=True,
                             timeout=60)
        if out.returncode != 0:
            raise _Ended(1, f"scontrol requeue {self._job_id} failed: {out.stderr.strip()}")
        raise _Requeued()

    def checkpoint(self, signal_name: str = "USR2") -> int | None:
        """USR2 (time limit near, or preemption warning), or a SIGTERM to the steps: the trainer saves and exits,
        the server is stopped. Returns the trainer's exit code (None when it did not exit in time)."""
        self._preempting = True
        _log(f"{signal_name}: asking the trainer to checkpoint (attempt {_restarts()}, at most {self.max_requeues} "
             "requeues)")
        running = list(self._sup.running) if self._sup is not None else []
        trainer = next((r for r in running if r.step.role == MAIN_ROLE), None)
        trainer_rc = None
        if trainer is not None and trainer.alive:
            deadline = time.monotonic() + max(5, self.signal_delay_s - 10)
            while trainer_rc is None and time.monotonic() < deadline and self._sup.signalled is None:
                # the srun client forwards it to every trainer task. Again every few seconds: a trainer still
                # loading has no handler yet (USR2 is ignored until then) and would miss a single signal.
                os.killpg(trainer.proc.pid, signal.SIGUSR2)
                try:
                    trainer_rc = trainer.proc.wait(timeout=min(5.0, max(0.1, deadline - time.monotonic())))
                    _log(f"trainer exited with {trainer_rc}")
                except subprocess.TimeoutExpired:
                    pass
            if trainer_rc is None:
                _log("trainer did not exit in time; the last complete checkpoint will be used")
        elif trainer is not None:
            trainer_rc = trainer.proc.returncode
        if self._sup is not None:
            self._sup.ask_to_stop([r for r in running if r.step.role != MAIN_ROLE])  # ends COMPLETED
            self._sup.stop([r for r in running if not r.log_file.closed])
        return trainer_rc

    def _preempted_marker(self) -> dict | None:
        """The trainer's preempted.json (ogrpo.trainer.preemption) when written during this attempt. The exit
        code alone does not tell: `accelerate launch` turns the worker's EXIT_PREEMPTED into 1."""
        path = layout.preempted_file(self.spec.job_dir)
        try:
            if path.stat().st_mtime < self._started:
                return None
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def _requeue_allowed(self, trainer_rc: int | None) -> bool:
        """Bound the requeues (SLURM_RESTART_COUNT counts them) and record the decision in the run dir."""
        restarts = _restarts()
        requeue = restarts < self.max_requeues
        marker = self._preempted_marker() or {}
        _write_json(Path(self.spec.job_dir) / "slurm" / f"requeue-{restarts}.json", {
            "restart_count": restarts, "max_requeues": self.max_requeues, "trainer_rc": trainer_rc,
            "checkpoint": marker.get("checkpoint"), "signal": marker.get("signal"),
            "requeued": requeue, "time": time.time(),
        })
        if requeue:
            _log(f"requeueing (requeue {restarts + 1} of {self.max_requeues})")
        else:
            _log(f"not requeued: {restarts} requeues used of {self.max_requeues}")
        return requeue


# -------------------------------------------------------------------------------------- preflight, submit


def _run(cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return run_slurm(cmd, timeout)  # one line and exit 2 in seconds when Slurm cannot answer


def require_sbatch() -> None:
    for tool in ("sbatch", "srun", "squeue"):
        if shutil.which(tool) is None:
            raise OgrpoError(f"`{tool}` is not on PATH: run `ogrpo submit` on a Slurm login node, "
                             "or use --backend local to run on this machine")


def partitions() -> list[str]:
    out = _run(["sinfo", "-h", "-o", "%P"])
    if out.returncode != 0:
        raise OgrpoError(f"sinfo failed ({out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}): "
                         "check that this machine can reach slurmctld (SLURM_CONF)")
    return [p.strip().rstrip("*") for p in out.stdout.split() if p.strip()]


def max_gpus_per_node(partition: str | None) -> int | None:
    cmd = ["sinfo", "-h", "-N", "-o", "%G"] + (["-p", partition] if partition else [])
    out = _run(cmd)
    if out.returncode != 0:
        return None
    best = 0
    for gres in out.stdout.split():
        for item in gres.split(","):
            m = re.match(r"gpu(?::[^:(]+)?:(\d+)", item)
            if m:
                best = max(best, int(m.group(1)))
    return best


def min_cpus_per_node(partition: str | None) -> int | None:
    out = _run(["sinfo", "-h", "-N", "-o", "%c"] + (["-p", partition] if partition else []))
    vals = [int(v) for v in out.stdout.split() if v.isdigit()] if out.returncode == 0 else []
    return min(vals) if vals else None


def user_accounts() -> list[str] | None:
    """Accounts the user may charge, or None when accounting is not reachable (sbatch --test-only decides)."""
    if shutil.which("sacctmgr") is None:
        return None
    import getpass

    out = _run(["sacctmgr", "-nP", "show", "assoc", f"user={getpass.getuser()}", "format=account"])
    if out.returncode != 0:
        return None
    return sorted({a.strip() for a in out.stdout.split() if a.strip()})


def node_memory_mb(partition: str | None) -> list[int]:
    """RealMemory (MB) of each node of the partition (`sinfo -N -o %m`); empty when sinfo cannot tell."""
    out = _run(["sinfo", "-h", "-N", "-o", "%m"] + (["-p", partition] if partition else []))
    return [int(v) for v in out.stdout.split() if v.isdigit()] if out.returncode == 0 else []


def check_host_memory(spec: JobSpec, opts: SlurmOptions) -> None:
    """Refuse (exit 2) a job whose host-memory need is more than the partition's largest node has."""
    if opts.mem_per_gpu or any(k in opts.extra for k in ("mem", "mem-per-cpu", "mem-per-gpu")):
        return  # the site's own memory rule
    need = opts.mem_gib if opts.mem_gib is not None else job_mem_gib(spec)
    have = node_memory_mb(opts.partition)
    if not need or not have or need * 1024 <= max(have):
        return
    where = f"partition {opts.partition}" if opts.partition else "this cluster"
    parts = " + ".join(f"{s.role} {s.host_mem_gib:g} GiB" for s in spec.steps if s.host_mem_gib)
    raise OgrpoError(f"the plan needs {need} GiB of host RAM per node ({parts}) but nodes of {where} have at most "
                     f"{max(have) / 1024:.1f} GiB (sinfo -o %m: {max(have)} MB): use a partition with larger "
                     "nodes or fewer processes per node, or state the site's rule with --slurm mem=...")


def preflight(spec: JobSpec, opts: SlurmOptions) -> SlurmOptions:
    """Check the request against the cluster before anything is written or submitted, and fit the CPU request
    to the nodes when the site did not set one (ogrpo.cpus_per_gpu). Raises OgrpoError (exit 2) with the fix."""
    require_sbatch()
    parts = partitions()
    if opts.partition and opts.partition not in parts:
        raise OgrpoError(f"unknown partition {opts.partition!r}: use one of {', '.join(parts)} (sinfo -s)")
    if opts.account:
        accounts = user_accounts()
        if accounts is not None and opts.account not in accounts:
            raise OgrpoError(f"unknown account {opts.account!r} for this user: use one of "
                             f"{', '.join(accounts) or '(none)'} (sacctmgr show assoc user=$USER)")
    # CLI latency: `ogrpo plan`/`render` import this module, not this
    from ogrpo.launch.slurm.gres import check_gres_type

    check_gres_type(opts)  # a typed request (gpu:a40:3) on a partition without that type: name those with it
    have = max_gpus_per_node(opts.partition)
    if opts.gpus_per_node and have is not None and opts.gpus_per_node > have:
        where = f"partition {opts.partition}" if opts.partition else "this cluster"
        raise OgrpoError(f"{opts.gpus_per_node} GPUs per node requested but nodes of {where} have at most {have}: "
                         f"ask for fewer GPUs per node (--gpus {have}x...) or spread over more nodes (--nodes)")
    node_cpus = min_cpus_per_node(opts.partition)
    if node_cpus and not opts.cpus_from_config and (opts.cpus_per_task or 0) > node_cpus:
        # our default per GPU is a wish, not a need: smaller nodes get all their CPUs
        opts.cpus_per_task = max(node_cpus, len(spec.steps))
    check_host_memory(spec, opts)
    test = _run(["sbatch", "--test-only", *request_flags(spec, opts), "--wrap", "true"])
    if test.returncode != 0:
        msg = " ".join(line.strip() for line in test.stderr.strip().splitlines()[-2:]) or f"rc {test.returncode}"
        raise OgrpoError(f"Slurm would not accept this job ({msg}): check --partition/--account/--qos/--time and "
                         "that the GPU count fits the nodes (sinfo -o '%P %G %c %m')")
    return opts


@dataclass
class Submitted:
    job_id: str
    job_dir: str
    supervisor_log: str
    logs: dict[str, str]


def supervisor_log(job_dir: str | Path, job_id: str | int) -> Path:
    """Where the batch step's output goes (`#SBATCH --output`, ogrpo.launch.slurm.sbatch.directives)."""
    return layout.slurm_output(job_dir, job_id)


def submit(spec: JobSpec, *, script: str | None = None) -> Submitted:
    """`sbatch JOB_DIR/job.sbatch` (after `preflight`): the file `render` wrote, or `script` written there first
    (ogrpo.launch.executor.SlurmExecutor renders it for a job dir that has none). A job dir without manifest.json
    (a JobSpec built in code) gets jobspec.json, which the supervisor reads."""
    job_dir = Path(spec.job_dir)
    for sub in layout.JOB_SUBDIRS:
        (job_dir / sub).mkdir(parents=True, exist_ok=True)
    # CLI latency: `ogrpo plan`/`render` import this module, not this
    from ogrpo.launch import secret

    secret.ensure(job_dir)  # the job's key, before the job exists (its supervisor hands it to the steps)
    path = job_dir / layout.SBATCH
    if script is None and not path.exists():
        raise OgrpoError(f"{path} does not exist: render the job first (ogrpo render)")
    if script is not None:
        path.write_text(script)
        path.chmod(0o755)
    if not layout.job_manifest(job_dir).exists():
        _write_json(job_dir / layout.JOBSPEC, spec.to_dict())
    # OGRPO_PYTHON: this Python runs the supervisor (the script's default is python3 on PATH, which a user who
    # ran `.venv/bin/ogrpo submit` without activating the venv would not have); sbatch exports it to the job.
    env = {**os.environ, "OGRPO_PYTHON": sys.executable}

    out = run_slurm(["sbatch", "--parsable", str(path)], timeout=120, cwd=job_dir, env=env)
    if out.returncode != 0:
        raise OgrpoError(f"sbatch refused {path}: {_first_line(out.stderr) or out.returncode}")
    job_id = parsable_job_id(out.stdout)
    if job_id is None:
        raise LaunchError(f"sbatch printed no job id for {path}: {out.stdout.strip()!r}")
    (job_dir / "slurm" / "job_id").write_text(f"{job_id}\n")
    # CLI latency: `ogrpo plan`/`render` import this module, not this
    from ogrpo.launch.slurm.query import remember

    remember(job_id, job_dir)
    return Submitted(
        job_id=job_id,
        job_dir=str(job_dir),
        supervisor_log=str(supervisor_log(job_dir, job_id)),
        logs={s.role: str(layout.step_logs(job_dir) / f"{s.role}.log") for s in spec.steps},
    )


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


# ------------------------------------------------------------------------------- the wrapper inside a step


def _step_main(argv: list[str]) -> int:
    """`python -m ogrpo.launch.slurm step --role R --job-dir D [--ignore-usr2] [--stop-file F] -- CMD...`
    (inside srun): record the devices the step sees, then run CMD under ogrpo.launch.reaper, which keeps every
    process the command starts inside the step and returns once none is left."""
    import argparse

    # CLI latency: `ogrpo plan`/`render` import this module, not this
    from ogrpo.launch import reaper

    if "--" not in argv:
        raise SystemExit("usage: python -m ogrpo.launch.slurm step --role R --job-dir D [--ignore-usr2] "
                         "[--stop-file F] -- CMD")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="ogrpo.launch.slurm step")
    ap.add_argument("--role", required=True)
    ap.add_argument("--job-dir", required=True)
    ap.add_argument("--ignore-usr2", action="store_true")
    ap.add_argument("--stop-file", default=None)
    args = ap.parse_args(argv[:cut])
    cmd = fill(argv[cut + 1:], {"node_rank": os.environ.get("SLURM_NODEID", "0")})
    procid = int(os.environ.get("SLURM_PROCID", "0") or 0)
    run = reaper.Reaper(cmd, ignore_usr2=args.ignore_usr2, stop_file=args.stop_file)
    try:
        child = run.start()
    except OSError as exc:
        print(f"ogrpo: cannot run {cmd[0]}: {exc}", file=sys.stderr, flush=True)
        return 127
    record = {
        "role": args.role,
        "host": socket.gethostname(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_step_id": os.environ.get("SLURM_STEP_ID"),
        "slurm_procid": procid,
        "slurm_nodeid": os.environ.get("SLURM_NODEID"),
        "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        # the wrapper, and the process group of everything the command starts (`ogrpo cancel` checks both)
        "pid": os.getpid(),
        "pgid": child.pid,
        "boot_id": procs.boot_id(),
        "argv": cmd,
    }
    # <role>.json is the Supervisor's record (written from the batch step, which sees every device); this one
    # is written inside the step, so it shows the devices Slurm gave the step
    name = f"{args.role}.step.json" if procid == 0 else f"{args.role}.step{procid}.json"
    _write_json(layout.roles_dir(args.job_dir) / name, record)
    return run.wait()


def _supervise_main(argv: list[str]) -> int:
    """`python -m ogrpo.launch.slurm supervise JOB_DIR [--max-requeues N] [--signal-delay S] [--container IMAGE
    [--container-runtime R]]`: job.sbatch's body."""
    import argparse

    # CLI latency: `ogrpo plan`/`render` import this module, not this
    from ogrpo.launch.local import load_jobspec

    ap = argparse.ArgumentParser(prog="python -m ogrpo.launch.slurm supervise")
    ap.add_argument("job_dir")
    ap.add_argument("--max-requeues", type=int, default=3)
    ap.add_argument("--signal-delay", type=int, default=90)
    ap.add_argument("--container", default=None)
    ap.add_argument("--container-runtime", default=None)
    args = ap.parse_args(argv)
    try:
        if "SLURM_JOB_ID" not in os.environ:
            raise OgrpoError("the Slurm supervisor runs inside a Slurm job: `sbatch job.sbatch` or `ogrpo submit` "
                             "(to run the job here: ogrpo submit --backend local)")
        # manifest.json first: it is written with job.sbatch by render/submit (a jobspec.json may be left from a
        # local run of the same directory); jobspec.json for a JobSpec built in code (ogrpo.launch.slurm.submit)
        manifest = layout.job_manifest(args.job_dir)
        spec = load_jobspec(manifest if manifest.is_file() else args.job_dir)
        container = make_container(args.container, args.container_runtime, [spec.job_dir])
        sup = SlurmSupervisor(spec, max_requeues=args.max_requeues, signal_delay_s=args.signal_delay,
                              container=container)
        rc = sup.run()
    except OgrpoError as exc:
        print(f"ogrpo: {exc}", file=sys.stderr, flush=True)
        return getattr(exc, "exit_code", 2)
    return rc if 0 <= rc < 256 else 1
