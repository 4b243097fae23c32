"""Slurm backend: one submitit job whose batch step runs a supervisor that starts one `srun --exact` step per role.

submitit cannot express heterogeneous jobs (submitit #1741), so the job asks for the whole allocation and the
submitted function runs once, in the batch step (`use_srun=False`), as a supervisor: the shared
`ogrpo.launch.supervisor.Supervisor` (health wait, watchdog, teardown), with each step's command wrapped in
`srun --exact` and its own GPU count, so Slurm hands each step disjoint devices and sets CUDA_VISIBLE_DEVICES.

Signals: the job asks for `--signal=B:USR2@delay`, i.e. only the batch step is warned before the time limit.
The batch shell `exec`s python, so submitit's handler receives it and calls `SlurmSupervisor.checkpoint()`,
which forwards USR2 to the trainer step only (vLLM would die of it), waits for the trainer to save a
checkpoint and exit, stops the server, and returns itself for submitit to requeue — at most `max_requeues`
times (SLURM_RESTART_COUNT counts them). A forced requeue or a preemption (SIGTERM to every step) needs no
help: the trainer saves at the end of its step if it can, and Slurm requeues. Either way the requeued job
restarts every step and the trainer resumes with `--resume auto` from the last complete checkpoint.

Module import is cheap (no submitit): the same file is the per-step wrapper that runs inside each srun step
(`python -m ogrpo.launch.slurm step ...`), recording which devices the step saw before exec'ing its command.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ogrpo.errors import LaunchError, OgrpoError
from ogrpo.jobspec import JobSpec, Step, fill, slurm_ports
from ogrpo.launch.containers import Container, wrap

# Slurm checks time limits every 30 s (PERIODIC_TIMEOUT) and sends the warning when the end is within
# delay + 30 s, so it comes 0-30 s earlier than asked; a delay under 30 s could come too late.
MIN_SIGNAL_DELAY_S = 30
# The step whose end ends the job, and the one that checkpoints on the preemption signal.
MAIN_ROLE = "trainer"
# A step's processes all receive the USR2 that srun forwards. vLLM and the accelerate/torchrun launcher would
# die of it, so every step starts with USR2 ignored; only the trainer workers install a handler
# (ogrpo.train.preemption), which replaces the inherited SIG_IGN.
IGNORE_USR2_ROLES = ("server", "trainer")
# The run dir (TRL output_dir) inside the job dir, as build_jobspec writes it: logs/ and roles/ live there.
RUN_SUBDIR = "run"


@dataclass
class SlurmOptions:
    partition: str | None = None
    time_min: int = 60
    account: str | None = None
    qos: str | None = None
    nodes: int | None = None  # None: the plan's node count
    gpus_per_node: int = 0
    cpus_per_task: int | None = None  # CPUs of the whole allocation per node (one batch task per node)
    extra: dict[str, object] = field(default_factory=dict)  # `--slurm KEY=VALUE`, written as `#SBATCH --KEY=VALUE`
    signal_delay_s: int = 90
    max_requeues: int = 3
    container: Container | None = None
    job_name: str = "ogrpo"


# ----------------------------------------------------------------------------------------------- parsing


_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time(text: str | int) -> int:
    """Slurm time formats (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) → whole minutes (rounded up)."""
    text = str(text).strip()
    m = _TIME_RE.match(text)
    if not m:
        raise OgrpoError(f"--time {text!r} is not a Slurm time: use minutes (90), HH:MM:SS (01:30:00) or D-HH:MM")
    days, a, b, c = m.groups()
    a, b, c = int(a), int(b or 0), int(c or 0)
    if days is not None:  # D-HH[:MM[:SS]]
        secs = int(days) * 86400 + a * 3600 + b * 60 + c
    elif c or text.count(":") == 2:  # HH:MM:SS
        secs = a * 3600 + b * 60 + c
    else:  # MM[:SS]
        secs = a * 60 + b
    if secs <= 0:
        raise OgrpoError(f"--time {text!r} must be positive")
    return -(-secs // 60)


def parse_passthrough(items: list[str] | None) -> dict[str, object]:
    """`--slurm KEY=VALUE` (repeatable; `--slurm exclusive` for a bare flag) → sbatch options."""
    out: dict[str, object] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-")
        if not key or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", key):
            raise OgrpoError(f"--slurm {item!r}: expected KEY=VALUE with an sbatch option name, e.g. --slurm mem=64G")
        out[key.replace("_", "-")] = value if sep else True
    return out


# ------------------------------------------------------------------------------------ job-level parameters


def options_for(plan: dict, run_config, *, nodes: int | None = None, time_min: int | None = None,
                extra: dict | None = None, signal_delay_s: int = 90, max_requeues: int = 3,
                container: Container | None = None, job_name: str = "ogrpo") -> SlurmOptions:
    """SlurmOptions for a plan (dict) and run config: the same sources `ogrpo render` writes into job.sbatch
    (cluster shape, ogrpo.partition/account/qos/time/mem_per_gpu), with command-line values already merged
    into the run config's ogrpo section."""
    o = run_config.ogrpo
    cl = plan["cluster"]
    is_cpu = bool(cl["gpu"].get("is_cpu"))
    extra = dict(extra or {})
    if o.mem_per_gpu and "mem-per-gpu" not in extra:
        extra["mem-per-gpu"] = o.mem_per_gpu
    gpn = 0 if is_cpu else int(cl["gpus_per_node"])
    cpus = None
    if o.cpus_per_gpu:  # the site said how many CPUs go with a GPU; else preflight sizes it from sinfo
        cpus = int(o.cpus_per_gpu) * max(1, gpn)
    if time_min is None and o.time:
        time_min = parse_time(o.time)
    return SlurmOptions(
        partition=o.partition, time_min=time_min or 60, account=o.account, qos=o.qos,
        nodes=nodes or int(cl["nodes"]), gpus_per_node=gpn, cpus_per_task=cpus, extra=extra,
        signal_delay_s=signal_delay_s, max_requeues=max_requeues, container=container, job_name=job_name,
    )


