"""Run a step's command so that none of its processes can outlive the step or escape the scheduler.

`accelerate launch` with one process dies of SIGTERM at once, while its worker (which checkpoints on SIGTERM)
lives on: reparented to PID 1, it leaves the tree Slurm's proctrack/linuxproc follows, and the SIGKILL after
KillWait never reaches it. Here the command runs under a child subreaper (PR_SET_CHILD_SUBREAPER): orphans
become our children instead, stay inside the step, and are waited for. The wrapper itself survives the step's
signals (Slurm delivers them to every process of the step, so it forwards none: a second SIGTERM would cut
torch's elastic agent's own graceful shutdown short) and returns only when no descendant is left.
The command gets PR_SET_PDEATHSIG(SIGKILL), so killing the wrapper takes its launcher down too.

After the command's own process exits, descendants that remain are:
- workers still finishing on a signal the step received (a checkpoint): waited for; the scheduler bounds that;
- strays of a command that ended by itself (a daemon it left behind): SIGTERM, then SIGKILL after `grace_s`.

`stop_file` (a step that has no end of its own, the server): when it appears, the command is asked to stop (SIGTERM to its tree, SIGKILL after `grace_s`) and
the wrapper exits 0: the job ended normally and this step is no longer needed (e.g. the vLLM server once the
trainer finished), which Slurm then records as COMPLETED rather than CANCELLED. Such a step that exits 0 on a
signal instead (vLLM on SIGTERM) reports 128 + the signal: it was stopped, it did not finish.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ogrpo.launch.procs import descendants

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
POLL_S = 0.2


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


class Reaper:
    def __init__(self, cmd: list[str], *, ignore_usr2: bool = True, stop_file: str | None = None,
                 grace_s: float = 10.0):
        self.cmd = cmd
        self.ignore_usr2 = ignore_usr2
        self.stop_file = Path(stop_file) if stop_file else None
        self.grace_s = grace_s
        self.signalled: int | None = None
        self.started = time.time()
        self.child: subprocess.Popen | None = None

    def _on_signal(self, signum, frame) -> None:
        self.signalled = self.signalled or signum

    def _preexec(self) -> None:
        # in the child, before exec: die with the wrapper; its USR2 disposition (ignored for roles that would
        # die of it: the supervisor's USR2 reaches every process of the step)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        signal.signal(signal.SIGUSR2, signal.SIG_IGN if self.ignore_usr2 else signal.SIG_DFL)

    def start(self) -> subprocess.Popen:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        sys.stdout.flush()
        # own process group: the launcher and its workers can be signalled as one
        self.child = subprocess.Popen(self.cmd, preexec_fn=self._preexec, process_group=0)
        return self.child

    def _stop_requested(self) -> bool:
        if self.stop_file is None:
            return False
        try:
            return self.stop_file.stat().st_mtime >= self.started - 1.0
        except OSError:
            return False

    def wait(self) -> int:
        """Reap every descendant; the command's exit code (128 + N when signal N killed it; 0 after a stop
        request)."""
        assert self.child is not None
        me = os.getpid()
        child_rc: int | None = None
        kill_at: float | None = None  # when strays get SIGKILL
        stopping = False
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break  # nothing left under us
            if pid:
                if pid == self.child.pid:
                    child_rc = os.waitstatus_to_exitcode(status)
                    self.child.returncode = child_rc
                    if child_rc >= 0 and self.signalled is None and not stopping and descendants(me):
                        # ended by itself and left processes behind: they are strays, not workers finishing
                        _signal_all(descendants(me), signal.SIGTERM)
                        kill_at = time.monotonic() + self.grace_s
                continue
            if not stopping and self._stop_requested():
                stopping = True
                _signal_all(descendants(me), signal.SIGTERM)
                kill_at = time.monotonic() + self.grace_s
            if kill_at is not None and time.monotonic() > kill_at:
                _signal_all(descendants(me), signal.SIGKILL)
                kill_at = time.monotonic() + self.grace_s
            time.sleep(POLL_S)
        if stopping:
            return 0
        if child_rc is None:
            return 1
        if child_rc == 0 and self.signalled is not None and self.stop_file is not None:
            # a step that ends only when asked (the server) exited 0 on a signal (vLLM does on SIGTERM): report
            # the signal, so that the supervisor sees the job's stop, not a server that finished by itself
            return 128 + self.signalled
        return 128 - child_rc if child_rc < 0 else child_rc


def run(cmd: list[str], **kwargs) -> int:
    reaper = Reaper(cmd, **kwargs)
    try:
        reaper.start()
    except OSError as exc:
        print(f"ogrpo: cannot run {cmd[0]}: {exc}", file=sys.stderr, flush=True)
        return 127
    return reaper.wait()
