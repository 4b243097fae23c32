"""No process a test starts survives it: checked for every test, not test by test.

Each test runs with its own OGRPO_TEST_OWNER in the environment, so every process it starts carries it however
it detaches (a double fork, its own session, a supervisor's steps, a Slurm job that exports the environment).
After the test's teardown, the processes born meanwhile that carry its mark, or carry none and descend from
this one (a fork without exec shows its parent's first environment), must be gone. What is left after a grace (a
server that got its TERM may still be exiting under load) is killed, and the test errors at teardown, naming
them. (This process is not made a subreaper: orphans reparented here would stay zombies that only a wait could
clear, and waiting for them would take the exit status from the Popen or multiprocessing object a test reads
it from.)

A fixture of a wider scope (module, session) owns what its setup starts, under a mark of its own, and so what
those processes start later: those must be gone when it is finalized. The one process-wide pool of the test
process (the math reward workers, started on first use and closed at exit, as in a trainer) is the process's,
not a test's; tests/test_rewards.py shows that closing it ends them.

Only processes born during the test are read (their /proc entries), so a test that starts none costs two
listings of /proc.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from ogrpo.launch import procs

VAR = "OGRPO_TEST_OWNER"
# A vLLM server told to stop took up to 12 s to exit beside a full suite on 2 cores; a leak stays much longer.
# (tests/test_no_survivors.py sets it short, to see a leak caught without the wait.)
GRACE_S = float(os.environ.get("OGRPO_TEST_SURVIVOR_GRACE_S", "45"))
_marks = itertools.count()
_owned: dict = {}  # a wider fixture's FixtureDef -> its mark
_KEY = pytest.StashKey[tuple]()


def _new_mark() -> str:
    return f"{os.getpid()}-{next(_marks)}"


def _pids() -> set[int]:
    return {int(name) for name in os.listdir("/proc") if name.isdigit()}


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def _descends_from_me(pid: int) -> bool:
    me = os.getpid()
    for _ in range(64):
        st = _stat(pid)
        if st is None or st[1] <= 1:
            return False
        if st[1] == me:
            return True
        pid = st[1]
    return False


def _process_wide() -> set[int]:
    math = sys.modules.get("ogrpo.rewards.math")
    pool = getattr(math, "_pool", None) if math else None
    return set(pool.pids()) if pool is not None else set()


def _left(mark: str, before: set[int]) -> set[int]:
    """The live processes born since `before` that are `mark`'s: they carry it, or carry no mark and descend
    from this process."""
    out = set()
    for pid in _pids() - before - _process_wide():
        st = _stat(pid)
        if st is None or st[0] in ("Z", "X"):  # a zombie runs nothing: only its exit status is left to reap
            continue
        theirs = procs.environ(pid).get(VAR)
        if theirs == mark or (theirs is None and _descends_from_me(pid)):
            out.add(pid)
    return out


def _check(mark: str, before: set[int], what: str) -> None:
    """Wait for what `mark` started to end; kill what is left and fail, naming it."""
    deadline = time.monotonic() + GRACE_S
    left = _left(mark, before)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _left(mark, before)
    if not left:
        return
    named = procs.describe(sorted(left))
    for _ in range(5):  # what a killed process had started may carry the mark too: kill that as well
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.2)
        left = _left(mark, before)
        if not left:
            break
    pytest.fail(f"{what} left processes running {GRACE_S:.0f} s after it ended (killed now): {named}",
                pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.scope == "function":
        return (yield)
    mark, prev = _new_mark(), os.environ.get(VAR)
    os.environ[VAR] = mark
    _owned[fixturedef] = (mark, _pids())
    try:
        return (yield)
    finally:
        os.environ.pop(VAR) if prev is None else os.environ.__setitem__(VAR, prev)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_post_finalizer(fixturedef, request):
    result = yield
    if fixturedef in _owned:
        mark, before = _owned.pop(fixturedef)
        _check(mark, before, f"fixture {fixturedef.argname!r}")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    item.stash[_KEY] = (_new_mark(), _pids())
    os.environ[VAR] = item.stash[_KEY][0]
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        result = yield
    finally:
        os.environ.pop(VAR, None)
    if _KEY in item.stash:
        mark, before = item.stash[_KEY]
        _check(mark, before, "the test")
    return result
