"""No process a test starts survives it: checked for every test, not test by test.

Each test runs with its own OGRPO_TEST_OWNER in the environment, so every process it starts carries it however
it detaches (a double fork, its own session, a supervisor's steps, a Slurm job that exports the environment).
After the test's teardown, those processes and the pytest process's new descendants (a fork without exec shows
no new environment) must be gone. What is left after a grace (a server that got its TERM may still be shutting
down under load) is killed, and the test errors at teardown, naming them. (This process is not made a
subreaper: orphans reparented here would stay zombies that only a wait could clear, and waiting for them would
take the exit status from the Popen or multiprocessing object a test reads it from.)

A fixture of a wider scope (module, session) owns what its setup starts, under a mark of its own: those must be
gone when it is finalized. The one process-wide pool of the test process (the math reward workers, started on
first use and closed at exit, as in a trainer) is the process's, not a test's; tests/test_rewards.py shows that
closing it ends them.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import time

import pytest

from ogrpo.launch import procs

VAR = "OGRPO_TEST_OWNER"
# A vLLM server told to stop took up to 12 s to exit beside a full suite on 2 cores; a leak stays much longer.
# (tests/test_no_survivors.py sets it short, to see a leak caught without the wait.)
GRACE_S = float(os.environ.get("OGRPO_TEST_SURVIVOR_GRACE_S", "45"))
_marks = itertools.count()
_owned: dict = {}  # a wider fixture's FixtureDef -> (its mark, the descendants its setup started)


def _new_mark() -> str:
    return f"{os.getpid()}-{next(_marks)}"


def _descendants() -> set[int]:
    return set(procs.descendants(os.getpid()))


def _process_wide() -> set[int]:
    math = sys.modules.get("ogrpo.rewards.math")
    pool = getattr(math, "_pool", None) if math else None
    return set(pool.pids()) if pool is not None else set()


def _left(mark: str, before: set[int], exempt: set[int]) -> set[int]:
    return (set(procs.carrying(VAR, mark)) | (_descendants() - before)) - exempt - _process_wide()


def _check(mark: str, before: set[int], exempt: set[int], what: str) -> None:
    """Wait for what `mark` started to end; kill what is left and fail, naming it."""
    deadline = time.monotonic() + GRACE_S
    left = _left(mark, before, exempt)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _left(mark, before, exempt)
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
        left = _left(mark, before, exempt)
        if not left:
            break
    pytest.fail(f"{what} left processes running {GRACE_S:.0f} s after it ended (killed now): {named}",
                pytrace=False)


def _exempt() -> set[int]:
    return set().union(*(born for _, born in _owned.values())) if _owned else set()


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.scope == "function":
        return (yield)
    before, mark, prev = _descendants(), _new_mark(), os.environ.get(VAR)
    os.environ[VAR] = mark
    try:
        return (yield)
    finally:
        os.environ.pop(VAR) if prev is None else os.environ.__setitem__(VAR, prev)
        _owned[fixturedef] = (mark, _descendants() - before)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_post_finalizer(fixturedef, request):
    result = yield
    if fixturedef in _owned:
        mark, born = _owned.pop(fixturedef)
        _check(mark, _descendants() - born, _exempt(), f"fixture {fixturedef.argname!r}")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    item.stash[_KEY] = (_new_mark(), _descendants())
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
        _check(mark, before, _exempt(), "the test")
    return result


_KEY = pytest.StashKey[tuple]()
