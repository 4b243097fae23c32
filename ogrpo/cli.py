"""The `ogrpo` Typer app: parse, call, print. Nothing imports this module.

Each command lives in `ogrpo/commands/<area>.py`; those modules import no torch/transformers/trl/vllm at
import time so that `ogrpo --help`, `plan` and `render` answer fast on a login node.
"""

from __future__ import annotations

import sys

import typer

from ogrpo.patches import typer_options

typer_options.install()

from ogrpo.commands import jobs, planning, reproducing, selftesting, serving, training  # noqa: E402
from ogrpo.errors import OgrpoError  # noqa: E402

_SETTINGS = dict(
    name="ogrpo",
    help="Plan, render, submit and run GRPO post-training (TRL + vLLM) on Slurm GPU clusters or one machine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # rich markup parsing costs ~0.14 s on every --help
    context_settings={"help_option_names": ["-h", "--help"]},
)
_COMMANDS = {
    "plan": planning.plan, "render": planning.render, "doctor": planning.doctor, "train": training.train,
    "serve": serving.serve, "supervise": serving.supervise, "submit": jobs.submit, "status": jobs.status,
    "logs": jobs.logs, "cancel": jobs.cancel, "reproduce": reproducing.reproduce, "selftest": selftesting.selftest,
}
_HIDDEN = {"supervise"}
_GROUPS = {"bench": serving.bench_app}


def make_app(only: str | None = None) -> typer.Typer:
    """The whole CLI, or just the command `only` (typer inspects every command's signature before it parses
    anything: ~40 ms of a login node's `ogrpo render` for ten commands that do not run)."""
    app = typer.Typer(**_SETTINGS)
    for name, fn in _COMMANDS.items():
        if only in (None, name):
            app.command(name, hidden=name in _HIDDEN)(fn)
    for name, sub in _GROUPS.items():
        if only in (None, name):
            app.add_typer(sub, name=name)
    if only is not None:
        # a group callback keeps a one-command app a group, so `ogrpo plan ...` still names its command
        app.callback()(lambda: None)
    return app


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else None
    app = make_app(name if name in _COMMANDS or name in _GROUPS else None)
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
    except ModuleNotFoundError as exc:
        from ogrpo.install_hints import hint as install_hint

        hint = install_hint(exc.name)
        if hint is None:
            raise
        typer.echo(f"error: `ogrpo {name}` needs {exc.name.split('.')[0]}, which is not installed here: {hint}",
                   err=True)
        sys.exit(2)
    except Exception as exc:
        # Usage errors (unknown option, bad value): typer may ship its own copy of click, so match both.
        if _is_click_exception(exc):
            exc.show()
            sys.exit(2)
        raise
    sys.exit(rc if isinstance(rc, int) else 0)


def _is_click_exception(exc: BaseException) -> bool:
    # typer 0.29 vendors click and no longer installs it; older typer uses the real one: match whichever exists.
    bases = []
    for mod, attr in (("typer._click.exceptions", "ClickException"), ("click.exceptions", "ClickException")):
        try:
            bases.append(getattr(__import__(mod, fromlist=[attr]), attr))
        except ImportError:
            pass
    return isinstance(exc, tuple(bases))
