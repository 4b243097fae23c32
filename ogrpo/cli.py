"""The `ogrpo` Typer app: parse, call, print. Nothing imports this module.

Each command lives in `ogrpo/commands/<area>.py`; those modules import no torch/transformers/trl/vllm at
import time so that `ogrpo --help`, `plan` and `render` answer fast on a login node.
"""

from __future__ import annotations

import sys

import typer

from ogrpo.commands import jobs, planning, serving, training
from ogrpo.errors import OgrpoError

app = typer.Typer(
    name="ogrpo",
    help="Plan, render, submit and run GRPO post-training (TRL + vLLM) on Slurm GPU clusters or one machine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

app.command("plan")(planning.plan)
app.command("render")(planning.render)
app.command("doctor")(planning.doctor)
app.command("train")(training.train)
app.command("serve")(serving.serve)
app.command("supervise", hidden=True)(serving.supervise)
app.command("submit")(jobs.submit)
app.command("status")(jobs.status)
app.command("logs")(jobs.logs)
app.command("cancel")(jobs.cancel)
app.add_typer(serving.bench_app, name="bench")


def main() -> None:
    try:
        rc = app(standalone_mode=False)
    except OgrpoError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # click usage errors and the like
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            sys.exit(2)
        raise
    sys.exit(rc if isinstance(rc, int) else 0)
