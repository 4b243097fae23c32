"""`ogrpo plan`, `ogrpo render`, `ogrpo doctor` (owned by the planning core)."""
from __future__ import annotations


def plan() -> None:
    """Plan placement and memory fit (not built yet)."""
    raise NotImplementedError


def render() -> None:
    """Render the Slurm job (not built yet)."""
    raise NotImplementedError


def doctor() -> None:
    """Check this machine (not built yet)."""
    raise NotImplementedError
