"""A local run's record, JOB_DIR/local/state.json, and the process checks that tell a live run from a dead one.

The run's own process writes the record: RUNNING with its pid when it starts, the final state and exit code when
it ends. A run killed with SIGKILL (or a reboot) never writes the end, so a RUNNING record is trusted only while
its pid is alive *and* is the same process (its start time matches: pids are reused).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

from ogrpo import atomic_file

STATE_FILE = "local/state.json"
# Exit codes of a run stopped by a signal a user sends to stop it (Ctrl-C, `ogrpo cancel`, a closed terminal)
CANCEL_CODES = {128 + signal.SIGTERM, 128 + signal.SIGINT, 128 + signal.SIGHUP}


def state_path(job_dir: str | os.PathLike) -> Path:
    return Path(job_dir) / STATE_FILE


def has_state(job_dir: str | os.PathLike) -> bool:
    return state_path(job_dir).exists()


def read_state(job_dir: str | os.PathLike) -> dict | None:
    try:
        record = json.loads(state_path(job_dir).read_text())
    except FileNotFoundError:
        return None
    except ValueError:  # never half-written (write_state replaces atomically), but a hand-edited file may be bad
        return None
    # ... or another shape: a record is the run's state and the pid that wrote it
    if not (isinstance(record, dict) and isinstance(record.get("state"), str)
            and isinstance(record.get("pid"), int) and not isinstance(record.get("pid"), bool)):
        return None
    return record


def write_state(job_dir: str | os.PathLike, data: dict) -> None:
    """Replace the record atomically: a reader sees the old record or the new one, never a partial file."""
    atomic_file.write_json(state_path(job_dir), data, fsync=True)


def final_state(rc: int) -> str:
    if rc == 0:
        return "COMPLETED"
    return "CANCELLED" if rc in CANCEL_CODES else "FAILED"


def process_start(pid: int) -> float | None:
    """When the process started (epoch seconds), from /proc; None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def is_alive(pid: int, started: float | None = None, slack_s: float = 2.0) -> bool:
    """Whether `pid` runs (a zombie does not) and, when `started` is known, is the process that started then."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if _zombie(pid):
        return False
    if started is not None:
        now = process_start(pid)
        if now is not None and abs(now - started) > slack_s:
            return False  # the pid was reused by another process
    return True


def running_record(pid: int | None = None) -> dict:
    pid = pid or os.getpid()
    now = time.time()
    return {
        "backend": "local",
        "state": "RUNNING",
        "pid": pid,
        # a detached run leads its own session, so `ogrpo cancel` can signal its whole group; a foreground run's
        # group is the shell's job (a `| tee` pipeline with it), so only its pid is signalled
        "pgid": pid if os.getsid(pid) == pid else None,
        "host": socket.gethostname(),
        "started_at": now,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)),
        "proc_start": process_start(pid),
        "exit_code": None,
    }


def ended_record(record: dict, rc: int, message: str = "") -> dict:
    now = time.time()
    return {**record, "state": final_state(rc), "exit_code": rc, "ended_at": now,
            "ended": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)), "message": message}


def on_this_host(record: dict) -> bool:
    return record.get("host") in (None, socket.gethostname())


def record_alive(record: dict) -> bool:
    return bool(record.get("pid")) and is_alive(int(record["pid"]), record.get("proc_start"))


def elapsed(record: dict) -> str:
    end = record.get("ended_at") or time.time()
    s = max(0, int(end - float(record.get("started_at") or end)))
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"
