"""A quiet trainer: the user's terminal shows O-GRPO's lines and the training bar; libraries' output stays in the log.

The supervisor starts each step with its stdout/stderr on the step's log (`run/logs/<role>.log`): every byte
written there, by Python, native code (kineto, NCCL, the C++ allocator) or a child process (accelerate's
launcher), is the run's complete record and stays so. For the role it echoes live, it also names a console
file (`CONSOLE_ENV`) and echoes that file instead of the log. `install()` makes this process write to the console
file only what O-GRPO itself prints: sys.stdout and sys.stderr become a `_Split` that writes everything to the
log as before and, when the code that wrote is O-GRPO's, the same text to the console file.

Who wrote is read from the call stack, at the write: the nearest frame that is neither the standard library
(print, logging, warnings, traceback) nor a printing library (rich, tqdm) decides. So a warning TRL raises, a
record DeepSpeed or vLLM logs, a bar transformers draws while loading weights go to the log only, while
O-GRPO's notes, its logger's records, its rich tables and its error line reach the terminal too. A write
with no such frame (an uncaught traceback, printed after the last frame is gone) stays in the log: the
supervisor prints the log's tail and path when a step fails.

The training bar is drawn by transformers' ProgressCallback, so no frame of ours is near its writes; the
callback builds it inside `to_console()` (ogrpo/trainer/callbacks.py), which hands tqdm the console directly.
At exit, when libraries warned (Python warnings, logging records at WARNING or above), one line on the console
says how many and names the log that holds them.

Outside the supervisor (no `CONSOLE_ENV`: `ogrpo train` in a terminal, in-process tests) `install()` does nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from typing import Iterator

from ogrpo.layout import CONSOLE_ENV, LOG_ENV

PRINTERS = frozenset({"rich", "tqdm"})  # libraries that print on behalf of whoever called them
OURS = "ogrpo"
_MAX_DEPTH = 64


def _module(frame) -> str:
    g = frame.f_globals
    name = g.get("__name__") or ""
    if name == "__main__":  # `python -m ogrpo.train` runs its __main__ under that name; the spec keeps the real one
        spec = g.get("__spec__")
        name = getattr(spec, "name", None) or name
    return name


def _transparent(top: str) -> bool:
    # a leading underscore: C accelerators (_io), and a script's or `-c`'s __main__, which is nobody's package
    return top in sys.stdlib_module_names or top in PRINTERS or top.startswith("_")


class Counts:
    """What went to the log only, for the one-line summary at exit."""

    def __init__(self) -> None:
        self.warnings = 0
        self.hidden = 0  # lines that reached the log only
        self.path = ""


def _writer(frame, counts: Counts | None) -> bool:
    """True when the nearest frame outside the standard library and the printing libraries is O-GRPO's."""
    warned = False
    for _ in range(_MAX_DEPTH):
        if frame is None:
            break
        name = _module(frame)
        if name == __name__:
            frame = frame.f_back
            continue
        top = name.partition(".")[0]
        if top == "warnings" or (top == "logging" and frame.f_code.co_name == "emit"
                                 and getattr(frame.f_locals.get("record"), "levelno", 0) >= logging.WARNING):
            warned = True
        if not _transparent(top):
            ours = top == OURS
            if warned and not ours and counts is not None:
                counts.warnings += 1
            return ours
        frame = frame.f_back
    return False


def _interpreter() -> bool:
    """Whether the interpreter itself writes, no Python code under it: the traceback of an exception nothing
    caught, the process's last words. They reach the console too (and a write never fails for want of a caller's
    frame, which lost the whole report: "lost sys.stderr")."""
    try:
        sys._getframe(2)
    except ValueError:
        return True
    return False


class _Console:
    """The console file, written through at once: the supervisor polls it."""

    def __init__(self, path: str):
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, text: str) -> None:
        data = text.encode("utf-8", "replace")
        while data:
            n = os.write(self._fd, data)
            data = data[n:]


