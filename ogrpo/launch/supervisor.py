"""Run one job's steps as process groups: server and trainer side by side, health wait, watchdog, teardown.

Why a supervisor: the failure modes users hit most are jobs that never end (a script waits on a server that
never exits), servers that never come up, and trainers that hang on a dead server until the allocation runs
out. Here:
- the server and the trainer start together (the trainer's own start-up overlaps the server's ~30 s);
- the server must answer `GET /health` within `health_timeout_s`, else everything is stopped (exit 1);
- when the trainer ends, the server is torn down and the trainer's exit code is the job's;
- when the server dies, the trainer is stopped (SIGTERM to its process group, SIGKILL after `kill_grace_s`)
  and the job exits 1 with the server's log tail and path.

Backends plug in through hooks, so that local and Slurm runs share this logic:
- `wrap_step(step, argv) -> argv`: a launcher prefix; Slurm returns
  `["srun", "--exact", "--nodes", …, "--ntasks", …, "--gpus", …, *argv]`, local returns argv unchanged.
- `step_env(step) -> dict`: per-step environment (local: `CUDA_VISIBLE_DEVICES` from `step.gpus`).
- `on_signal(signum)`: called once, from the signal handler, when SIGTERM/SIGINT/SIGHUP arrives (Slurm: free
  the job's ports and record why, before KillWait's SIGKILL can cut the stop short); it may end the run itself
  by raising (Slurm: a SIGTERM to the batch step while the job runs on → the trainer checkpoints → requeue).
- `on_server_exit(running)`: called when a server step ends mid-run, before the trainer is stopped; it may end
  the run itself by raising (Slurm: a SIGTERM to the steps only → the trainer checkpoints → requeue).
- `request_stop(running) -> bool`: asks a server step to end normally once the trainer finished (Slurm: a stop
  file its step wrapper watches, so the step ends COMPLETED instead of CANCELLED); signals remain the fallback.
`values` fills the JobSpec placeholders `{server_host} {server_port} {rendezvous_host} {rendezvous_port}
{job_dir}` in argv and env.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, TextIO

from ogrpo import atomic_file, layout
from ogrpo.jobspec import JobSpec, Step
from ogrpo.launch import secret
from ogrpo.launch.procs import group_members
from ogrpo.placeholders import fill_text
LOG_TAIL_LINES = 30


def fill(text: str, values: dict[str, str]) -> str:
    """Replace the JobSpec placeholders only ({node_rank} stays for the Slurm step wrapper, which knows it)."""
    return fill_text(text, {k: v for k, v in values.items() if k != "node_rank"})


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def stated_error(path: Path) -> str | None:
    """The last `error: ...` line of a step's log: what an ogrpo entry point says when it refuses to run (a GPU
    plan on a node without CUDA, a server that serves another model). The lines after it (torch elastic's or
    accelerate's report of the child's exit code, their tracebacks) only repeat that the step failed."""
    lines = [ln for ln in log_tail(path, lines=10**6).splitlines() if ln.startswith("error: ")]
    return lines[-1].strip() if lines else None


def failure_summary(what: str, path: Path) -> str:
    """`what`, then the step's own one-line error when it stated one, else the last lines of its log."""
    line = stated_error(path)
    if line is not None:
        return f"{what}: {line} (log: {path})"
    return f"{what}; log: {path}\n--- last lines of {path} ---\n{log_tail(path)}"


def health_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class Running:
    step: Step
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen
    log_file: TextIO

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class JobResult:
    rc: int
    message: str
    logs: dict[str, str] = field(default_factory=dict)


