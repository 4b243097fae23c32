"""Stopping a job on the test cluster: `ogrpo cancel` returns only when no process of the job is left, a requeue
and a cancel are told apart, `scancel --signal=TERM` (the steps only) checkpoints and requeues as the time-limit
warning does, and a Slurm that cannot answer gives one line and exit 2 in seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ogrpo.jobspec import JobSpec, Step
from ogrpo.launch import ports as ports_mod
from ogrpo.launch import slurm as sl
from ogrpo.launch.executor import SlurmExecutor

from .conftest import TOY, ogrpo, processes_of_job, read_json, sacct_state, wait_for, wait_gone
from .test_slurm_mechanics import submit_toy, toy_state, wait_toy_trainer

pytestmark = pytest.mark.slurm

WORKER = str(Path(__file__).with_name("cancel_steps.py"))


def of_job(job_id: str) -> list[int]:
    """processes_of_job, less those of another test cluster's job of the same number (its own SLURM_CONF)."""
    ours = Path(os.environ["SLURM_CONF"]).resolve()
    out = []
    for pid in processes_of_job(job_id):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        conf = next((e[len(b"SLURM_CONF="):].decode() for e in env if e.startswith(b"SLURM_CONF=")), None)
        if conf is None or Path(conf).resolve() == ours:
            out.append(pid)
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_cancel_returns_when_no_process_of_the_job_is_left(slurm_cluster, tmp_path):
    """A worker under a real `accelerate launch` that does not stop on SIGTERM (a trainer inside a long step):
    accelerate's launcher dies of the SIGTERM, and without the step wrapper the worker escaped Slurm's tracking
    (reparented to PID 1) and outlived the cancel."""
    job_dir = tmp_path / "job"
    launch = ["accelerate", "launch", "--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision",
              "no", "--dynamo_backend", "no"]
    spec = JobSpec(name="cancel", job_dir=str(job_dir), health_timeout_s=120, steps=[
        Step("server", [0], [], 1, [sys.executable, TOY, "server", "{server_port}"]),
        Step("trainer", [0], [], 1, [*launch, WORKER, "worker", "{job_dir}"]),
    ])
    job = SlurmExecutor(sl.preflight(spec, sl.SlurmOptions(time_min=10))).submit(spec).job_id
    wait_for(lambda: (job_dir / "worker.json").exists(), 180, "the worker under accelerate to start")
    roles = job_dir / "run" / "roles"
    trainer, server = read_json(roles / "trainer.step.json"), read_json(roles / "server.step.json")
    worker = read_json(job_dir / "worker.json")
    assert worker["ppid"] == trainer["pgid"], "the worker should run under accelerate's launcher"
    supervisor = read_json(job_dir / "slurm" / "attempt-0.json")["supervisor_pid"]
    pids = {"supervisor": supervisor, "server wrapper": server["pid"], "server": server["pgid"],
            "trainer wrapper": trainer["pid"], "accelerate launcher": trainer["pgid"], "worker": worker["pid"]}
    assert all(_alive(p) for p in pids.values()), pids
    job_ports = [v for k, v in read_json(job_dir / "run" / "ports.json").items() if k in ("server", "rendezvous",
                                                                                           "group")]

    t0 = time.monotonic()
    out = ogrpo("cancel", job)
    took = time.monotonic() - t0
    # the moment it returns: nothing of the job on this machine
    left = {name: p for name, p in pids.items() if _alive(p)}
    assert out.returncode == 0, out.stderr
    assert not left and not of_job(job), (left, of_job(job))
    assert f"cancelled job {job}" in out.stdout
    assert took < 90, took  # KillWait (5 s) + Slurm's bookkeeping, on a loaded machine
    assert read_json(job_dir / "worker-sigterm.json")["reason"] == "cancel"  # what the trainer would decide
    assert read_json(job_dir / "run" / "manifest.json")["status"] == "cancelled"
    log = (job_dir / "logs" / f"slurm-{job}.out").read_text()
    assert "the job was cancelled" in log and "job failed" not in log, log[-2000:]
    assert not [p for p in job_ports if (ports_mod.LOCK_DIR / f"{p}.lock").exists()]
    assert sacct_state(job) == "CANCELLED"
    status = ogrpo("status", job, check=True).stdout
    assert "=None" not in status and "trainer: CPU step" in status, status


