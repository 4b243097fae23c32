"""The launcher interface (ogrpo.launch.handle): a local run started detached or in the foreground is found again
from its run directory, and `ogrpo status/logs/cancel RUN_DIR` work on it as on a Slurm job. Fake roles (from
test_supervisor) keep these in seconds; one real detached run of the tiny recipe closes the loop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ogrpo.errors import OgrpoError
from ogrpo.launch.local import state as ls
from ogrpo.launch.executor import find, submit
from ogrpo.launch.local import LocalJob, run_local, start_detached
from ogrpo.launch.supervisor import group_members
from test_supervisor import fake_job

OGRPO = [sys.executable, "-m", "ogrpo"]
RECIPES = Path(__file__).resolve().parents[1] / "ogrpo" / "recipes"


def ogrpo(*args, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*OGRPO, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def step_pids(job_dir: Path) -> list[int]:
    return [json.loads(p.read_text())["pid"] for p in (job_dir / "run" / "roles").glob("*.json")]


def nothing_left(job_dir: Path, rec: dict) -> bool:
    return not ls.is_alive(rec["pid"], rec.get("proc_start")) and not any(group_members(p) for p in step_pids(job_dir))


@pytest.fixture(autouse=True)
def _sweep(tmp_path):
    """A failing test must not leave its 600 s fake steps running on a shared machine."""
    yield
    for job_dir in {p.parents[2] for p in tmp_path.glob("**/run/roles/*.json")}:
        rec = ls.read_state(job_dir) or {}
        groups = step_pids(job_dir) + ([rec["pid"]] if rec.get("pgid") else [])
        for g in groups:
            if group_members(g):
                os.killpg(g, signal.SIGKILL)


def started(tmp_path: Path, train_s: float) -> LocalJob:
    job = start_detached(fake_job(tmp_path, train_s=train_s))
    deadline = time.monotonic() + 30
    while len(step_pids(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    return job


# -- the record ------------------------------------------------------------------------------------------------
def test_state_file_is_replaced_whole_and_final_states_follow_exit_codes(tmp_path):
    ls.write_state(tmp_path, {"state": "RUNNING", "pid": 1})
    ls.write_state(tmp_path, {"state": "COMPLETED", "pid": 1, "exit_code": 0})
    assert ls.read_state(tmp_path)["state"] == "COMPLETED"
    assert [p.name for p in (tmp_path / "local").iterdir()] == ["state.json"]  # no temp file left behind
    assert [ls.final_state(rc) for rc in (0, 1, 143, 130, 129, 137)] == \
        ["COMPLETED", "FAILED", "CANCELLED", "CANCELLED", "CANCELLED", "FAILED"]


def test_a_reused_pid_or_a_zombie_is_not_the_run(tmp_path):
    me = ls.running_record()
    assert ls.record_alive(me)
    assert not ls.record_alive({**me, "proc_start": me["proc_start"] - 3600})  # same pid, another process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not ls.is_alive(child.pid)  # exited, not yet reaped
    child.wait()


# -- detached runs ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_detached_run_completes_and_is_found_from_its_run_dir(tmp_path):
    job = submit(fake_job(tmp_path, train_s=0.5), backend="local")
    assert job.wait(timeout_s=60, poll_s=0.2) == "COMPLETED" and job.exit_code() == 0
    again = find(str(tmp_path))
    assert isinstance(again, LocalJob) and again.state() == "COMPLETED"
    assert find(str(tmp_path / "run")).job_dir == tmp_path.resolve()  # the trainer's output dir finds it too

    out = ogrpo("status", tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"job {tmp_path.name}: COMPLETED") and "exit 0" in out.stdout.splitlines()[0]
    assert "attempts:" not in out.stdout  # Slurm bookkeeping stays out of a local status
    info = json.loads(ogrpo("status", tmp_path, "--json").stdout)
    assert info["backend"] == "local" and info["exit_code"] == "0" and info["job_dir"] == str(tmp_path.resolve())
    assert "trained" in ogrpo("logs", tmp_path, "--role", "trainer").stdout
    assert "trainer finished" in ogrpo("logs", tmp_path, "--role", "supervisor").stdout
    every = ogrpo("logs", tmp_path).stdout
    assert "supervisor.log <==" in every and "trainer.log <==" in every and "server.log <==" in every
    late = ogrpo("cancel", tmp_path)
    assert late.returncode != 0 and "already ended (COMPLETED)" in late.stderr
    assert late.stderr.strip().count("\n") == 0


def test_cancel_stops_a_detached_run_and_leaves_no_process(tmp_path):
    job = started(tmp_path, train_s=600)
    rec = job.record()
    assert job.state() == "RUNNING" and rec["pgid"] == rec["pid"]  # its own session: cancel signals the group
    follow = subprocess.Popen([*OGRPO, "logs", str(tmp_path), "--follow", "--role", "supervisor"],
                              stdout=subprocess.PIPE, text=True)
    manifest = tmp_path / "run" / "manifest.json"
    manifest.write_text(json.dumps({"status": "running"}))  # what the trainer's rank 0 writes when it starts
    t0 = time.monotonic()
    out = ogrpo("cancel", tmp_path)
    assert out.returncode == 0 and f"cancelled job {tmp_path.name}" in out.stdout, out.stderr
    assert time.monotonic() - t0 < 30
    assert nothing_left(tmp_path, rec)
    assert job.state() == "CANCELLED" and job.exit_code() == 128 + signal.SIGTERM
    assert json.loads(manifest.read_text())["status"] == "cancelled"
    assert (tmp_path / "run" / "cancel.json").exists()  # what told the trainer it was a cancel, not a preemption
    # --follow ends with the run, after its last lines
    text, _ = follow.communicate(timeout=30)
    assert follow.returncode == 0 and "received SIGTERM" in text


def test_a_killed_run_is_lost_not_running_and_cancel_sweeps_its_steps(tmp_path):
    job = started(tmp_path, train_s=600)
    rec = job.record()
    os.kill(rec["pid"], signal.SIGKILL)  # the supervisor dies without teardown: its steps are orphans
    deadline = time.monotonic() + 10
    while ls.is_alive(rec["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    out = ogrpo("status", tmp_path)
    assert out.returncode == 0 and out.stdout.startswith(f"job {tmp_path.name}: LOST"), out.stdout
    assert "recorded no end" in out.stdout and "its steps still run" in out.stdout
    assert ogrpo("cancel", tmp_path).returncode == 0
    assert nothing_left(tmp_path, rec)
    again = ogrpo("cancel", tmp_path)  # nothing left to stop now
    assert again.returncode != 0 and "already ended (LOST" in again.stderr


def test_a_run_dir_with_a_live_run_refuses_a_second_run(tmp_path):
    job = started(tmp_path, train_s=600)
    try:
        with pytest.raises(OgrpoError, match="already has a running job"):
            run_local(tmp_path)
    finally:
        job.cancel()
    assert nothing_left(tmp_path, job.record())


# -- foreground runs -------------------------------------------------------------------------------------------
def test_foreground_run_records_itself_and_cancel_reaches_it(tmp_path):
    spec = fake_job(tmp_path, train_s=600)
    (tmp_path / "jobspec.json").write_text(json.dumps(spec.to_dict()))
    # the foreground path of `ogrpo submit --backend local`: run_local in the caller's process group
    fg = subprocess.Popen([sys.executable, "-c", f"import sys; from ogrpo.launch.local import run_local; "
                           f"sys.exit(run_local({str(tmp_path)!r}, follow=None))"],
                          stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while len(step_pids(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    job = find(str(tmp_path))
    rec = job.record()
    assert job.state() == "RUNNING" and rec["pid"] == fg.pid and rec["pgid"] is None  # not the terminal's group
    assert ogrpo("cancel", tmp_path).returncode == 0
    _, err = fg.communicate(timeout=30)
    assert fg.returncode == 128 + signal.SIGTERM and "received SIGTERM" in err
    assert job.state() == "CANCELLED" and nothing_left(tmp_path, rec)
    assert "received SIGTERM" in (tmp_path / "logs" / "supervisor.log").read_text()  # also on file


# -- bad input -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", ["status", "logs", "cancel"])
def test_bad_refs_are_one_line_errors(tmp_path, cmd):
    for ref in (tmp_path, tmp_path / "missing", "not-a-job"):
        out = ogrpo(cmd, ref)
        assert out.returncode == 2, (ref, out.stdout, out.stderr)
        assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr, out.stderr
    assert "not the run directory of a submitted job" in ogrpo(cmd, tmp_path).stderr
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "state.json").write_text("{not json")
    out = ogrpo(cmd, tmp_path)
    assert out.returncode == 2 and "no readable local/state.json" in out.stderr


# -- the real thing --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tiny_recipe_runs_detached_and_completes(tmp_path):
    recipe = tmp_path / "tiny.yaml"
    text = (RECIPES / "tiny.yaml").read_text()
    recipe.write_text(text.replace("max_steps: 30", "max_steps: 2").replace("save_steps: 10", "save_steps: 2"))
    job_dir = tmp_path / "job"
    t0 = time.monotonic()
    out = ogrpo("submit", "--backend", "local", "--gpus", "cpu", "--config", recipe, "-o", job_dir, "--detach")
    assert out.returncode == 0, out.stderr[-3000:]
    assert time.monotonic() - t0 < 20  # returned at once, not after the run
    assert f"ogrpo logs {job_dir} --follow" in out.stdout
    follow = ogrpo("logs", job_dir, "--follow", "--role", "trainer", timeout=300)
    assert follow.returncode == 0
    info = json.loads(ogrpo("status", job_dir, "--json").stdout)
    assert info["state"] == "COMPLETED", (info, ogrpo("logs", job_dir).stdout[-3000:])
    assert info["last_checkpoint"] == "checkpoint-2" and info["last_metrics"]
    assert "train_runtime" in follow.stdout or "reward" in follow.stdout


def test_a_failed_run_says_so_in_its_manifest(tmp_path):
    """A trainer that dies without recording its end (a crash, a kill) leaves `failed`, not `running`."""
    crash = ("import json, pathlib, sys; run = pathlib.Path(sys.argv[1]) / 'run'; run.mkdir(exist_ok=True); "
             "(run / 'manifest.json').write_text(json.dumps({'status': 'running'})); sys.exit(3)")
    spec = fake_job(tmp_path, trainer_argv=[sys.executable, "-c", crash, "{job_dir}"])
    assert run_local(spec, follow=None) == 3
    data = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert data["status"] == "failed" and "trainer exited with code 3" in data["error"]
