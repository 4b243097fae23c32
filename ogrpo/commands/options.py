"""Command options declared without importing typer, and a fast parse of the plain command lines.

typer costs ~90 ms to import, a third of what `ogrpo plan` / `render` may take on a login node. A command module
declares its options with `Option(...)` from here (typer.Option's arguments, recorded); `typer_defaults` turns
them into typer's own when cli.py builds the Typer app, so `--help`, errors and every other command line behave
exactly as typer makes them. `fast_kwargs` parses only what needs no typer to be read the same way: known
long/short options with a value (`--gpus 3xA40`, `--gpus=3xA40`, `-c FILE`), flags (`--json`), str/int/bool
options; anything else (help, an unknown option, a missing or odd value, an argument) returns None and the
command line goes to typer.
"""

from __future__ import annotations

import re
import sys


class Option:
    """typer.Option(default, *param_decls, **kwargs), recorded until typer is needed."""

    def __init__(self, default, *param_decls: str, **kwargs):
        self.default = default
        self.param_decls = param_decls
        self.kwargs = kwargs

    def to_typer(self):
        import typer

        return typer.Option(self.default, *self.param_decls, **self.kwargs)


def typer_defaults(fn) -> None:
    """Replace fn's recorded Options by typer's (once; typer reads them from the signature)."""
    if fn.__defaults__ and any(isinstance(d, Option) for d in fn.__defaults__):
        fn.__defaults__ = tuple(d.to_typer() if isinstance(d, Option) else d for d in fn.__defaults__)


def echo(text: str = "", err: bool = False) -> None:
    """typer.echo for plain text: a line on stdout (stderr with err=True), flushed."""
    stream = sys.stderr if err else sys.stdout
    stream.write(f"{text}\n")
    stream.flush()


# annotation (as written, under `from __future__ import annotations`) -> the value's type
_TYPES = {"str": str, "Optional[str]": str, "int": int, "Optional[int]": int, "bool": bool}


def fast_kwargs(fn, args: list[str]) -> dict | None:
    """fn's keyword arguments for `args` when typer would read them the same way, else None."""
    code = fn.__code__
    names = code.co_varnames[:code.co_argcount]
    defaults = fn.__defaults__ or ()
    if len(defaults) != len(names):
        return None
    flags: dict[str, tuple[str, type]] = {}
    kwargs = {}
    for name, opt in zip(names, defaults):
        kind = _TYPES.get(str(fn.__annotations__.get(name)))
        if not isinstance(opt, Option) or kind is None or opt.default is ... or "/" in "".join(opt.param_decls):
            return None
        if kind is bool and opt.default is not False:
            return None
        kwargs[name] = opt.default
        for decl in opt.param_decls:
            flags[decl] = (name, kind)
    i = 0
    while i < len(args):
        token = args[i]
        key, eq, value = token.partition("=") if token.startswith("--") else (token, "", "")
        if key not in flags:
            return None  # --help, an unknown option, an argument, `--`, `-cFILE`: typer's to read
        name, kind = flags[key]
        if kind is bool:
            if eq:
                return None
            kwargs[name] = True
            i += 1
            continue
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("-"):
                return None
            value = args[i + 1]
            i += 1
        i += 1
        if kind is int:
            if not re.fullmatch(r"[0-9]+", value):
                return None
            value = int(value)
        kwargs[name] = value
    return kwargs