def test_scancel_signal_term_to_the_steps_checkpoints_and_requeues(slurm_cluster, tmp_path):
    """A site that signals the steps only: the server dies of it, the trainer saves at the end of its step,
    the supervisor requeues, and the next attempt resumes."""
    job_dir = tmp_path / "run"
    job = submit_toy(job_dir, total=20, max_requeues=2, signal_delay_s=30)
    wait_toy_trainer(job_dir)
    time.sleep(3)
    subprocess.run(["scancel", "--signal=TERM", job], check=True)
    wait_gone(job, 240)
    log = (job_dir / "logs" / f"slurm-{job}.out").read_text()
    assert sacct_state(job) == "COMPLETED", log[-3000:]
    state = toy_state(job_dir)
    assert state["step"] == 20
    first, second = state["attempts"]
    assert first["start"] == 0 and second["start"] > 0  # resumed from the checkpoint, not from scratch
    requeue = read_json(job_dir / "slurm" / "requeue-0.json")
    assert requeue["requeued"] and requeue["trainer_rc"] == 75
    assert "got SIGTERM while the job runs on" in log and "job failed" not in log, log[-3000:]
    # the server of the finished second attempt was asked to stop, not cancelled
    steps = json.loads(ogrpo("status", job, "--json", check=True).stdout)["steps"]
    assert [s["state"] for s in steps if s["name"] == "server"][-1] == "COMPLETED", steps


def test_requeue_is_not_logged_as_a_failure(slurm_cluster, tmp_path):
    job_dir = tmp_path / "run"
    job = submit_toy(job_dir, total=600)
    # its first checkpoint (step 5): a requeue before the toy trainer saved would leave nothing to read below
    wait_for(lambda: (job_dir / "toy_ckpt.json").exists(), 180, "the toy trainer's first checkpoint")
    subprocess.run(["scontrol", "requeue", job], check=True)
    wait_for(lambda: (job_dir / "slurm" / "attempt-1.json").exists(), 120, "the requeued attempt")
    log = (job_dir / "logs" / f"slurm-{job}.out").read_text()
    assert "Slurm is requeueing the job" in log and "job failed" not in log, log[-3000:]
    assert toy_state(job_dir)["attempts"][0]["start"] == 0
    assert ogrpo("cancel", job).returncode == 0
    assert not of_job(job)


@pytest.mark.parametrize("broken", ["missing conf", "controller down"])
def test_unreachable_slurm_is_one_line_and_exit_2_in_seconds(slurm_cluster, tmp_path, broken):
    if broken == "missing conf":
        conf, expect = "/nonexistent/slurm.conf", "SLURM_CONF=/nonexistent/slurm.conf does not exist"
    else:  # the test cluster's config with a controller port nothing listens on
        text = Path(slurm_cluster).read_text()
        path = tmp_path / "slurm.conf"
        path.write_text("\n".join("SlurmctldPort=1" if ln.startswith("SlurmctldPort=") else ln
                                  for ln in text.splitlines()) + "\n")
        conf, expect = str(path), "cannot reach the Slurm controller"
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text("model_name_or_path: ogrpo:tiny\ndataset_name: ogrpo:tiny\nreward_funcs: [tiny_letter]\n"
                   "max_steps: 2\nmax_completion_length: 12\nogrpo:\n  use_vllm: false\n  max_prompt_length: 64\n")
    for args in (("status", "424242"), ("cancel", "424242"), ("logs", "424242"),
                 ("submit", "--gpus", "cpu", "--config", str(cfg), "--backend", "slurm", "-o", str(tmp_path / "j"))):
        t0 = time.monotonic()
        out = ogrpo(*args, env={"SLURM_CONF": conf})
        took = time.monotonic() - t0
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and expect in lines[-1], (args, out.returncode, out.stderr)
        # one line of error (submit prints the plan's changes first)
        assert "Traceback" not in out.stderr and (args[0] == "submit" or len(lines) == 1), (args, out.stderr)
        assert took < 10, (args, took)
    # rendering for another cluster than the one this machine reaches stays a documented use
    if broken == "missing conf":
        ogrpo("render", "--gpus", "cpu", "--config", str(cfg), "-o", str(tmp_path / "r"), check=True,
              env={"SLURM_CONF": conf})
