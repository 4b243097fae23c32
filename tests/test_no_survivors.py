"""tests/no_survivors.py, the check every test passes through: a leak is caught however the process detached, it is
killed, and the test that left it errors, naming it; a test whose processes end passes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from ogrpo.launch import procs

HERE = Path(__file__).parent

LEAKS = '''
import os, shlex, subprocess, sys, time
import pytest

TAG = os.environ["LEAK_TAG"]


def _sleeper(name):
    # `sleep` under a name the outer test can find with `procs.mentioning`
    return ["bash", "-c", f"exec -a {TAG}-{name} sleep 600"]


def test_waits_for_its_process():
    proc = subprocess.Popen(_sleeper("waited"))
    proc.kill()
    proc.wait()


def test_leaves_a_child():
    subprocess.Popen(_sleeper("child"))


def test_leaves_a_double_forked_daemon():
    # the shell exits at once: the sleeper is reparented to init, no longer a descendant of pytest
    subprocess.run(["bash", "-c", f"setsid {shlex.join(_sleeper('daemon'))} >/dev/null 2>&1 < /dev/null &"], check=True)


def test_leaves_a_fork_without_exec():
    pid = os.fork()
    if pid == 0:
        time.sleep(600)
        os._exit(0)


@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen(_sleeper("module"))
    yield proc  # never stopped


def test_reads_a_module_fixture(server):
    assert server.poll() is None


def test_reads_it_again(server):
    assert server.poll() is None  # still up: the module fixture's process is not this test's
'''


def test_a_leak_is_caught_killed_and_named(tmp_path):
    tag = f"ogrpo-leak-{os.getpid()}"
    (tmp_path / "test_leaks.py").write_text(LEAKS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "OGRPO_TEST_SURVIVOR_GRACE_S": "2", "LEAK_TAG": tag, "COLUMNS": "1000"}
    env.pop("OGRPO_TEST_OWNER", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no_survivors", "-p", "no:cacheprovider", "-rA",
                           "-q", str(tmp_path / "test_leaks.py")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 1, out
    for name in ("test_waits_for_its_process", "test_reads_a_module_fixture", "test_reads_it_again"):
        assert f"PASSED test_leaks.py::{name}" in out, out
    # one error per leak, at the teardown of the test (or the fixture) that left it, naming the process
    for name, what in (("test_leaves_a_child", f"{tag}-child"), ("test_leaves_a_double_forked_daemon",
                                                                  f"{tag}-daemon"),
                       ("test_leaves_a_fork_without_exec", "pytest"), ("test_reads_it_again", f"{tag}-module")):
        line = next((x for x in out.splitlines() if x.startswith(f"ERROR test_leaks.py::{name} ")), "")
        assert "left processes running" in line and what in line, (name, out)
    assert "fixture 'server' left processes" in out, out
    errors = [x for x in out.splitlines() if x.startswith("ERROR test_leaks.py::")]
    assert len(errors) == 4 and not any("waited" in x for x in errors), out  # what a test waited for is not named
    time.sleep(0.5)
    assert procs.mentioning(tag) == []  # every leak was killed
