"""Replace a small file whole: a reader that polls it (`ogrpo cancel`, `status`, a test) sees the old contents or
the new ones, never an empty or half-written file, and a kill mid-write leaves the old one."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_text(path: str | os.PathLike, text: str, fsync: bool = False) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a hidden name ending in .tmp: globs for the final names (roles/*.json) never pick up the temporary file
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
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
