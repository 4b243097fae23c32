"""The Slurm backend on the real test cluster, with stand-in steps (tests/slurm/toy_steps.py): devices per step,
status/logs/cancel, USR2 → checkpoint → requeue → resume, and the requeue bound. The real time limit and a
forced requeue run the real trainer in test_slurm_grpo.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ogrpo.jobspec import JobSpec, Step
from ogrpo.launch import slurm as sl
from ogrpo.launch.executor import SlurmExecutor
from ogrpo.launch.slurm import query as slurm_query

from .conftest import TOY, ogrpo, processes_of_job, read_json, sacct_state, wait_for, wait_gone

pytestmark = pytest.mark.slurm


def toy_spec(job_dir: Path, total: int) -> JobSpec:
    """build_jobspec's layout: the run dir (logs/, roles/) is job_dir/run."""
    py = sys.executable
    return JobSpec(
        name="toy", job_dir=str(job_dir), health_timeout_s=60,
        steps=[
            Step("server", [0], [0], 1, [py, TOY, "server", "{server_port}"]),
            Step("trainer", [0], [1, 2], 1, [py, TOY, "trainer", "{job_dir}", str(total)]),
        ],
    )


def submit_toy(job_dir: Path, total: int, **opts) -> str:
    """Through the same path as `ogrpo submit`: preflight, job.sbatch (ogrpo.launch.slurm.sbatch.render_script),
    sbatch."""
    spec = toy_spec(job_dir, total)
    options = sl.SlurmOptions(gpus_per_node=3, time_min=opts.pop("time_min", 10), **opts)
    return SlurmExecutor(sl.preflight(spec, options)).submit(spec).job_id


def toy_state(job_dir: Path) -> dict:
    return read_json(job_dir / "toy_ckpt.json")


def wait_toy_trainer(job_dir: Path, timeout: float = 180) -> None:
    """Until the toy trainer has its signal handlers (it prints "resume at" after installing them). The step's
    record appears before Python has started: a signal sent then kills the toy unsaved, on a loaded machine."""
    log = job_dir / "run" / "logs" / "trainer.log"
    wait_for(lambda: log.exists() and "resume at" in log.read_text(), timeout, "the toy trainer to start")


def test_disjoint_devices_status_and_logs(slurm_cluster, tmp_path):
    job_dir = tmp_path / "run"
    job = submit_toy(job_dir, total=3)
    wait_gone(job, 120)
    # the job's end shows at once: the controller answers while the accounting DB (submitit's sacct) catches up
    early = json.loads(ogrpo("status", job, "--json", check=True).stdout)
    assert early["state"] == "COMPLETED", early
    assert sacct_state(job) == "COMPLETED"
    server = read_json(job_dir / "run" / "roles" / "server.step.json")
    trainer = read_json(job_dir / "run" / "roles" / "trainer.step.json")
    server_dev = set(server["cuda_visible_devices"].split(","))
    trainer_dev = set(trainer["cuda_visible_devices"].split(","))
    # 1 + 2 fake A40s of one node: each step sees only its own, and together all three
    assert len(server_dev) == 1 and len(trainer_dev) == 2
    assert not server_dev & trainer_dev
    assert server["slurm_step_id"] != trainer["slurm_step_id"]

    out = ogrpo("status", job, check=True).stdout
    assert f"job {job}: COMPLETED" in out and "trainer saw CUDA_VISIBLE_DEVICES=" in out
    info = json.loads(ogrpo("status", str(job_dir), "--json", check=True).stdout)
    assert info["state"] == "COMPLETED" and info["requeues"] == 0 and info["attempts"] == 1
    assert {s["name"] for s in info["steps"]} >= {"server", "trainer"}
    # the server, asked to stop once the trainer finished, ended like the job: not "CANCELLED by 0"
    assert {s["state"] for s in info["steps"] if s["name"] in ("server", "trainer")} == {"COMPLETED"}, info["steps"]
    assert "done 3" in ogrpo("logs", job, "--role", "trainer", check=True).stdout
    assert "server healthy" in ogrpo("logs", job, "--role", "supervisor", check=True).stdout
    # --follow returns once the job has ended
    assert "done 3" in ogrpo("logs", str(job_dir), "--follow", check=True).stdout


