"""`ogrpo reproduce`: run a past run again from its manifest, saying how today's stack differs."""

from __future__ import annotations

from typing import Optional

import typer

from ogrpo.errors import OgrpoError


def reproduce(
    run: str = typer.Argument(..., help="Job/run directory of the run to repeat, or its Slurm job id; a sweep's "
                              "directory or id (the whole sweep), or SWEEP/points/I (one point)."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Run directory of the new run."),
    backend: Optional[str] = typer.Option(None, "--backend", help="slurm | local (default: the original's)."),
    strict: bool = typer.Option(False, "--strict", help="Refuse when versions, code or the plan differ."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show what would be submitted; submit nothing."),
) -> None:
    """Resubmit a run from its manifest: the same resolved config, cluster and seed; warns on drift."""
    import os
    import subprocess
    import sys
    import tempfile

    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.sweep.manifest import find as find_sweep

    if not run.strip():  # as a path, the current directory
        raise OgrpoError("RUN is empty: give the run's directory, its Slurm job id, or a sweep's")
    if (sweep := find_sweep(run)) is not None:  # a whole sweep; one point of it is a job directory (points/I)
        # heavy: typer
        from ogrpo.commands.sweeping import reproduce_sweep

        raise typer.Exit(reproduce_sweep(sweep, output, backend, strict, dry_run))
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.config import dump_yaml
    from ogrpo.reproduce import drift, load_record, replanned_differences, rerun_config, rerun_note
    from ogrpo.trainer.rundir import git_sha

    rec = load_record(run)
    problems = drift(rec, git_sha=git_sha())
    config, pins = rerun_config(rec)
    for pin in pins:
        typer.echo(f"note: the rerun is pinned to what the recorded run trained: {pin}", err=True)
    fd, config_path = tempfile.mkstemp(prefix="ogrpo-reproduce-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        f.write(f"# reproduces {rec.source}\n" + dump_yaml(config))
    try:
        problems += replanned_differences(rec, config_path)
        for line in problems:
            typer.echo(f"warning: differs from the recorded run: {line}", err=True)
        if rec.plan is not None and (note := rerun_note(rec.plan)) is not None:
            typer.echo(f"note: {note}", err=True)
        if problems and strict:
            raise OgrpoError(f"--strict: this run would differ from {rec.source}: " + "; ".join(problems))
        argv = [sys.executable, "-m", "ogrpo", "submit", "--config", config_path, "--gpus", rec.gpus,
                "--backend", backend or rec.backend]
        if output:
            argv += ["--output", output]
        if dry_run:
            argv.append("--dry-run")
        typer.echo(f"reproducing {rec.source} (seed {rec.seed}, {rec.gpus}, {backend or rec.backend})", err=True)
        rc = subprocess.call(argv)  # the same submit path as the original, so the same job runs
    finally:
        os.unlink(config_path)
    raise typer.Exit(rc)