class Supervisor:
    def __init__(
        self,
        jobspec: JobSpec,
        values: dict[str, str],
        *,
        wrap_step: Callable[[Step, list[str]], list[str]] | None = None,
        step_env: Callable[[Step], dict[str, str]] | None = None,
        log_dir: str | os.PathLike | None = None,
        health_timeout_s: float | None = None,
        kill_grace_s: float = 10.0,
        poll_s: float = 0.5,
        out: TextIO | None = None,
        follow: str | None = None,
        echo: BinaryIO | None = None,
        on_signal: Callable[[int], None] | None = None,
        on_server_exit: Callable[[Running], None] | None = None,
        request_stop: Callable[[Running], bool] | None = None,
    ):
        self.job = jobspec
        self.values = {k: str(v) for k, v in values.items()}
        self.values.setdefault("job_dir", str(jobspec.job_dir))

        # the job's key (JOB_DIR/job.key, 0600; a requeued attempt reads the same): to the steps' environment only
        self.key_env = {secret.KEY_ENV: secret.ensure(jobspec.job_dir)}
        self.wrap_step = wrap_step or (lambda step, argv: argv)
        self.step_env = step_env or (lambda step: {})
        self.log_dir = Path(log_dir or layout.step_logs(jobspec.job_dir))
        self.health_timeout_s = float(health_timeout_s if health_timeout_s is not None else jobspec.health_timeout_s)
        self.kill_grace_s = kill_grace_s
        self.poll_s = poll_s
        self.out = out or sys.stderr
        self.running: list[Running] = []
        self._stop_signal: int | None = None
        self._signal_seen = False
        # `follow`: a role whose log is also echoed live (the local backend shows the trainer's progress bar and
        # final profile table on the user's terminal; the log file stays the record).
        self.follow = follow
        self.echo = echo
        self._echo_pos: dict[str, int] = {}
        self.on_signal = on_signal
        self.on_server_exit = on_server_exit
        self.request_stop = request_stop

    # -- helpers ---------------------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        self.out.write(f"[ogrpo supervise] {text}\n")
        self.out.flush()

    @property
    def health_url(self) -> str | None:
        if self.job.step("server") is None:
            return None
        return f"http://{self.values['server_host']}:{self.values['server_port']}{self.job.health_path}"

    def _start(self, step: Step, index: int) -> Running:
        argv = self.wrap_step(step, [fill(a, self.values) for a in step.argv])
        env = dict(os.environ)
        env.update({k: fill(str(v), self.values) for k, v in self.job.env.items()})
        env.update({k: fill(str(v), self.values) for k, v in step.env.items()})
        env.update(self.step_env(step))
        env.update(self.key_env)
        # Steps name `ogrpo` / `accelerate` bare: find the ones of the environment the supervisor runs in, even
        # when that environment was never activated (cron, a test runner, `.venv/bin/ogrpo submit`).
        bindir = os.path.dirname(sys.executable)
        if bindir not in env.get("PATH", "").split(os.pathsep):
            env["PATH"] = os.pathsep.join(p for p in (bindir, env.get("PATH")) if p)
        same_role = [s for s in self.job.steps if s.role == step.role]
        name = step.role if len(same_role) == 1 else f"{step.role}{index}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        log_file = open(log_path, "ab", buffering=0)
        if step.role == self.follow:  # echoed: its own lines only (ogrpo/trainer/quiet.py); the log keeps everything
            layout.console_for(log_path).write_bytes(b"")
            env.update({layout.CONSOLE_ENV: str(layout.console_for(log_path)), layout.LOG_ENV: str(log_path)})
        # A new session per step: the whole tree (vLLM engine core, accelerate's workers) is one process group
        # that we can signal at once, and a Ctrl-C at the terminal reaches us, not the children directly.
        proc = subprocess.Popen(argv, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self._write_role(name, step, argv, env, proc.pid)
        self.say(f"{name}: pid {proc.pid}, log {log_path}")
        return Running(step, name, argv, log_path, proc, log_file)

    def _write_role(self, name: str, step: Step, argv: list[str], env: dict, pid: int) -> None:
        keys = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "NCCL_P2P_DISABLE", "SLURM_JOB_ID")
        # replaced whole: `ogrpo cancel` reads it to find the step's process group while the run starts
        atomic_file.write_json(self.log_dir.parent / layout.ROLES / f"{name}.json", {
            "role": step.role, "pid": pid, "argv": argv, "nodes": step.nodes, "gpus": step.gpus,
            "env": {k: env[k] for k in keys if k in env}})

    def _signal_group(self, r: Running, sig: int) -> None:
        try:
            os.killpg(r.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, procs: list[Running]) -> None:
        """SIGTERM each group, then SIGKILL whatever is left after kill_grace_s (also stray grandchildren)."""
        for r in procs:
            self._signal_group(r, signal.SIGTERM)
        deadline = time.monotonic() + self.kill_grace_s
        # the whole group, not only its leader: accelerate's one-process launcher dies of SIGTERM at once while
        # its worker is still finishing the step it was told to stop after
        while time.monotonic() < deadline and any(r.alive or group_members(r.proc.pid) for r in procs):
            time.sleep(0.1)
        for r in procs:
            # The leader may be gone while children (vLLM's engine core) still hold the group: kill the group.
            self._signal_group(r, signal.SIGKILL)
            try:
                r.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            r.log_file.close()
        # SIGKILLed orphans take a moment to die; the job returns only once every process of every step is gone.
        deadline = time.monotonic() + 10
        while any(group_members(r.proc.pid) for r in procs) and time.monotonic() < deadline:
            time.sleep(0.1)

    def _pump(self) -> None:
        if self.follow is None:
            return
        sink = self.echo or getattr(sys.stdout, "buffer", None)
        if sink is None:
            return
        for r in self.running:
            if r.step.role != self.follow:
                continue
            pos = self._echo_pos.get(r.name, 0)
            try:
                with open(layout.console_for(r.log_path), "rb") as f:
                    f.seek(pos)
                    chunk = f.read()
            except OSError:
                continue
            if chunk:
                self._echo_pos[r.name] = pos + len(chunk)
                sink.write(chunk)
                sink.flush()

    @property
    def signalled(self) -> int | None:
        """The signal (SIGTERM/SIGINT) that told this supervisor to stop, if any."""
        return self._stop_signal

    def stop_all(self) -> None:
        """Stop every step still running (for backends' signal paths, e.g. Slurm's USR2 checkpoint)."""
        self.stop([r for r in self.running if not r.log_file.closed])

    def _on_signal(self, signum, frame) -> None:
        first = not self._signal_seen
        self._signal_seen = True
        if first and self.on_signal is not None:
            # before the stop is recorded: the hook may take the signal over and end the run by raising (Slurm:
            # a SIGTERM while the job runs on checkpoints and requeues); a signal during the hook stops the job
            self.on_signal(signum)
        self._stop_signal = signum

    def ask_to_stop(self, procs: list[Running]) -> None:
        """The job is over: let the steps that take a stop request end by themselves (up to kill_grace_s)."""
        if self.request_stop is None:
            return
        asked = [r for r in procs if r.alive and self.request_stop(r)]
        deadline = time.monotonic() + self.kill_grace_s
        while any(r.alive for r in asked) and time.monotonic() < deadline:
            time.sleep(0.1)

    # -- the job ---------------------------------------------------------------------------------------------
    def run(self) -> JobResult:
        servers = [s for s in self.job.steps if s.role == "server"]
        workers = [s for s in self.job.steps if s.role != "server"]
        if not workers:
            return JobResult(2, "job has no trainer step")
        old = {}
        if _main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # HUP: the login shell went away
                old[sig] = signal.signal(sig, self._on_signal)
        try:
            return self._run(servers, workers)
        finally:
            self.stop([r for r in self.running if not r.log_file.closed])
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _run(self, servers: list[Step], workers: list[Step]) -> JobResult:
        srv = [self._start(s, i) for i, s in enumerate(servers)]
        self.running += srv
        # Trainers start right away: their imports and model load overlap the server's start-up, and TRL's
        # client waits for /health itself.
        trn = [self._start(s, i) for i, s in enumerate(workers)]
        self.running += trn
        logs = {r.name: str(r.log_path) for r in self.running}
        url = self.health_url
        healthy = url is None
        t0 = time.monotonic()
        while True:
            self._pump()
            if self._stop_signal is not None:
                name = signal.Signals(self._stop_signal).name
                self.say(f"received {name}: stopping all steps")
                self.stop(self.running)
                return JobResult(128 + self._stop_signal, f"stopped by {name}", logs)
            dead_server = next((r for r in srv if not r.alive), None)
            if dead_server is not None:
                rc = dead_server.proc.returncode
                if self.on_server_exit is not None and self._stop_signal is None:
                    self.on_server_exit(dead_server)
                self.stop([r for r in self.running if r is not dead_server])
                dead_server.log_file.close()
                msg = failure_summary(f"server exited with code {rc} "
                                      f"{'before becoming healthy' if not healthy else 'mid-run'}; trainer stopped",
                                      dead_server.log_path)
                self.say(msg)
                return JobResult(1, msg, logs)
            if all(not r.alive for r in trn):
                self._pump()
                codes = {r.name: r.proc.returncode for r in trn}
                self.ask_to_stop(srv)
                # the trainer's own group too: a rank that outlived accelerate's launcher must not outlive the job
                self.stop(srv + trn)
                bad = {n: c for n, c in codes.items() if c != 0}
                if bad:
                    first = next(r for r in trn if r.name in bad)
                    msg = failure_summary(f"trainer exited with code {first.proc.returncode}", first.log_path)
                    self.say(msg)
                    return JobResult(first.proc.returncode or 1, msg, logs)
                self.say("trainer finished; server stopped" if srv else "trainer finished")
                return JobResult(0, "trainer finished", logs)
            if not healthy:
                if health_ok(url):
                    healthy = True
                    self.say(f"server healthy at {url} after {time.monotonic() - t0:.1f} s")
                elif time.monotonic() - t0 > self.health_timeout_s:
                    self.stop(self.running)
                    log = srv[0].log_path if srv else "?"
                    msg = (f"server not healthy at {url} after {self.health_timeout_s:.0f} s; all steps stopped. "
                           f"Server log: {log}\n--- last lines of {log} ---\n{log_tail(Path(log))}")
                    self.say(msg)
                    return JobResult(1, msg, logs)
            time.sleep(self.poll_s)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