def test_cancel_leaves_no_process(slurm_cluster, tmp_path):
    job_dir = tmp_path / "run"
    job = submit_toy(job_dir, total=600)
    steps = [job_dir / "run" / "roles" / f"{r}.step.json" for r in ("server", "trainer")]
    # each step writes its record once it runs, in either order
    wait_for(lambda: all(p.exists() for p in steps), 90, "the server and trainer steps to start")
    pids = [read_json(p)["pid"] for p in steps]
    assert processes_of_job(job), "the running job should own processes"
    out = ogrpo("cancel", job, check=True)
    assert f"cancelled job {job}" in out.stdout
    # `ogrpo cancel` returns once Slurm has SIGKILLed stragglers (KillWait, 5 s here) and they are gone
    assert not processes_of_job(job)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]
    assert sacct_state(job) == "CANCELLED"


def test_usr2_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path):
    job_dir = tmp_path / "run"
    job = submit_toy(job_dir, total=25, max_requeues=2, signal_delay_s=30)
    wait_toy_trainer(job_dir)
    wait_for(lambda: (job_dir / "toy_ckpt.json").exists(), 60, "the toy trainer's first checkpoint")
    slurm_query.interrupt(job)  # what Slurm sends before the time limit: USR2 to the batch step
    wait_gone(job, 180)
    assert sacct_state(job) == "COMPLETED"
    state = toy_state(job_dir)
    assert state["step"] == 25
    first, second = state["attempts"]
    assert first["start"] == 0 and second["start"] > 0  # resumed from the checkpoint, not from scratch
    requeue = read_json(job_dir / "slurm" / "requeue-0.json")
    assert requeue["requeued"] and requeue["trainer_rc"] == 75 and requeue["max_requeues"] == 2
    assert requeue["checkpoint"] is None  # the stand-in trainer writes no preempted.json
    assert read_json(job_dir / "slurm" / "attempt-1.json")["restart_count"] == 1
    info = json.loads(ogrpo("status", job, "--json", check=True).stdout)
    assert info["requeues"] == 1 and info["attempts"] == 2
    assert info["restarts"] == 1  # Slurm's own count (scontrol's Restarts), which status reports as requeues
    assert "requeues: 1 of 2" in ogrpo("status", job, check=True).stdout


def test_requeue_bound(slurm_cluster, tmp_path):
    job_dir = tmp_path / "run"
    job = submit_toy(job_dir, total=600, max_requeues=0)
    wait_toy_trainer(job_dir)
    slurm_query.interrupt(job)
    wait_gone(job, 90)
    requeue = read_json(job_dir / "slurm" / "requeue-0.json")
    assert requeue["requeued"] is False and requeue["restart_count"] == 0
    assert not (job_dir / "slurm" / "attempt-1.json").exists()
    assert toy_state(job_dir)["step"] < 600  # stopped, saved, and not run again
    assert not processes_of_job(job)


def test_unknown_job_and_unreachable_controller_exit_nonzero(slurm_cluster, tmp_path):
    for cmd in (("status", "999999"), ("cancel", "999999")):
        out = ogrpo(*cmd)
        assert out.returncode != 0, (cmd, out.stdout)
        assert "Traceback" not in out.stderr and out.stderr.strip().count("\n") == 0, out.stderr
    assert "not known to Slurm" in ogrpo("status", "999999").stderr
    # the same cluster, but a controller port nothing listens on
    conf = tmp_path / "slurm.conf"
    text = Path(slurm_cluster).read_text()
    conf.write_text("\n".join("SlurmctldPort=1" if ln.startswith("SlurmctldPort=") else ln
                              for ln in text.splitlines()) + "\n")
    out = ogrpo("status", "1", env={"SLURM_CONF": str(conf)})
    assert out.returncode != 0 and "cannot reach the Slurm controller" in out.stderr, out.stderr
