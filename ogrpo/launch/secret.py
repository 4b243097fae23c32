"""The job's key: the one secret that lets a job's own steps, and only them, talk to its vLLM server.

Without it, anyone who can reach the node can generate on the server or push weights into it (the dev-mode
weight-transfer routes). Each job dir holds one key in JOB_DIR/job.key, mode 0600, made the first time the job is
launched (`ogrpo submit`, or the in-job supervisor of a hand-run `sbatch job.sbatch`) and read again by a
requeued attempt. The supervisor hands it to the job's steps in their environment (KEY_ENV): never on a command
line (`ps` shows those to every user), never in job.sbatch, the manifest or a log. `ogrpo serve` refuses every
request without it (ogrpo.serve.auth) and the trainer's VLLMClient sends it on each request.
"""

from __future__ import annotations

import os
import secrets
import stat
import sys
from pathlib import Path

KEY_ENV = "OGRPO_JOB_KEY"
KEY_FILE = "job.key"


def new_key() -> str:
    return secrets.token_urlsafe(32)


def key_path(job_dir: str | os.PathLike) -> Path:
    return Path(job_dir) / KEY_FILE


def _private(path: Path) -> bool:
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IRWXG | stat.S_IRWXO)


def _create(path: Path) -> None:
    """Write a fresh key atomically: a reader never sees a half-written file, and of two jobs racing to create
    it the first one's key is kept (link fails on an existing name)."""
    tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # 0600 from the start, whatever the umask
    try:
        with os.fdopen(fd, "w") as f:
            f.write(new_key() + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)


def ensure(job_dir: str | os.PathLike) -> str:
    """The job's key, made on first use. A key file others could read (or owned by someone else) is replaced:
    a fresh key only costs the running attempt nothing, since server and trainer of an attempt start together."""
    path = key_path(job_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and not _private(path):
        sys.stderr.write(f"ogrpo: {path} was readable by others; replaced with a new key\n")
        path.unlink()
    if not path.exists():
        _create(path)
    key = path.read_text().strip()
    if not key:  # an empty file (disk full at the first write): start over once
        path.unlink()
        _create(path)
        key = path.read_text().strip()
    return key


def from_env(env: dict | None = None) -> str | None:
    return (env if env is not None else os.environ).get(KEY_ENV) or None


def ensure_in_env() -> str:
    """The key of this process's environment, made when there is none: for tools that start a server and talk to
    it themselves (`ogrpo bench rollout`, `ogrpo selftest`), whose child server inherits it."""
    key = from_env()
    if key is None:
        key = os.environ[KEY_ENV] = new_key()
    return key
