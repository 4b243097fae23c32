"""`ogrpo submit`, `status`, `logs`, `cancel` (owned by the Slurm area)."""
from __future__ import annotations


def submit() -> None:
    """Submit (not built yet)."""
    raise NotImplementedError


def status() -> None:
    """Status (not built yet)."""
    raise NotImplementedError


def logs() -> None:
    """Logs (not built yet)."""
    raise NotImplementedError


def cancel() -> None:
    """Cancel (not built yet)."""
    raise NotImplementedError
