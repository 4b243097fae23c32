"""`ogrpo train` (owned by the training area)."""
from __future__ import annotations


def train() -> None:
    """Train (not built yet)."""
    raise NotImplementedError
