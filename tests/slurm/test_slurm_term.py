"""SIGTERM while the job runs on, on the test cluster, with a real vLLM server in every overlap mode and without
a server. One job per placement/mode, signalled twice:

- attempt 0: `scancel --signal=TERM JOB` (what a preemption sends every step before KillWait; here nobody
  SIGKILLs): the server exits (vLLM exits 0 on SIGTERM), which is the job's stop, not a failure; the trainer
  saves what it can (the step, or its last complete checkpoint when the step needed the server) and the job
  requeues. Before: "server exited mid-run", the trainer killed before it saved, FAILED.
- attempt 1: `scancel -b --signal=TERM JOB` (the batch step only): the supervisor has the trainer save the step
  it is in, as on the time-limit warning (the server keeps answering), and the job requeues. Before: every step
  stopped at once, the step lost, no requeue.
- attempt 2 runs to max_steps: every step logged once, no step and no checkpoint past max_steps, the manifest
  `finished`, nothing of the job left.

The trainer step is held (SIGSTOP) while each signal is sent, so that it lands mid-run at any machine speed;
pausing computes nothing.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import yaml

from .conftest import ogrpo, processes_of_job, read_json, read_jsonl, sacct_state, venv_env, wait_for, wait_gone

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.integration]
REPO = Path(__file__).resolve().parents[2]
STEPS = 8


def _steps(run: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def _trainer_step(job: str, run: Path, attempt: int) -> str:
    def record():
        try:
            rec = read_json(run / "roles" / "trainer.step.json")
        except (OSError, ValueError):
            return None
        return rec if rec.get("restart_count") == attempt else None

    return f"{job}.{wait_for(record, 600, f'the trainer step of attempt {attempt}')['slurm_step_id']}"


def _hold_and_signal(job: str, run: Path, attempt: int, after: int, scancel: list[str]) -> int:
    """Once step `after` is logged in attempt `attempt`: hold the trainer, send `scancel` args, let it go on.
    Returns the last step logged when the signal was sent."""
    step = _trainer_step(job, run, attempt)
    wait_for(lambda: max(_steps(run), default=0) >= after, 900, f"step {after} (attempt {attempt})")
    subprocess.run(["scancel", "--signal=STOP", step], check=True)
    logged = max(_steps(run))
    assert logged < STEPS, "the job ran to its end before the signal: nothing was tested"
    subprocess.run(["scancel", *scancel, job], check=True)
    time.sleep(1)  # the signal is delivered before the trainer runs on
    subprocess.run(["scancel", "--signal=CONT", step], check=False)
    return logged


# `lossless` and `one-step` take the same supervisor and client path as `off` (a server that exits on TERM, a
# bounded request): each adds three server starts (~5 min on CI), so they wait until the suite has that time.
# Without a server the same signals must save and requeue too. tests/slurm runs beside the rest of the suite
# (tests/run-all.sh), shorter than it, so a job here adds no wall time.
@pytest.fixture(scope="module", params=["off", "no-server"])
def termed_job(request, slurm_cluster, tmp_path_factory):
    """(mode, job id, job dir, {attempt: last step logged when signalled}) of a finished, twice-signalled job."""
    mode = request.param
    tmp = tmp_path_factory.mktemp(f"term-{mode}")
    recipe = yaml.safe_load((REPO / "ogrpo" / "recipes" / "tiny.yaml").read_text())
    recipe.update({"max_steps": STEPS, "num_generations": 4, "per_device_train_batch_size": 8, "save_steps": 1,
                   "save_total_limit": 2})
    recipe["ogrpo"].update({"time": "30", "max_prompt_length": 64})
    gpus = "cpu"
    if mode != "no-server":
        gpus = "2xcpu"
        recipe["ogrpo"].update({"gpus": gpus, "use_vllm": True, "overlap": mode})
    cfg = tmp / "recipe.yaml"
    cfg.write_text(yaml.safe_dump(recipe))
    job_dir = tmp / "job"
    ogrpo("render", "--gpus", gpus, "--config", str(cfg), "-o", str(job_dir), check=True)
    out = subprocess.run(["sbatch", "--parsable", str(job_dir / "job.sbatch")], env=venv_env(OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, check=True)
    job = out.stdout.strip().split(";")[0]
    run = job_dir / "run"
    try:
        signalled = {0: _hold_and_signal(job, run, 0, 2, ["--signal=TERM"])}
        wait_for(lambda: (job_dir / "slurm" / "requeue-0.json").exists(), 300, "the requeue after the TERM")
        resumed = int(read_json(job_dir / "slurm" / "requeue-0.json")["checkpoint"].rsplit("-", 1)[1])
        signalled[1] = _hold_and_signal(job, run, 1, resumed + 1, ["-b", "--signal=TERM"])
        wait_for(lambda: (job_dir / "slurm" / "requeue-1.json").exists(), 300, "the requeue after the batch TERM")
        wait_gone(job, 1200)
    finally:
        subprocess.run(["scancel", job], check=False)
    return mode, job, job_dir, signalled


def test_a_term_while_the_job_runs_on_saves_requeues_and_resumes(termed_job):
    mode, job, job_dir, signalled = termed_job
    run = job_dir / "run"
    log = "".join(p.read_text() for p in sorted((job_dir / "logs").glob(f"slurm-{job}*.out")))
    assert sacct_state(job) == "COMPLETED", log[-4000:]
    assert "server exited" not in log and "mid-run" not in log and "job failed" not in log, log[-4000:]
    wait_for(lambda: not processes_of_job(job), 30, f"processes of job {job} to disappear")
    first, second = (read_json(job_dir / "slurm" / f"requeue-{i}.json") for i in (0, 1))
    assert first["requeued"] and second["requeued"] and first["signal"] == "SIGTERM"
    saved = [int(r["checkpoint"].rsplit("-", 1)[1]) for r in (first, second)]
    # the batch step's TERM: the trainer saved the step it was in (held mid-step when the signal came), the server
    # answering meanwhile
    assert saved[1] > signalled[1] and second["signal"] == "SIGUSR2", (saved, signalled)
    if mode == "no-server":  # the steps' TERM: the same
        assert saved[0] > signalled[0], (saved, signalled)
    else:
        # the steps' TERM took the server too: a step that still needed it is not saved; every step logged before
        # the signal is kept (one-step: its save waits for the batch in flight, which the server took with it,
        # so the one before)
        assert saved[0] >= signalled[0] - (mode == "one-step"), (saved, signalled)
    assert read_json(job_dir / "slurm" / "attempt-2.json")["restart_count"] == 2
    manifest = read_json(run / "manifest.json")
    assert manifest["status"] == "finished" and manifest["global_step"] == STEPS
    assert manifest["resumed_from"].endswith(f"checkpoint-{saved[1]}")
    if mode != "no-server":
        assert manifest["overlap"]["mode"] == mode if mode != "off" else "overlap" not in manifest
    assert _steps(run) == list(range(1, STEPS + 1))  # each step once across both requeues, none past max_steps
    assert max(int(p.name.rsplit("-", 1)[1]) for p in run.glob("checkpoint-*")) == STEPS
