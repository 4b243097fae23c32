"""The real pipeline on the test cluster: `ogrpo submit --gpus 3xA40 --config ...` with the tiny CPU model.

The test cluster's A40s are character devices: `ogrpo submit` submits the GPU plan as it would anywhere, Slurm
allocates GPUs per step (and sets CUDA_VISIBLE_DEVICES for each), and the steps' entry points are the stand-ins
of tests/slurm/fake_gpus.py, which run the CPU plan of the same layout.

Determinism of resumed runs: the preemption and time-limit runs generate with HF `generate` inside the trainer
(`use_vllm: false`). On CPU that is deterministic given the RNG state, which the checkpoint carries
(rng_state.pth), so a resumed run reproduces the uninterrupted one. A vLLM server restarted by the requeue
would not: its sampler state starts afresh, so the completions after the restart differ.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from . import fake_gpus
from .conftest import ogrpo, processes_of_job, read_json, sacct_state, wait_for, wait_gone

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TINY = """model_name_or_path: ogrpo:tiny
dataset_name: ogrpo:tiny
reward_funcs: [tiny_letter]
seed: 42
learning_rate: 1.0e-3
lr_scheduler_type: constant
beta: 0.04
num_generations: 8
per_device_train_batch_size: 32
gradient_accumulation_steps: 1
max_completion_length: 12
temperature: 1.0
max_steps: {steps}
logging_steps: 1
save_steps: {save}
save_total_limit: 2
report_to: none
ogrpo:
  use_vllm: {vllm}
  max_prompt_length: 64   # stated, so the plan's and the server's context lengths agree
"""
# Long enough for a forced requeue mid-run (0.5-3 s/step here, depending on the machine's load)
LONG_STEPS = 64
COMPARED = ("loss", "reward", "kl", "grad_norm", "entropy")


def config(tmp_path: Path, steps: int, save: int, vllm: bool) -> str:
    path = tmp_path / f"tiny-{steps}-{'vllm' if vllm else 'hf'}.yaml"
    path.write_text(TINY.format(steps=steps, save=save, vllm=str(vllm).lower()))
    return str(path)


def submit(cfg: str, job_dir: Path, *args: str) -> str:
    out = ogrpo("submit", "--config", cfg, "-o", str(job_dir), *args, env=fake_gpus.env(), check=True)
    line = out.stdout.splitlines()[0]
    assert line.startswith("submitted job "), out.stdout
    return line.split()[-1]


def step_metrics(run: Path) -> dict[int, dict]:
    """step → logged values."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec and "step" in rec:
            out[rec["step"]] = {k: rec[k] for k in COMPARED if k in rec}
    return out


def final_weights(run: Path, steps: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / f"checkpoint-{steps}" / "model.safetensors"))


def assert_same_run(run: Path, ref: Path, steps: int) -> None:
    import torch

    got, want = step_metrics(run), step_metrics(ref)
    assert sorted(got) == list(range(1, steps + 1)) == sorted(want)
    # each step logged once: a resume moves rows of steps it runs again to metrics.superseded.jsonl
    logged = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert logged == list(range(1, steps + 1)), logged
    for s in want:
        for k, v in want[s].items():
            assert got[s][k] == pytest.approx(v, rel=1e-4, abs=1e-6), (s, k)
    a, b = final_weights(run, steps), final_weights(ref, steps)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def latest_step(run: Path) -> int:
    try:
        return max(step_metrics(run), default=0)
    except (OSError, ValueError):
        return 0


def test_grpo_with_server_disjoint_devices_status_logs(slurm_cluster, tmp_path):
    job_dir = tmp_path / "job"
    job = submit(config(tmp_path, steps=4, save=2, vllm=True), job_dir, "--gpus", "3xA40", "--time", "10")
    wait_gone(job, 420)
    assert sacct_state(job) == "COMPLETED", ogrpo("logs", job).stdout[-3000:]
    run = job_dir / "run"
    server = read_json(run / "roles" / "server.step.json")["cuda_visible_devices"].split(",")
    trainer = read_json(run / "roles" / "trainer.step.json")["cuda_visible_devices"].split(",")
    assert len(server) == 1 and len(trainer) == 2 and not set(server) & set(trainer)
    assert sorted(step_metrics(run)) == [1, 2, 3, 4]
    status = ogrpo("status", job, check=True).stdout
    assert f"job {job}: COMPLETED" in status and "last checkpoint: checkpoint-4" in status
    assert "server saw CUDA_VISIBLE_DEVICES=" in status and "trainer saw CUDA_VISIBLE_DEVICES=" in status
    assert ogrpo("logs", job, "--role", "server", check=True).stdout.strip()
    assert "run directory" in ogrpo("logs", str(job_dir), "--role", "trainer", check=True).stdout


def test_cancel_grpo_leaves_no_process(slurm_cluster, tmp_path):
    job_dir = tmp_path / "job"
    job = submit(config(tmp_path, steps=500, save=100, vllm=True), job_dir, "--gpus", "3xA40", "--time", "10")
    wait_for(lambda: latest_step(job_dir / "run") >= 1, 300, "the first GRPO step")
    assert len(processes_of_job(job)) >= 4  # supervisor, srun clients, vLLM server, trainer workers
    assert f"cancelled job {job}" in ogrpo("cancel", str(job_dir), check=True).stdout  # by run directory
    assert sacct_state(job) == "CANCELLED"
    wait_for(lambda: not processes_of_job(job), 30, f"processes of job {job} to disappear")


def run_reference(tmp: Path) -> Path:
    """The uninterrupted run the resumed ones must reproduce (once per session: conftest.grpo_reference, also
    used by test_slurm_preemption.py); its run directory."""
    job = submit(config(tmp, LONG_STEPS, 8, vllm=False), tmp / "job", "--gpus", "1xA40", "--time", "10")
    wait_gone(job, 600)  # queued behind other jobs of the session, and 0.5-6 s a step on a loaded machine
    assert sacct_state(job) == "COMPLETED"
    return tmp / "job" / "run"
