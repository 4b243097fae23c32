"""`ogrpo serve`, `ogrpo supervise`, `ogrpo bench …` (owned by the serving/launch area)."""
from __future__ import annotations

import typer

bench_app = typer.Typer(help="Benchmarks that print ratios against a baseline measured in the same run.")


def serve() -> None:
    """Serve (not built yet)."""
    raise NotImplementedError


def supervise() -> None:
    """Supervise a job's steps (not built yet)."""
    raise NotImplementedError
