"""Fail closed: without an isolating level code rewards refuse to run, unless the recipe opts out (`ogrpo.sandbox:
none`, a listed change with a warning); the level is logged once and recorded in the manifest; the status
report is data; the seccomp filter's tables, architecture check and compatibility with compilers.

"A node without namespaces" is made real, not mocked: the trainer process installs the sandbox's own seccomp
filter on itself before starting (it refuses unshare and clone(CLONE_NEW*), as Docker's default profile does),
so the sandbox's probe meets the kernel's EPERM.
"""

from __future__ import annotations

import json
import marshal
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ogrpo.sandbox import policy as sandbox_policy
from ogrpo.sandbox import seccomp as sandbox_seccomp
from ogrpo.sandbox.pool import OK, Job, Sandbox, parse_report

REPO = Path(__file__).resolve().parents[1]
OGRPO = Path(sys.executable).with_name("ogrpo")
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("g++") is None, reason="needs gcc/g++")

# Runs argv[1:] under the filter (no_new_privs first, as the kernel requires without privilege).
NO_NAMESPACES = """
import ctypes, os, sys
sys.path.insert(0, {repo!r})
from ogrpo.sandbox import seccomp as sandbox_seccomp
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0
# a node without namespaces, not a sandboxed program: the trainer's pool still takes its slot uids' file locks
# and makes its runs' memfds
sandbox_seccomp.DENIED = tuple(n for n in sandbox_seccomp.DENIED if n not in ("flock", "memfd_create"))
sandbox_seccomp.FCNTL_LOCKS = ()
sandbox_seccomp.install(libc, (1, 2, 10))
os.execv(sys.argv[1], sys.argv[1:])
"""

TRAINER = """
import json, sys
sys.path.insert(0, {repo!r})
from ogrpo.errors import OgrpoError
from ogrpo.rewards import code as code_rewards
from ogrpo.sandbox import policy as sandbox_policy
from ogrpo.sandbox.pool import Sandbox
out = {{}}
try:
    Sandbox(max_workers=1)
    out["auto"] = "ran"
except OgrpoError as exc:
    out["auto"] = str(exc)
info = [{{"test_cases": [{{"input": "", "output": "hi"}}]}}]
try:
    out["reward"] = code_rewards.code_reward(["```python\\nprint('hi')\\n```"], info)
except OgrpoError as exc:
    out["reward"] = str(exc)
sandbox_policy._option = "none"  # the recipe's opt-in (configure() sets it from ogrpo.sandbox)
sandbox_policy._default = None
out["opted_in"] = code_rewards.code_reward(["```python\\nprint('hi')\\n```"], info)
out["summary"] = sandbox_policy.summary()
print(json.dumps(out))
"""


def _without_namespaces(*argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_NAMESPACES.format(repo=str(REPO)), *argv], capture_output=True,
                          text=True, timeout=300, **kw)