class _Split:
    """sys.stdout/sys.stderr: everything to the log stream it replaces; O-GRPO's writes to the console as well."""

    def __init__(self, log, console: _Console, counts: Counts, force: bool = False):
        self._log = log
        self._console = console
        self._counts = counts
        self._force = force

    def write(self, text: str) -> int:
        n = self._log.write(text)
        if text and (self._force or _interpreter() or _writer(sys._getframe(1), self._counts)):
            self._log.flush()  # the log keeps the terminal's order for O-GRPO's own lines
            self._console.write(text)
        elif text:
            self._counts.hidden += text.count("\n")
        return n if n is not None else len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._log.flush()

    def __getattr__(self, name):  # encoding, isatty, fileno, buffer, ...: the log stream's own
        return getattr(self._log, name)


_STATE: dict = {}


def install(environ=os.environ) -> bool:
    """Route this process's output as the module docstring says, when the supervisor named a console file.
    Idempotent; returns whether it is (now) installed."""
    if _STATE:
        return True
    path = environ.get(CONSOLE_ENV)
    if not path:
        return False
    console, counts = _Console(path), Counts()
    log_out, log_err = sys.stdout, sys.stderr
    _STATE.update(console=console, counts=counts, log=environ.get(LOG_ENV) or "the step's log",
                  direct=_Split(log_err, console, counts, force=True))
    sys.stdout = _Split(log_out, console, counts)
    sys.stderr = _Split(log_err, console, counts)
    atexit.register(_summary)
    return True


@contextlib.contextmanager
def to_console() -> Iterator[None]:
    """Inside: sys.stderr is the console itself (and the log), for a library's output the user should watch (the
    training bar: tqdm keeps the stream it found when it was made)."""
    direct = _STATE.get("direct")
    if direct is None:
        yield
        return
    saved, sys.stderr = sys.stderr, direct
    try:
        yield
    finally:
        sys.stderr = saved


def summary_line() -> str | None:
    counts = _STATE.get("counts")
    if counts is None or not counts.warnings:
        return None
    n = counts.warnings
    return f"note: {n} warning{'s' if n != 1 else ''} from libraries, not shown here: {_STATE['log']}"


def _summary() -> None:
    """One line at exit, from the main process only, when libraries warned."""
    line = summary_line()
    if line and os.environ.get("RANK", "0") == "0":
        with contextlib.suppress(Exception):
            _STATE["direct"].write(line + "\n")
            _STATE["direct"].flush()


class _Stream:
    """A terminal stream as the console of `libraries_to_log`."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> None:
        self._stream.write(text)
        self._stream.flush()


@contextlib.contextmanager
def libraries_to_log(log_path) -> Iterator[Counts]:
    """Inside, in a CLI command that imports libraries to inspect them (`ogrpo doctor` imports TRL and vLLM): what
    those libraries print (warnings, log records, writes) goes to `log_path` only, O-GRPO's writes reach the
    terminal as well. Yields the counts; `libraries_note` turns them into the one line a user sees. The log file
    stays open: a handler a library made inside keeps the stream it found and may write to it later."""
    from pathlib import Path

    path = Path(log_path)
    counts = Counts()
    counts.path = str(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        log = open(path, "w", encoding="utf-8")  # noqa: SIM115 - see the docstring
    except OSError:  # a read-only home on a login node: the libraries print where they would have
        yield counts
        return
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Split(log, _Stream(saved[0]), counts), _Split(log, _Stream(saved[1]), counts)
    try:
        yield counts
    finally:
        sys.stdout, sys.stderr = saved
        log.flush()


def libraries_note(counts: Counts) -> str | None:
    """One line naming the log when libraries printed anything there, else None."""
    if not counts.hidden:
        return None
    warned = f", {counts.warnings} warning{'s' if counts.warnings != 1 else ''}" if counts.warnings else ""
    return f"note: library output ({counts.hidden} lines{warned}) is in {counts.path}"