def executor_parameters(spec: JobSpec, opts: SlurmOptions) -> dict:
    """The keyword arguments for `submitit.SlurmExecutor.update_parameters` (pure)."""
    nodes = opts.nodes or job_nodes(spec)
    params: dict = {
        "job_name": opts.job_name,
        "time": opts.time_min,
        "nodes": nodes,
        "ntasks_per_node": 1,
        "use_srun": False,
        "stderr_to_stdout": True,
        "signal_delay_s": max(MIN_SIGNAL_DELAY_S, int(opts.signal_delay_s)),
        "wckey": "ogrpo",
    }
    if opts.gpus_per_node:
        params["gpus_per_node"] = opts.gpus_per_node
    if opts.cpus_per_task:
        params["cpus_per_task"] = opts.cpus_per_task
    for key in ("partition", "account", "qos"):
        if getattr(opts, key):
            params[key] = getattr(opts, key)
    extra: dict[str, object] = {
        # B: warn the batch step only (see module docstring); submitit writes USR2@delay, this overrides it
        "signal": f"B:USR2@{params['signal_delay_s']}",
        "requeue": True,
        "chdir": spec.job_dir,
    }
    for key, value in opts.extra.items():
        name = key.replace("-", "_")
        if name in params and name not in ("use_srun", "stderr_to_stdout", "signal_delay_s"):
            # `--slurm time=..`/`nodes=..`/`cpus-per-task=..` replace ours rather than add a second #SBATCH line
            params[name] = parse_time(value) if name == "time" else value
        else:
            extra[key] = value
    if ("gres" in extra or "gpus" in extra) and "gpus_per_node" in params:
        del params["gpus_per_node"]  # a site that names its GRES type (gpu:a40:3) says it that way
    params["additional_parameters"] = extra
    return params


def job_nodes(spec: JobSpec) -> int:
    return max((n for s in spec.steps for n in s.nodes), default=0) + 1


def sbatch_text(spec: JobSpec, opts: SlurmOptions, folder: str | Path) -> str:
    """The sbatch file submitit will write for this job (for --dry-run and the render/submit agreement test)."""
    from submitit.slurm.slurm import _make_sbatch_string  # no public renderer (anchors.md)

    command = f"exec {shlex.quote(sys.executable)} -u -m submitit.core._submit {shlex.quote(str(folder))}"
    return _make_sbatch_string(command=command, folder=folder, **executor_parameters(spec, opts))


# ------------------------------------------------------------------------------------------ step commands


