"""The test Slurm cluster (tests/slurm/cluster.sh): used when already up, else started here and stopped after."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).parent
ROOT = os.environ.get("ROOT") or os.environ.get("OGRPO_SLURM_ROOT") or "/tmp/ogrpo-slurm-test"
TOY = str(HERE / "toy_steps.py")


def _reachable() -> bool:
    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    return out.returncode == 0 and any(s in out.stdout for s in ("idle", "mix", "alloc"))


@pytest.fixture(scope="session")
def slurm_cluster():
    os.environ.setdefault("SLURM_CONF", f"{ROOT}/etc/slurm.conf")
    started = False
    if not (Path(os.environ["SLURM_CONF"]).exists() and _reachable()):
        if os.geteuid() != 0 and shutil.which("slurmctld") is None:
            pytest.skip("no Slurm: run `sudo tests/slurm/cluster.sh up` first")
        subprocess.run(["bash", str(HERE / "cluster.sh"), "up"], check=True, env={**os.environ, "ROOT": ROOT})
        started = True
    yield os.environ["SLURM_CONF"]
    if started:
        subprocess.run(["bash", str(HERE / "cluster.sh"), "down"], check=False, env={**os.environ, "ROOT": ROOT})


@pytest.fixture(scope="session")
def grpo_reference(slurm_cluster, tmp_path_factory):
    """The uninterrupted tiny GRPO run on the test cluster (test_slurm_grpo.run_reference), made once for every
    test that compares a resumed run with it."""
    from .test_slurm_grpo import run_reference

    return run_reference(tmp_path_factory.mktemp("grpo-ref"))


def _queued_jobs() -> set[str]:
    """Job ids (an array's own id for its tasks) in this test cluster's queue; none when Slurm does not answer."""
    try:
        out = subprocess.run(["squeue", "-h", "-o", "%F"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return set()
    return set(out.stdout.split()) if out.returncode == 0 else set()


_PASSED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.stash[_PASSED] = report.passed
    return report


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test(request):
    """A test that fails between its submit and its cancel (or its wait) left its job running, and every later
    test then queued behind it until its time limit: one failure became two in CI. Whatever a test submitted
    and left in the queue is cancelled when it ends; a test that passed and left one errors (it started a job it
    did not see end: tests/no_survivors.py's rule, for the queue). Session and module fixtures wait for their
    own jobs to end before they return, so none of theirs is counted here."""
    if "slurm_cluster" not in request.fixturenames:
        yield
        return
    before = _queued_jobs()
    yield
    left = _queued_jobs() - before
    deadline = time.monotonic() + 30  # a job the test saw end may still be completing in the controller's queue
    while left and time.monotonic() < deadline:
        time.sleep(1)
        left &= _queued_jobs()
    if left:
        subprocess.run(["scancel", *sorted(left)], check=False, capture_output=True)
        deadline = time.monotonic() + 120
        while _queued_jobs() & left and time.monotonic() < deadline:
            time.sleep(1)
        if request.node.stash.get(_PASSED, False):
            pytest.fail(f"the test left Slurm job(s) {', '.join(sorted(left))} in the queue (cancelled now)",
                        pytrace=False)


def _job_log_tail(job_id: str, chars: int = 3000) -> str:
    """The end of the job's batch log (StdOut), for a failure message that says where the job was."""
    from ogrpo.launch.slurm.parse import key_values

    out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True)
    job = key_values(out.stdout)
    state = " ".join(f"{k}={job[k]}" for k in ("JobState", "Reason", "RunTime") if k in job)
    path = job.get("StdOut", "")
    try:
        tail = Path(path).read_text(errors="replace")[-chars:] if path else ""
    except OSError:
        tail = ""
    return f"{state}\n{tail}"


def wait_gone(job_id: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True)
        if not out.stdout.strip():
            return
        time.sleep(1)
    raise AssertionError(f"job {job_id} still in squeue after {timeout}s: {_job_log_tail(job_id)}")


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def sacct_state(job_id: str, timeout: float = 30) -> str:
    """The job's final state in the accounting DB. slurmdbd records asynchronously: for a moment after a job
    leaves squeue its row may still say RUNNING, or be missing."""
    state, deadline = "", time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", str(job_id), "-o", "State"], capture_output=True,
                             text=True)
        state = out.stdout.split()[0] if out.stdout.split() else ""
        if state and state not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "SUSPENDED"):
            break
        time.sleep(0.5)
    return state


def ogrpo(*args: str, check: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "ogrpo", *args], capture_output=True, text=True,
                         env={**os.environ, **(env or {})}, timeout=300)
    if check and out.returncode != 0:
        raise AssertionError(f"ogrpo {' '.join(args)} -> {out.returncode}\n{out.stdout}\n{out.stderr}")
    return out


def render_job(recipe: dict, job_dir: Path, gpus: str, deterministic_server: bool = False) -> None:
    """`ogrpo render` of `recipe` (written beside JOB_DIR) into JOB_DIR. `deterministic_server`: the job's plan then
    runs the server one sequence at a time without a prefix cache (tests/overlap_jobs.py), so that a completion is
    a function of the prompt, the seed and the weights only, across server restarts."""
    cfg = job_dir.parent / f"{job_dir.name}-recipe.yaml"
    cfg.write_text(yaml.safe_dump(recipe))
    ogrpo("render", "--gpus", gpus, "--config", str(cfg), "-o", str(job_dir), check=True)
    if deterministic_server:
        from overlap_jobs import DETERMINISTIC_SERVER

        run_yaml = job_dir / "run.yaml"
        plan = yaml.safe_load(run_yaml.read_text())
        plan["ogrpo"]["plan"]["vllm"]["args"].update(DETERMINISTIC_SERVER)
        run_yaml.write_text(yaml.safe_dump(plan))


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def read_jsonl(path: Path) -> list[dict]:
    """The rows written so far ([] before the file exists: a run directory read while the job runs)."""
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return []


def venv_env(**extra: str) -> dict:
    """What a user's shell has after activating the venv: its python3 first on PATH, no OGRPO_PYTHON."""
    env = {k: v for k, v in os.environ.items() if k != "OGRPO_PYTHON"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return {**env, **extra}


def processes_of_job(job_id: str) -> list[int]:
    """PIDs whose environment says they belong to Slurm job JOB_ID (what a cancelled job must not leave)."""
    pids = []
    needle = f"SLURM_JOB_ID={job_id}\0".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if needle in (d / "environ").read_bytes():
                pids.append(int(d.name))
        except OSError:
            continue
    return pids
