"""The `ogrpo` Typer app: parse, call, print. Nothing imports this module.

Each command lives in `ogrpo/commands/<area>.py`; those modules import no torch/transformers/trl/vllm at
import time so that `ogrpo --help`, `plan` and `render` answer fast on a login node.
"""

from __future__ import annotations

import sys

import typer

from ogrpo.commands import fast_typer

fast_typer.install()

from ogrpo.commands import jobs, planning, serving, training  # noqa: E402
from ogrpo.errors import OgrpoError  # noqa: E402

app = typer.Typer(
    name="ogrpo",
    help="Plan, render, submit and run GRPO post-training (TRL + vLLM) on Slurm GPU clusters or one machine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # rich markup parsing costs ~0.14 s on every --help
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
    except Exception as exc:
        # Usage errors (unknown option, bad value): typer may ship its own copy of click, so match both.
        if _is_click_exception(exc):
            exc.show()
            sys.exit(2)
        raise
    sys.exit(rc if isinstance(rc, int) else 0)


def _is_click_exception(exc: BaseException) -> bool:
    bases = []
    try:
        from typer._click.exceptions import ClickException as Vendored

        bases.append(Vendored)
    except ImportError:
        pass
    import click

    bases.append(click.exceptions.ClickException)
    return isinstance(exc, tuple(bases))
