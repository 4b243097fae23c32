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


def free_ports(n: int, host: str = "127.0.0.1", owner: int | None = None) -> list[int]:
    """`n` distinct ports that are free on `host` now and claimed for `owner` (default: this process).

    Call `release_ports` when the job ends; a crashed owner's claims expire by themselves.
    """
    owner = owner or os.getpid()
    ports: list[int] = []
    held: list[socket.socket] = []
    try:
        for _ in range(n * 20):
            if len(ports) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            port = s.getsockname()[1]
            held.append(s)  # keep it bound so the kernel does not hand it out again inside this loop
            if port not in ports and _claim(port, owner):
                ports.append(port)
    finally:
        for s in held:
            s.close()
    if len(ports) < n:
        release_ports(ports)
        raise OSError(f"could not reserve {n} free ports on {host}")
    return ports
