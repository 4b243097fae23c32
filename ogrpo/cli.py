"""The `ogrpo` Typer app: parse, call, print. Nothing imports this module.

Each command lives in `ogrpo/commands/<area>.py`; those modules import no torch/transformers/trl/vllm at
import time so that `ogrpo --help`, `plan` and `render` answer fast on a login node, and a plain `plan`/`render`
command line does not import typer either (ogrpo.commands.options).
"""

from __future__ import annotations

import contextlib
import io
import sys

from ogrpo.commands.options import fast_kwargs, typer_defaults
from ogrpo.errors import ConfigError, OgrpoError

_SETTINGS = dict(
    name="ogrpo",
    help="Plan, render, submit and run GRPO post-training (TRL + vLLM) on Slurm GPU clusters or one machine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # rich markup parsing costs ~0.14 s on every --help
    context_settings={"help_option_names": ["-h", "--help"]},
)
# command -> (module under ogrpo.commands, function): imported only when the command (or the whole app) is built
_COMMANDS = {
    "plan": ("planning", "plan"), "render": ("planning", "render"), "doctor": ("planning", "doctor"),
    "train": ("training", "train"), "serve": ("serving", "serve"), "supervise": ("serving", "supervise"),
    "submit": ("jobs", "submit"), "status": ("jobs", "status"), "logs": ("jobs", "logs"),
    "cancel": ("jobs", "cancel"), "reproduce": ("reproducing", "reproduce"),
    "selftest": ("selftesting", "selftest"), "sweep": ("sweeping", "sweep"),
}
_HIDDEN = {"supervise"}
_GROUPS = {"bench": ("serving", "bench_app")}
# Commands a login node runs often whose plain command lines are parsed without typer (ogrpo.commands.options:
# ~90 ms of import); help, errors and anything unusual still go through typer.
_FAST = ("plan", "render")


def _command(name: str, table: dict):
    import importlib

    module, attr = table[name]
    return getattr(importlib.import_module(f"ogrpo.commands.{module}"), attr)


def make_app(only: str | None = None):
    """The whole CLI, or just the command `only` (typer inspects every command's signature before it parses
    anything: ~40 ms of a login node's `ogrpo render` for ten commands that do not run)."""
    import typer

    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.patches import typer_options

    typer_options.install()
    app = typer.Typer(**_SETTINGS)
    for name in _COMMANDS:
        if only in (None, name):
            fn = _command(name, _COMMANDS)
            typer_defaults(fn)
            app.command(name, hidden=name in _HIDDEN)(fn)
    for name in _GROUPS:
        if only in (None, name):
            app.add_typer(_command(name, _GROUPS), name=name)
    if only is not None:
        # a group callback keeps a one-command app a group, so `ogrpo plan ...` still names its command
        app.callback()(lambda: None)
    return app


# Commands whose --json promises one JSON object on stdout whatever happens: the command's own object on success,
# {"errors": [...], "exit_code": N} when it fails (the one-line error still goes to stderr).
_JSON_COMMANDS = ("plan", "render", "submit", "status")


def _json_errors(messages: list[str], code: int) -> None:
    import json

    sys.stdout.write(json.dumps({"errors": messages, "exit_code": code}) + "\n")
    sys.stdout.flush()


def _messages(exc: BaseException) -> list[str]:
    if isinstance(exc, ConfigError):
        return [f"{exc.source}: {p}" for p in exc.problems]
    return [str(exc)]


def main() -> None:
    # A terminal or pipe that is not UTF-8 (PYTHONIOENCODING=ascii, a latin-1 locale): a character it cannot show
    # is replaced, not a UnicodeEncodeError after the plan was made.
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "encoding", "utf-8").lower().replace("-", "") != "utf8" and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")
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


def _echo_err(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _run(name: str | None):
    """Run the command line: a plain `plan`/`render` without typer, everything else through the Typer app."""
    if name in _FAST:
        fn = _command(name, _COMMANDS)
        kwargs = fast_kwargs(fn, sys.argv[2:])
        if kwargs is not None:
            return fn(**kwargs)
    app = make_app(name if name in _COMMANDS or name in _GROUPS else None)
    return app(standalone_mode=False)


def _main(name: str | None) -> None:
    try:
        rc = _run(name)
    except OgrpoError as exc:
        _echo_err(f"error: {exc}")
        raise _exit(exc.exit_code, _messages(exc)) from None
    except KeyboardInterrupt:
        _echo_err("interrupted")
        sys.exit(130)
    except ModuleNotFoundError as exc:
        # CLI latency: `ogrpo --help` imports this module
        from ogrpo.install_hints import hint as install_hint

        hint = install_hint(exc.name)
        if hint is None:
            raise
        message = f"`ogrpo {name}` needs {exc.name.split('.')[0]}, which is not installed here: {hint}"
        _echo_err(f"error: {message}")
        raise _exit(2, [message]) from None
    except Exception as exc:
        if "typer" in sys.modules:  # typer's own exits; nothing raises them where typer was not imported
            import typer

            if isinstance(exc, typer.Exit):
                sys.exit(exc.exit_code)
            if isinstance(exc, typer.Abort):
                _echo_err("aborted")
                sys.exit(130)
        # Usage errors (unknown option, bad value): typer may ship its own copy of click, so match both.
        if _is_click_exception(exc):
            # one line, as every other bad input gets (click's own is usage, a hint and the error on 4 lines)
            ctx = getattr(exc, "ctx", None)
            where = ctx.command_path if ctx is not None else " ".join(
                ["ogrpo", *([name] if name in _COMMANDS or name in _GROUPS else [])])
            _echo_err(f"error: {exc.format_message().rstrip('.')} (`{where} -h` for help)")
            raise _exit(2, [exc.format_message()]) from None
        raise
    sys.exit(rc if isinstance(rc, int) else 0)


def _is_click_exception(exc: BaseException) -> bool:
    # typer 0.29 vendors click and no longer installs it; older typer uses the real one: match whichever is
    # loaded (an exception of click's means its module is imported).
    bases = [sys.modules[mod].ClickException for mod in ("typer._click.exceptions", "click.exceptions")
             if mod in sys.modules]
    return isinstance(exc, tuple(bases))