def step_resources(steps: list[Step], cpus_per_node: int, mem_mb_per_node: int | None) -> dict[str, tuple[int, int | None]]:
    """Split the allocation's CPUs (and memory, when the job asked for some) between steps that share a node,
    in proportion to their GPUs, so that `--exact` steps can all start. role → (cpus per task, mem MB)."""
    weight = {s.role: max(1, len(s.gpus)) for s in steps}
    out: dict[str, tuple[int, int | None]] = {}
    for s in steps:
        sharing = [t for t in steps if set(t.nodes) & set(s.nodes)]
        total_w = sum(weight[t.role] for t in sharing)
        tasks_per_node = max(1, -(-s.ntasks // max(1, len(s.nodes))))
        cpus = max(1, cpus_per_node * weight[s.role] // total_w // tasks_per_node)
        mem = None if not mem_mb_per_node else max(256, mem_mb_per_node * weight[s.role] // total_w)
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
    extra_srun, cmd = wrap(container, [*wrapper, "--", *fill(step.argv if argv is None else argv, values)])
    return [*srun, *extra_srun, *cmd]


def placeholder_values(spec: JobSpec, hosts: list[str], job_id: int) -> dict[str, object]:
    server_port, rdzv_port = slurm_ports(job_id)
    server = spec.step("server")
    trainer = spec.step(MAIN_ROLE) or spec.steps[-1]
    return {
        "server_host": hosts[server.nodes[0]] if server else hosts[0],
        "server_port": server_port,
        "rendezvous_host": hosts[trainer.nodes[0]],
        "rendezvous_port": rdzv_port,
        "job_dir": spec.job_dir,
    }


# -------------------------------------------------------------------------------- the in-job supervisor


def _hostnames() -> list[str]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
    if not nodelist:
        return [socket.gethostname()]
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()


def _log(msg: str) -> None:
    print(f"[ogrpo supervisor {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


class SlurmSupervisor:
    """The function submitit runs once in the batch step (submitit calls `checkpoint` on USR2).

    The step sequencing, health wait, watchdog and teardown are the shared `ogrpo.launch.supervisor.Supervisor`;
    this backend only wraps each step in `srun` and adds the preemption path."""

    def __init__(self, spec: JobSpec, opts: SlurmOptions):
        self.spec = spec
        self.opts = opts
        self._sup = None  # the running Supervisor (in the batch step only)
        self._preempting = False

    def __getstate__(self):  # submitit pickles us at submit and at checkpoint; processes do not travel
        return {"spec": self.spec, "opts": self.opts}

    def __setstate__(self, state):
        self.__init__(state["spec"], state["opts"])

    # -- planning inside the allocation
    def wrapper(self, hosts: list[str], job_id: int, cpus_per_node: int, mem_mb: int | None):
        """(placeholder values, wrap_step hook) for this allocation."""
        values = placeholder_values(self.spec, hosts, job_id)
        res = step_resources(self.spec.steps, cpus_per_node, mem_mb)

        def wrap_step(step: Step, argv: list[str]) -> list[str]:
            return srun_argv(step, job_dir=self.spec.job_dir, hosts=hosts, values=values, cpus=res[step.role][0],
                             mem_mb=res[step.role][1], container=self.opts.container, argv=argv)

        return values, wrap_step

    def commands(self, hosts: list[str], job_id: int, cpus_per_node: int, mem_mb: int | None) -> dict[str, list[str]]:
        values, wrap_step = self.wrapper(hosts, job_id, cpus_per_node, mem_mb)
        return {s.role: wrap_step(s, fill(s.argv, values)) for s in self.spec.steps}

    def __call__(self) -> dict:
        from ogrpo.launch.supervisor import Supervisor

        job_id = int(os.environ["SLURM_JOB_ID"])
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        hosts = _hostnames()
        cpus = int(os.environ.get("SLURM_CPUS_PER_TASK") or os.environ.get("SLURM_CPUS_ON_NODE") or 1)
        mem = int(os.environ["SLURM_MEM_PER_NODE"]) if os.environ.get("SLURM_MEM_PER_NODE") else None
        job_dir = Path(self.spec.job_dir)
        (job_dir / "slurm").mkdir(parents=True, exist_ok=True)
        values, wrap_step = self.wrapper(hosts, job_id, cpus, mem)
        _write_json(job_dir / "slurm" / f"attempt-{restarts}.json", {
            "job_id": job_id, "restart_count": restarts, "hosts": hosts, "started": time.time(),
            "ports": {"server": values["server_port"], "rendezvous": values["rendezvous_port"]},
            "commands": self.commands(hosts, job_id, cpus, mem),
        })
        _log(f"job {job_id} attempt {restarts} on {','.join(hosts)}")
        self._sup = Supervisor(self.spec, {k: str(v) for k, v in values.items()}, wrap_step=wrap_step,
                               log_dir=job_dir / RUN_SUBDIR / "logs", out=sys.stdout)
        self._started = time.time()
        result = self._sup.run()
        rc = result.rc
        if (rc != 0 and not self._preempting and self._sup.signalled is None
                and self._preempted_marker() is not None):
            # The trainer saved on a signal that reached the steps but not this batch step (a site that signals
            # the steps only): requeue. When this step was signalled too, Slurm decides: `scontrol requeue` and
            # preemption requeue by themselves, and `scancel` (state COMPLETING while the signals arrive, so it
            # cannot be told apart here) must not be undone by a requeue.
            if self._requeue_allowed(rc):
                subprocess.run(["scontrol", "requeue", str(job_id)], check=False)
                time.sleep(120)  # Slurm kills this batch step as part of the requeue
        _write_json(job_dir / "slurm" / "result.json", {"job_id": job_id, "restart_count": restarts, "rc": rc,
                                                      "message": result.message, "finished": time.time()})
        if rc != 0:
            raise LaunchError(result.message.splitlines()[0] if result.message else f"job failed with {rc}")
        return {"job_id": job_id, "restarts": restarts, "rc": rc}

    def checkpoint(self):
        """submitit calls this on USR2 (time limit near, or preemption warning); returning self requeues."""
        self._preempting = True
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        _log(f"USR2: asking the trainer to checkpoint (attempt {restarts}, at most {self.opts.max_requeues} requeues)")
        running = list(self._sup.running) if self._sup is not None else []
        trainer = next((r for r in running if r.step.role == MAIN_ROLE), None)
        trainer_rc = None
        if trainer is not None and trainer.alive:
            deadline = time.monotonic() + max(5, self.opts.signal_delay_s - 10)
            while trainer_rc is None and time.monotonic() < deadline:
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
            self._sup.stop([r for r in running if not r.log_file.closed])
        if trainer_rc == 0 and self._preempted_marker() is None:
            _log("the trainer finished before the signal: nothing to resume")
            return None
        if not self._requeue_allowed(trainer_rc):
            return None
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self)

    def _preempted_marker(self) -> dict | None:
        """The trainer's preempted.json (ogrpo.train.preemption) when written during this attempt. The exit
        code alone does not tell: `accelerate launch` turns the worker's EXIT_PREEMPTED into 1."""
        path = Path(self.spec.job_dir) / RUN_SUBDIR / "preempted.json"
        try:
            if path.stat().st_mtime < getattr(self, "_started", 0):
                return None
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def _requeue_allowed(self, trainer_rc: int | None) -> bool:
        """Bound the requeues (SLURM_RESTART_COUNT counts them) and record the decision in the run dir."""
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
        requeue = restarts < self.opts.max_requeues
        marker = self._preempted_marker() or {}
        _write_json(Path(self.spec.job_dir) / "slurm" / f"requeue-{restarts}.json", {
            "restart_count": restarts, "max_requeues": self.opts.max_requeues, "trainer_rc": trainer_rc,
            "checkpoint": marker.get("checkpoint"), "signal": marker.get("signal"),
            "requeued": requeue, "time": time.time(),
        })
        if requeue:
            _log(f"requeueing (requeue {restarts + 1} of {self.opts.max_requeues})")
        else:
            _log(f"not requeued: {restarts} requeues used of {self.opts.max_requeues}")
        return requeue


# -------------------------------------------------------------------------------------- preflight, submit


def _run(cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


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


def test_only_args(params: dict) -> list[str]:
    """sbatch flags for `sbatch --test-only`, from the executor parameters (resources only)."""
    flags = {
        "partition": params.get("partition"), "account": params.get("account"), "qos": params.get("qos"),
        "time": params.get("time"), "nodes": params.get("nodes"), "ntasks-per-node": params.get("ntasks_per_node"),
        "gpus-per-node": params.get("gpus_per_node"), "cpus-per-task": params.get("cpus_per_task"),
    }
    skip = {"signal", "requeue", "chdir", "output", "error", "open-mode", "job-name"}
    for k, v in params.get("additional_parameters", {}).items():
        if k not in skip:
            flags[k] = v
    out = []
    for k, v in flags.items():
        if v is None or v is False:
            continue
        out.append(f"--{k}" if v is True else f"--{k}={v}")
    return out


def preflight(spec: JobSpec, opts: SlurmOptions) -> dict:
    """Check the request against the cluster before anything is submitted; fill in CPUs. Returns executor
    parameters. Raises OgrpoError (exit 2) with the fix."""
    require_sbatch()
    parts = partitions()
    if opts.partition and opts.partition not in parts:
        raise OgrpoError(f"unknown partition {opts.partition!r}: use one of {', '.join(parts)} (sinfo -s)")
    if opts.account:
        accounts = user_accounts()
        if accounts is not None and opts.account not in accounts:
            raise OgrpoError(f"unknown account {opts.account!r} for this user: use one of "
                             f"{', '.join(accounts) or '(none)'} (sacctmgr show assoc user=$USER)")
    have = max_gpus_per_node(opts.partition)
    if opts.gpus_per_node and have is not None and opts.gpus_per_node > have:
        where = f"partition {opts.partition}" if opts.partition else "this cluster"
        raise OgrpoError(f"{opts.gpus_per_node} GPUs per node requested but nodes of {where} have at most {have}: "
                         f"ask for fewer GPUs per node (--gpus {have}x...) or spread over more nodes (--nodes)")
    if opts.cpus_per_task is None:
        node_cpus = min_cpus_per_node(opts.partition) or len(spec.steps)
        # enough CPUs for every step to start next to the others (`--exact` steps do not share CPUs)
        opts.cpus_per_task = min(node_cpus, max(len(spec.steps), 4 * max(1, opts.gpus_per_node)))
    params = executor_parameters(spec, opts)
    test = _run(["sbatch", "--test-only", *test_only_args(params), "--wrap", "true"])
    if test.returncode != 0:
        msg = " ".join(line.strip() for line in test.stderr.strip().splitlines()[-2:]) or f"rc {test.returncode}"
        raise OgrpoError(f"Slurm would not accept this job ({msg}): check --partition/--account/--qos/--time and "
                         "that the GPU count fits the nodes (sinfo -o '%P %G %c %m')")
    return params


@dataclass
class Submitted:
    job_id: str
    job_dir: str
    supervisor_log: str
    logs: dict[str, str]


def submit(spec: JobSpec, opts: SlurmOptions, params: dict | None = None) -> Submitted:
    """Submit the job (after `preflight`). The submitit folder lives in the job dir."""
    import submitit

    params = params or executor_parameters(spec, opts)
    job_dir = Path(spec.job_dir)
    for sub in ("slurm", "submitit", f"{RUN_SUBDIR}/logs", f"{RUN_SUBDIR}/roles"):
        (job_dir / sub).mkdir(parents=True, exist_ok=True)
    # `exec`: python replaces the batch shell, so the B:USR2 warning reaches submitit's handler
    executor = submitit.SlurmExecutor(folder=job_dir / "submitit", max_num_timeout=opts.max_requeues,
                                      python="exec " + shlex.quote(sys.executable))
    executor.update_parameters(**params)
    job = executor.submit(SlurmSupervisor(spec, opts))
    (job_dir / "slurm" / "job_id").write_text(f"{job.job_id}\n")
    from ogrpo.launch.slurm_query import remember

    remember(job.job_id, job_dir)
    return Submitted(
        job_id=str(job.job_id),
        job_dir=str(job_dir),
        supervisor_log=str(job.paths.stdout),
        logs={s.role: str(job_dir / RUN_SUBDIR / "logs" / f"{s.role}.log") for s in spec.steps},
    )


# ------------------------------------------------------------------------------- the wrapper inside a step


def _step_main(argv: list[str]) -> None:
    """`python -m ogrpo.launch.slurm step --role R --job-dir D [--ignore-usr2] -- CMD...` (inside srun)."""
    import argparse

    if "--" not in argv:
        raise SystemExit("usage: python -m ogrpo.launch.slurm step --role R --job-dir D [--ignore-usr2] -- CMD")
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="ogrpo.launch.slurm step")
    ap.add_argument("--role", required=True)
    ap.add_argument("--job-dir", required=True)
    ap.add_argument("--ignore-usr2", action="store_true")
    args = ap.parse_args(argv[:cut])
    cmd = argv[cut + 1:]
    procid = int(os.environ.get("SLURM_PROCID", "0") or 0)
    record = {
        "role": args.role,
        "host": socket.gethostname(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_step_id": os.environ.get("SLURM_STEP_ID"),
        "slurm_procid": procid,
        "slurm_nodeid": os.environ.get("SLURM_NODEID"),
        "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "pid": os.getpid(),
        "argv": cmd,
    }
    # <role>.json is the Supervisor's record (written from the batch step, which sees every device); this one
    # is written inside the step, so it shows the devices Slurm gave the step
    name = f"{args.role}.step.json" if procid == 0 else f"{args.role}.step{procid}.json"
    _write_json(Path(args.job_dir) / RUN_SUBDIR / "roles" / name, record)
    cmd = fill(cmd, {"node_rank": os.environ.get("SLURM_NODEID", "0")})
    if args.ignore_usr2:
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # SIG_IGN survives exec
    sys.stdout.flush()
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "step":
        _step_main(sys.argv[2:])
    else:
        raise SystemExit("usage: python -m ogrpo.launch.slurm step --role R --job-dir D [--ignore-usr2] -- CMD")