def test_code_rewards_refuse_without_an_isolating_level_unless_opted_in(tmp_path):
    res = _without_namespaces(sys.executable, "-c", TRAINER.format(repo=str(REPO)), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    for key in ("auto", "reward"):
        assert out[key].startswith("sandbox: no isolating level works on this node"), out[key]
        assert "\n" not in out[key] and "ogrpo: {sandbox: none}" in out[key]
    assert out["opted_in"] == [1.0]  # the explicit opt-in runs the program (at the "none" level)
    assert out["summary"]["isolation"] == "none"
    assert "sandbox: none" in res.stderr  # logged when the pool was made


def _recipe(tmp_path: Path, sandbox: str | None) -> Path:
    text = (REPO / "ogrpo/recipes/tiny-code.yaml").read_text()
    if sandbox is not None:
        text = re.sub(r"^ogrpo:\n", f"ogrpo:\n  sandbox: {sandbox}\n", text, flags=re.M)
    path = tmp_path / f"code-{sandbox}.yaml"
    path.write_text(text)
    return path


def test_local_submit_exits_2_at_plan_time_without_isolation(tmp_path):
    argv = [str(OGRPO), "submit", "--backend", "local", "--gpus", "cpu", "--dry-run", "--output", str(tmp_path / "j")]
    refused = _without_namespaces(*argv, "--config", "tiny-code", cwd=tmp_path)
    assert refused.returncode == 2
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no isolating level" in errors[0] and "Traceback" not in refused.stderr
    opted = _without_namespaces(*argv, "--config", str(_recipe(tmp_path, "none")), cwd=tmp_path)
    assert opted.returncode == 0, opted.stderr[-2000:]
    assert "change: ogrpo.sandbox: 'auto' -> 'none'" in opted.stderr
    assert "warning: ogrpo.sandbox: none" in opted.stderr


def test_plan_lists_the_opt_out_only_with_code_rewards(tmp_path):
    res = subprocess.run([str(OGRPO), "plan", "--gpus", "cpu", "--config", str(_recipe(tmp_path, "none")), "--strict"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 2 and "ogrpo.sandbox would change from 'auto' to 'none'" in res.stderr
    from ogrpo.config import load_run_config
    from ogrpo.errors import ConfigError
    from ogrpo.plan import plan_from_config

    # the planner lists it (not a step after it): every path to a plan has it, plan_from_config's included
    opted = plan_from_config(load_run_config(str(_recipe(tmp_path, "none"))))
    assert opted.change("ogrpo.sandbox").new == "none" and opted.warnings[-1].startswith("ogrpo.sandbox: none")
    assert opted.changes[-1].key == "ogrpo.sandbox"  # after the planner's own changes, as plan --json lists it
    rc = load_run_config(str(_recipe(tmp_path, "none")), {"reward_funcs": ["code_format"]})
    plan = plan_from_config(rc)
    assert plan.change("ogrpo.sandbox") is None  # no program runs: nothing changes
    assert not any(w.startswith("ogrpo.sandbox") for w in plan.warnings)
    assert plan_from_config(load_run_config(str(_recipe(tmp_path, None)))).change("ogrpo.sandbox") is None
    with pytest.raises(ConfigError, match="ogrpo.sandbox: 'maybe' is not one of auto, none"):
        load_run_config(str(_recipe(tmp_path, "maybe")))


def test_level_is_logged_once_and_recorded_in_the_manifest(tmp_path, monkeypatch, capsys):
    from ogrpo.config import load_run_config
    from ogrpo.rewards import code as code_rewards
    from ogrpo.trainer import rundir

    monkeypatch.setattr(sandbox_policy, "_default", None)
    monkeypatch.setattr(sandbox_policy, "_summary", None)
    rc = load_run_config("tiny-code")
    summary = sandbox_policy.configure(rc)
    code_rewards.default_sandbox()  # the same pool: no second line
    logged = [line for line in capsys.readouterr().err.splitlines() if line.startswith("sandbox:")]
    assert len(logged) == 1 and summary["isolation"] in ("root", "userns")
    monkeypatch.setattr(rundir, "hardware", lambda: {})
    path = rundir.write_manifest(tmp_path, config={}, plan={}, seed=0, model_path="m")
    assert json.loads(path.read_text())["sandbox"] == summary


def test_status_report_is_validated_data():
    good = {"returncode": 3, "signal": None, "cpu_s": 0.1, "wall_s": 0.2}
    assert parse_report(json.dumps(good).encode()) == good
    assert parse_report(b"") == {}
    for bad in (marshal.dumps(good), b'{"returncode": 0}{"returncode": 1}', b'[0]', b'{"returncode": true}',
                b'{"returncode": 0, "exec": "x"}', b"\xff"):
        assert parse_report(bad) == {"error": "sandbox: malformed status report"}, bad


def _header_numbers(path: str, pattern: str) -> dict[str, int]:
    text = Path(path).read_text() if Path(path).exists() else ""
    return {m.group(1): int(m.group(2)) for m in re.finditer(pattern, text)}


@pytest.mark.parametrize("arch, header, pattern", [
    ("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h", r"#define __NR_(\w+)\s+(\d+)"),
    ("aarch64", "/usr/include/asm-generic/unistd.h", r"#define __NR(?:3264)?_(\w+)\s+(\d+)"),
])
def test_syscall_numbers_match_the_kernel_headers(arch, header, pattern):
    numbers = _header_numbers(header, pattern)
    if not numbers:
        pytest.skip(f"{header} is not installed")
    table = sandbox_seccomp.SYSCALLS[arch]
    assert {name: numbers.get(name) for name in table} == table
    assert set(sandbox_seccomp.DENIED) <= set(table) | set(sandbox_seccomp.UNIFIED)
    assert set(sandbox_seccomp.SELF_ONLY) <= set(table) and not set(table) & set(sandbox_seccomp.UNIFIED)


@needs_gcc
def test_other_architecture_calls_are_killed_and_compilers_still_work(tmp_path):
    with Sandbox(max_workers=2, tmp_root=str(tmp_path)) as box:
        jobs = [Job('#include <iostream>\n#include <thread>\nint main(){std::thread t([]{std::cout<<"cpp\\n";});'
                    't.join();}', "cpp"),
                Job("import asyncio, subprocess, threading\nasync def f(): return 'py'\n"
                    "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
                    "print(asyncio.run(f()), subprocess.run(['/bin/echo', 'sub'], capture_output=True).stdout)")]
        if sandbox_seccomp.machine() == "x86_64":  # an i386 getpid through int 0x80 walks past a x86_64 filter
            jobs.append(Job('int main(void){int r; __asm__ volatile("int $0x80":"=a"(r):"a"(20)); return r==0;}', "c"))
        results = box.run_jobs(jobs)
    cpp, py = results[0].runs[0], results[1].runs[0]
    assert (cpp.status, cpp.stdout) == (OK, "cpp\n"), cpp.stderr
    assert py.status == OK and py.stdout.split() == ["thread", "py", "b'sub\\n'"], py.stderr
    if len(results) > 2:
        assert results[2].runs[0].signal == signal.SIGSYS  # killed by the filter's architecture check
