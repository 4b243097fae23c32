"""Free local ports for a job, reserved so that two jobs started at the same moment never get the same one.

Asking the kernel for port 0 and closing the socket leaves a window in which a second job can be handed the same
port; fixed ports (TRL's 8000/51216 defaults) collide outright. Each port we hand out is also claimed with an
O_EXCL lock file named after it, owned by our pid; a claim whose owner is dead is stale and taken over.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

LOCK_DIR = Path(tempfile.gettempdir()) / f"ogrpo-ports-{os.getuid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _claim(port: int, owner: int) -> bool:
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    lock = LOCK_DIR / f"{port}.lock"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = int(lock.read_text().strip() or 0)
            except (OSError, ValueError):
                holder = 0
            if holder and _pid_alive(holder):
                return False
            try:  # stale claim: its job is gone
                lock.unlink()
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(owner))
        return True
    return False


def release_ports(ports: list[int]) -> None:
    for port in ports:
        try:
            (LOCK_DIR / f"{port}.lock").unlink()
        except FileNotFoundError:
            pass


def release_stale() -> list[int]:
    """Drop every claim whose owner is gone (a job killed before it could release its ports, e.g. by Slurm's
    SIGKILL after a cancel); returns those ports. Such a claim is void anyway (`_claim` takes it over)."""
    dropped = []
    for lock in LOCK_DIR.glob("*.lock") if LOCK_DIR.is_dir() else ():
        try:
            holder = int(lock.read_text().strip() or 0)
        except (OSError, ValueError):
            continue
        if holder and not _pid_alive(holder):
            lock.unlink(missing_ok=True)
            dropped.append(lock.stem)
    return [int(p) for p in dropped if p.isdigit()]


def _below_ephemeral() -> range:
    """Ports the kernel never hands out on its own: below the ephemeral range (ip_local_port_range). A port
    taken from the ephemeral range is free when we look, but any outgoing connection (an HTTP client, a gloo
    rank) may be given it before the server that was meant to listen there binds it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(max(1024, low - 12000), max(1025, low))


def free_ports(n: int, host: str = "127.0.0.1", owner: int | None = None) -> list[int]:
    """`n` distinct ports below the ephemeral range that are free on `host` now and claimed for `owner`
    (default: this process).

    Call `release_ports` when the job ends; a crashed owner's claims expire by themselves.
    """
    import random

    owner = owner or os.getpid()
    candidates = _below_ephemeral()
    rng = random.SystemRandom()
    ports: list[int] = []
    for _ in range(n * 50):
        if len(ports) == n:
            break
        port = rng.choice(candidates)
        if port in ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:  # in use
                continue
        if _claim(port, owner):
            ports.append(port)
    if len(ports) < n:
        release_ports(ports)
        raise OSError(f"could not reserve {n} free ports on {host}")
    return ports


# ---------------------------------------------------------------------------------------- ports of a Slurm job
#
# A Slurm job's ports must be known before its steps start, the same on every attempt of the job, and different
# from its neighbours' on a shared node. They come from the job id, then are checked on the node:
# - below Linux's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 by default), so a port the kernel
#   hands out for an outgoing connection (NCCL, HTTP clients, other jobs' rendezvous) cannot already hold it;
# - above 10000, clear of the well-known/registered services most sites run (ssh 22, slurmd 6818, mysql 3306 ...);
# - in slots of 3 (server, rendezvous, weight-sync group): slot = job_id * MULTIPLIER mod SLOTS. SLOTS (7333) is
#   prime, so any MULTIPLIER not a multiple of it maps SLOTS consecutive ids to SLOTS different slots: jobs
#   submitted close together never share a slot, and the multiplier spreads neighbours over the whole range
#   (ids 1 and 2 are ~2000 ports apart). `20000 + (id % 10000) * 3` gave ids 10000 apart the same ports.
# A slot that is taken on the node (a foreign service, a slot collision) is skipped: the next slot is tried.
SLURM_PORT_MIN = 10000
SLURM_PORT_MAX = 32000  # exclusive; < 32768, the default start of the ephemeral range
SLURM_PORTS_PER_JOB = 3  # server, rendezvous, weight-sync group (TRL's vllm_group_port)
SLURM_SLOTS = 7333  # (SLURM_PORT_MAX - SLURM_PORT_MIN) // 3, a prime
SLURM_MULTIPLIER = 2654435761 % SLURM_SLOTS  # Knuth's multiplicative hash constant, reduced
PORT_NAMES = ("server", "rendezvous", "group")


def slurm_slot(job_id: int) -> int:
    return (int(job_id) * SLURM_MULTIPLIER) % SLURM_SLOTS


def slot_ports(slot: int) -> dict[str, int]:
    base = SLURM_PORT_MIN + (slot % SLURM_SLOTS) * SLURM_PORTS_PER_JOB
    return {name: base + i for i, name in enumerate(PORT_NAMES)}


def slurm_ports(job_id: int) -> dict[str, int]:
    """The first-choice ports of a Slurm job: {server, rendezvous, group}."""
    return slot_ports(slurm_slot(job_id))


def port_free(port: int, host: str = "") -> bool:
    """Whether a listening socket could bind `port` on `host` ("" = every address, which also fails when any
    single address holds it). SO_REUSEADDR: a port in TIME_WAIT after the previous attempt counts as free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pick_slurm_ports(job_id: int, recorded: dict | None = None, *, owner: int | None = None,
                     is_free=port_free, tries: int = 64) -> dict[str, int]:
    """Ports for this attempt of a Slurm job, checked free on this node and claimed for `owner`.

    `recorded`: the ports an earlier attempt of the same job used (run/ports.json); they are kept when still free,
    so a requeued job comes back on its own ports. Else the job id's slot, then the following slots."""
    owner = owner or os.getpid()
    candidates = []
    if recorded and all(isinstance(recorded.get(n), int) for n in PORT_NAMES):
        candidates.append({n: recorded[n] for n in PORT_NAMES})
    first = slurm_slot(job_id)
    candidates += [slot_ports(first + k) for k in range(tries)]
    for ports in candidates:
        claimed = []
        for port in ports.values():
            if is_free(port) and _claim(port, owner):
                claimed.append(port)
            else:
                break
        if len(claimed) == len(ports):
            return ports
        release_ports(claimed)
    raise OSError(f"no free port slot for job {job_id} in {SLURM_PORT_MIN}-{SLURM_PORT_MAX} after {tries} tries")
