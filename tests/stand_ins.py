"""Stand-ins for the commands a job's steps run (`ogrpo`, `accelerate`): a directory put first on PATH whose
executables re-enter a test module as a script, so a test can play a step's part without its real work."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

STAND_IN = """#!{python}
import os, sys
os.execv(sys.executable, [sys.executable, {module!r}, {tool!r}, *sys.argv[1:]])
"""


def path_env(script: str, prefix: str, tools=("ogrpo", "accelerate")) -> dict[str, str]:
    """This process's environment with the stand-ins (each runs `python SCRIPT TOOL ARGS...`) first on PATH,
    then this Python's own bin dir, so that the supervisor puts nothing in front of them. The directory goes
    when this process exits."""
    bin_dir = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, bin_dir, True)
    for tool in tools:
        path = bin_dir / tool
        path.write_text(STAND_IN.format(python=sys.executable, module=str(Path(script).resolve()), tool=tool))
        path.chmod(0o755)
    path = os.pathsep.join((str(bin_dir), str(Path(sys.executable).parent), os.environ.get("PATH", "")))
    return {**os.environ, "PATH": path}
