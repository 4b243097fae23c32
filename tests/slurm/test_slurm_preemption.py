"""Preemption on the test cluster with the real tiny GRPO run (KillWait 5 s there, as on many clusters' defaults
of old: shorter than a step and a save):

- the job `ogrpo render` writes, submitted with plain `sbatch` (no `ogrpo submit`, which runs the same file:
  tests/slurm/test_slurm_job_sbatch.py): its time-limit warning leads to a checkpoint and a requeue, `ogrpo
  status` counts it, and the resumed run ends exactly where the uninterrupted one did;
- a ZeRO-3 job with two gloo trainer processes, requeued mid-run with `scontrol requeue` (SIGTERM, SIGKILL 5 s
  later): the plan checkpoints every step on this cluster, so the resume starts at most one step back and ends
  with the metrics of the same config run uninterrupted with `ogrpo submit --backend local`.

Both use CPU plans (`--gpus cpu`, `--gpus 2xcpu`): the test cluster's `debug` partition runs them like any job.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from .conftest import ogrpo, read_json, sacct_state, venv_env, wait_for, wait_gone

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _batch_script(job_id: str) -> bytes:
    return subprocess.run(["scontrol", "write", "batch_script", job_id, "-"], capture_output=True,
                          check=True).stdout


def test_plain_sbatch_of_the_rendered_grpo_job_checkpoints_requeues_and_resumes(grpo_reference, tmp_path):
    """Time limit 3 minutes; the warning comes 90 s before it (the lead render chose: one step + save + server
    stop is far less), i.e. 60-90 s in. The trainer step is held (SIGSTOP) from step 3 until the warning has come,
    so that the first attempt outlasts the warning at any machine speed; pausing changes no computation."""
    from .test_slurm_grpo import LONG_STEPS, TINY, assert_same_run, latest_step

    cfg = tmp_path / "run.yaml"
    cfg.write_text(TINY.format(steps=LONG_STEPS, save=8, vllm="false") + "  time: '3'\n")
    job_dir = tmp_path / "job"
    rendered = ogrpo("render", "--gpus", "cpu", "--config", str(cfg), "-o", str(job_dir), check=True)
    # this cluster's KillWait is shorter than a step + save: every step is checkpointed, and the user is told
    assert "KillWait 5 s" in rendered.stderr and "change: save_steps: 8 -> 1" in rendered.stderr
    assert yaml.safe_load((job_dir / "run.yaml").read_text())["save_steps"] == 1
    script = (job_dir / "job.sbatch").read_bytes()
    assert b"#SBATCH --signal=B:USR2@90\n" in script and b"#SBATCH --time=00:03:00\n" in script

    out = subprocess.run(["sbatch", "--parsable", str(job_dir / "job.sbatch")], env=venv_env(),
                         capture_output=True, text=True, check=True)
    job = out.stdout.strip().split(";")[0]
    run, log = job_dir / "run", job_dir / "logs" / f"slurm-{job}.out"

    def warned() -> bool:
        return log.exists() and "USR2: asking the trainer" in log.read_text()

    wait_for(lambda: latest_step(run) >= 3 or warned(), 300, "step 3 or the time-limit warning")
    if not warned():
        step = f"{job}.{read_json(run / 'roles' / 'trainer.step.json')['slurm_step_id']}"
        subprocess.run(["scancel", "--signal=STOP", step], check=True)
        wait_for(warned, 200, "the time-limit warning")
        subprocess.run(["scancel", "--signal=CONT", step], check=True)
    wait_for(lambda: (job_dir / "slurm" / "requeue-0.json").exists(), 150, "the time-limit requeue")
    # one time-limit round trip is the point; the resumed attempt may need longer when the machine is loaded
    wait_for(lambda: subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=15"],
                                    capture_output=True).returncode == 0, 60, "scontrol update TimeLimit")
    wait_gone(job, 900)
    assert sacct_state(job) == "COMPLETED", log.read_text()[-3000:]
    assert _batch_script(job) == script  # Slurm ran the rendered file, byte for byte
    requeue = read_json(job_dir / "slurm" / "requeue-0.json")
    assert requeue["requeued"] and requeue["signal"] == "SIGUSR2" and requeue["checkpoint"].startswith("checkpoint-")
    assert read_json(job_dir / "slurm" / "attempt-1.json")["restart_count"] == 1
    assert json.loads(ogrpo("status", job, "--json", check=True).stdout)["requeues"] == 1  # Slurm's Restarts
    assert read_json(run / "manifest.json").get("resumed_from")
    assert_same_run(run, grpo_reference, LONG_STEPS)


def test_zero3_job_requeued_mid_run_ends_like_the_uninterrupted_local_run(slurm_cluster, tmp_path):
    pytest.importorskip("deepspeed")
    from test_deepspeed import STEPS, _steps, _submit, _tiny

    # the uninterrupted run: the same config through `ogrpo submit --backend local`
    _submit(_tiny(tmp_path, "local", "2xcpu", strategy="zero3"), tmp_path / "local", "2xcpu")
    reference = _steps(tmp_path / "local" / "run")

    job_dir = tmp_path / "job"
    out = ogrpo("submit", "--gpus", "2xcpu", "--config", str(_tiny(tmp_path, "slurm", "2xcpu", strategy="zero3")),
                "-o", str(job_dir), "--time", "15", env={"OMP_NUM_THREADS": "1"}, check=True)
    assert "change: save_steps: 100 -> 1" in out.stderr  # KillWait 5 s: every step checkpointed
    job = out.stdout.splitlines()[0].split()[-1]
    run = job_dir / "run"

    def finished_steps() -> int:
        try:
            return max(_steps(run), default=0)
        except (OSError, ValueError):
            return 0

    wait_for(lambda: finished_steps() >= 1, 600, "step 1 of the ZeRO-3 job")
    assert finished_steps() < STEPS, "the job ran to its end before the requeue: nothing was tested"
    # what a preemption with PreemptMode=REQUEUE does: SIGTERM to every step, SIGKILL after KillWait (5 s)
    subprocess.run(["scontrol", "requeue", job], check=True)
    wait_gone(job, 900)
    log = (job_dir / "logs" / f"slurm-{job}.out").read_text()
    assert sacct_state(job) == "COMPLETED", log[-3000:]
    assert read_json(job_dir / "slurm" / "attempt-1.json")["restart_count"] == 1
    manifest = read_json(run / "manifest.json")
    resumed = int(manifest["resumed_from"].rsplit("-", 1)[1])
    assert resumed >= 1  # checkpointed every step: the requeue lost at most the step that was running
    dist = manifest["distributed"]
    assert dist["deepspeed"]["zero_stage"] == 3 and dist["num_processes"] == 2 and dist["backend"] == "gloo"
    assert manifest["grpo_config"]["deepspeed"] == str((job_dir / "deepspeed.json").resolve())
    assert len(list((run / f"checkpoint-{STEPS}" / f"global_step{STEPS}").glob("*optim_states.pt"))) == 2
    got = _steps(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    logged = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert logged == list(range(1, STEPS + 1)), logged  # steps run again after the resume replaced their rows
    for s in range(1, STEPS + 1):
        for key, value in reference[s].items():
            assert got[s][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (s, key)
