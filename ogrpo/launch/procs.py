"""Process state on this machine: a step's process group and descendants (the supervisor and the step wrapper
wait for them), and what is left of a job (the processes `ogrpo cancel` must see gone).

A process on another node cannot be seen from here; this machine's kernel is recognised by its boot id, which
the step wrapper records next to each step's pids (a network-namespace "node" on the same kernel counts).
"""

from __future__ import annotations

import os
from pathlib import Path


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """A process that still runs (a zombie has ended: only its exit status is left to reap)."""
    import psutil

    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def group_members(pgid: int) -> list[int]:
    """Live processes of process group PGID."""
    import psutil

    out = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and alive(proc.pid):
                out.append(proc.pid)
        except OSError:  # gone meanwhile
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Live descendants of PID, each before its own descendants."""
    import psutil

    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    return [p.pid for p in procs if alive(p.pid)]


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def of_slurm_job(job_id: str, conf: str | None = None) -> list[int]:
    """Live processes of Slurm job JOB_ID on this machine: SLURM_JOB_ID in their environment (readable for our
    own uid, or as root). `conf`: our SLURM_CONF, when set; a process whose job environment names another one
    belongs to another cluster's job of the same number (test machines run several clusters)."""
    needle = f"SLURM_JOB_ID={job_id}\0".encode()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            raw = (d / "environ").read_bytes()
        except OSError:
            continue
        if not (raw.startswith(needle) or b"\0" + needle in raw) or not alive(int(d.name)):
            continue
        theirs = environ(int(d.name)).get("SLURM_CONF")
        if conf and theirs and os.path.realpath(theirs) != os.path.realpath(conf):
            continue
        out.append(int(d.name))
    return sorted(out)


def mentioning(marker: str) -> list[int]:
    """Processes whose command line names `marker` (a job or work directory): what a run left behind."""
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in (proc.info["cmdline"] or [])):
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def cmdline(pid: int, limit: int = 80) -> str:
    try:
        text = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(pids: list[int]) -> str:
    """`pid 12 (python -m ogrpo.train ...), pid 13 (...)`: what a user needs to find them with ps."""
    return ", ".join(f"pid {p} ({cmdline(p)})" for p in pids)
