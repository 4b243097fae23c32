"""The `ogrpo` Typer app: parse, call, print. Nothing imports this module.

Each command lives in `ogrpo/commands/<area>.py`; those modules import no torch/transformers/trl/vllm at
import time so that `ogrpo --help`, `plan` and `render` answer fast on a login node.
"""

from __future__ import annotations

import contextlib
import io
import sys

import typer

from ogrpo.patches import typer_options

typer_options.install()

from ogrpo.commands import jobs, planning, reproducing, selftesting, serving, sweeping, training  # noqa: E402
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
    "sweep": sweeping.sweep,
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


# Commands whose --json promises one JSON object on stdout whatever happens: the command's own object on success,
# {"errors": [...], "exit_code": N} when it fails (the one-line error still goes to stderr).
_JSON_COMMANDS = ("plan", "render", "submit")


def _json_errors(messages: list[str], code: int) -> None:
    import json

    sys.stdout.write(json.dumps({"errors": messages, "exit_code": code}) + "\n")
    sys.stdout.flush()


def _messages(exc: BaseException) -> list[str]:
    from ogrpo.errors import ConfigError

    if isinstance(exc, ConfigError):
        return [f"{exc.source}: {p}" for p in exc.problems]
    return [str(exc)]


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else None
    as_json = name in _JSON_COMMANDS and "--json" in sys.argv[2:]
    # submit prints lines for people; with --json they are collected into its one object
    capture = io.StringIO() if as_json and name == "submit" else None
    try:
        with contextlib.redirect_stdout(capture) if capture is not None else contextlib.nullcontext():
            _main(name)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        failed = getattr(exc, "ogrpo_errors", None)
        if as_json and failed is not None:
            _json_errors(failed, code)
        elif capture is not None:
            import json

            lines = capture.getvalue().splitlines()
            sys.stdout.write(json.dumps({"exit_code": code, "output": lines}) + "\n")
        raise
    except Exception as exc:
        if as_json:  # a bug, not bad input: the traceback follows on stderr
            _json_errors([f"internal error: {type(exc).__name__}: {exc}"], 1)
        raise


def _exit(code: int, errors: list[str]):
    exc = SystemExit(code)
    exc.ogrpo_errors = errors  # type: ignore[attr-defined]
    return exc


def _main(name: str | None) -> None:
    app = make_app(name if name in _COMMANDS or name in _GROUPS else None)
    try:
        rc = app(standalone_mode=False)
    except OgrpoError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise _exit(exc.exit_code, _messages(exc)) from None
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
        message = f"`ogrpo {name}` needs {exc.name.split('.')[0]}, which is not installed here: {hint}"
        typer.echo(f"error: {message}", err=True)
        raise _exit(2, [message]) from None
    except Exception as exc:
        # Usage errors (unknown option, bad value): typer may ship its own copy of click, so match both.
        if _is_click_exception(exc):
            exc.show()
            raise _exit(2, [exc.format_message()]) from None
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
