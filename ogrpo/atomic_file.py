"""Replace a small file whole: a reader that polls it (`ogrpo cancel`, `status`, a test) sees the old contents or
the new ones, never an empty or half-written file, and a kill mid-write leaves the old one."""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path


def write_text(path: str | os.PathLike, text: str, fsync: bool = False) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a hidden name ending in .tmp: globs for the final names (roles/*.json) never pick up the temporary file.
    # Opened as open() would create the file (0o666 less the umask), not mkstemp's 0o600: a manifest stays
    # readable by whoever could read it before (a shared project directory).
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_json(path: str | os.PathLike, data, fsync: bool = False, **dumps) -> None:
    write_text(path, json.dumps(data, **{"indent": 2, **dumps}) + "\n", fsync=fsync)
