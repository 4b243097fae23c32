"""One handle for a job, whatever runs it: `status()`, `logs()`, `cancel()`, `wait()`.

Like submitit's Job: an executor (ogrpo.launch.executor) submits a JobSpec and returns a handle; `find(ref)` there
gets the same handle back later from a run directory (or a Slurm job id), so `ogrpo status/logs/cancel` need not
know the backend. Handles: ogrpo.launch.local (LocalJob: a supervisor process on this machine, its state in
JOB_DIR/local/) and ogrpo.launch.slurm.query (SlurmJob: submitit's, its id in JOB_DIR/slurm/job_id). This module
imports neither: it is the interface they implement.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable

from ogrpo.errors import OgrpoError

# States a job ends in (Slurm's names; LOST: a local supervisor that vanished without recording how it ended).
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
                   "BOOT_FAIL", "DEADLINE", "LOST"})


class Job(ABC):
    """A submitted job. `job_dir` is None for a Slurm job whose run directory cannot be found."""

    backend: str
    job_id: str
    job_dir: Path | None

    @abstractmethod
    def state(self) -> str:
        """RUNNING, PENDING, ... or one of ENDED."""

    @abstractmethod
    def status(self) -> dict:
        """What `ogrpo status --json` prints: at least job_id, backend and state."""

    @abstractmethod
    def log_files(self, role: str | None = None) -> list[Path]:
        """The supervisor's log and the steps' logs (one role's when given)."""

    @abstractmethod
    def cancel(self, wait_s: float | None = None) -> None:
        """Stop the job and return once none of its processes is left (OgrpoError when it already ended,
        LaunchError naming the survivors when some are still alive after a bounded wait); the run's manifest
        then says `cancelled`."""

    def done(self) -> bool:
        return self.state() in ENDED

    def wait(self, timeout_s: float | None = None, poll_s: float = 1.0) -> str:
        """Block until the job ends; its final state. OgrpoError when `timeout_s` passes first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            state = self.state()
            if state in ENDED:
                return state
            if deadline is not None and time.monotonic() > deadline:
                raise OgrpoError(f"job {self.job_id} still {state} after {timeout_s:.0f} s")
            time.sleep(poll_s)

    def logs(self, role: str | None = None, follow: bool = False, write: Callable[[str], None] | None = None,
             poll_s: float = 1.0) -> None:
        """Print the logs (each file under a header when there are several); with follow, keep printing new
        lines until the job ends."""
        write = write or (lambda text: print(text, end="", flush=True))
        files = self.log_files(role)
        offsets = {f: 0 for f in files}
        multi = len(files) > 1

        def drain() -> None:
            for f in files:
                if not f.exists():
                    continue
                with f.open("r", errors="replace") as fh:
                    fh.seek(offsets[f])
                    text = fh.read()
                    offsets[f] = fh.tell()
                if text:
                    if multi:
                        write(f"==> {f} <==\n")
                    write(text)

        drain()
        if not follow:
            if not any(f.exists() for f in files):
                raise OgrpoError(f"no logs yet for job {self.job_id} ({', '.join(str(f) for f in files)}): "
                                 "the job may still be pending (ogrpo status)")
            return
        while not self.done():
            time.sleep(poll_s)
            drain()
        drain()
