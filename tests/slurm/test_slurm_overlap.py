"""`ogrpo.overlap: one-step` on the test cluster, server mode (a real vLLM server and trainer):

- requeue: the rendered job, run with plain `sbatch`, is held after step 2 (SIGSTOP) and requeued with `scontrol
  requeue` (SIGTERM, SIGKILL 5 s later); before it starts again its newest checkpoint is removed (as if the kill
  had come before it was saved: the resume must train that step again). The second attempt resumes from a
  checkpoint that carries the batch the pipeline had in flight (ogrpo/overlap/resume.py): the steps both
  attempts ran have the same batch identities (`batch_sha`, the profiler's digest of prompts + completions), the
  same staleness and losses; each step is logged once and the staleness never exceeds 1. Without the saved batch
  the step trained again would be generated with the checkpoint's weights: staleness 0 and other completions.
- two nodes: the server on one node, the trainer on the other (`--gpus 2x1xcpu --partition two`), end to end.

Determinism across a server restart: each request is seeded (vLLM seeds a prompt's n completions seed + i) and
the server runs one sequence at a time without a prefix cache (tests/overlap_jobs.py), so a completion is a
function of the prompt and the weights only.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from .conftest import (ogrpo, processes_of_job, read_json, read_jsonl, render_job, sacct_state, venv_env, wait_for,
                       wait_gone)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.integration]
REPO = Path(__file__).resolve().parents[2]

STEPS = 4
# every step checkpointed (as the plan makes it on this cluster: KillWait 5 s); 2 prompts x 4 completions a step
KEYS = {"save_strategy": "steps", "save_steps": 1, "save_total_limit": 2, "per_device_train_batch_size": 8}


def _state(job: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip()


def _steps(run: Path) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def test_one_step_job_requeued_mid_run_resumes_with_the_same_batch_stream(slurm_cluster, tmp_path):
    import shutil

    from overlap_jobs import SEEDED

    recipe = yaml.safe_load((REPO / "ogrpo" / "recipes" / "tiny.yaml").read_text())
    recipe.update({"max_steps": STEPS, "num_generations": 4, "log_completions": True, "generation_kwargs": SEEDED,
                   **KEYS})
    recipe["ogrpo"].update({"gpus": "2xcpu", "use_vllm": True, "overlap": "one-step", "max_prompt_length": 64})
    job_dir = tmp_path / "job"
    recipe["ogrpo"]["time"] = "15"
    render_job(recipe, job_dir, "2xcpu", deterministic_server=True)
    out = subprocess.run(["sbatch", "--parsable", str(job_dir / "job.sbatch")], env=venv_env(OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, check=True)
    job = out.stdout.strip().split(";")[0]
    run = job_dir / "run"
    # hold the trainer after step 2 so the requeue lands mid-run at any machine speed (pausing computes nothing)
    wait_for(lambda: len(_steps(run)) >= 2, 600, "step 2 of the one-step job")
    step = f"{job}.{read_json(run / 'roles' / 'trainer.step.json')['slurm_step_id']}"
    subprocess.run(["scancel", "--signal=STOP", step], check=True)
    subprocess.run(["scontrol", "requeue", job], check=True)
    # the first attempt is over when the job waits to start again (Slurm holds a requeued job ~10 s)
    wait_for(lambda: _state(job) == "PENDING", 120, "the requeued job to wait for its second start")
    first = {p["step"]: p for p in read_jsonl(run / "profile.jsonl")}
    held = max(first)
    assert held < STEPS, "the job ran to its end before the requeue: nothing was tested"
    # as if killed before step `held` was saved: the resume starts one step back and trains step `held` again,
    # from a checkpoint whose batch was in flight (sampled one version before the checkpoint's weights)
    for ckpt in run.glob("checkpoint-*"):
        if int(ckpt.name.rsplit("-", 1)[1]) >= held:
            shutil.rmtree(ckpt)
    assert (run / f"checkpoint-{held - 1}" / "ogrpo_overlap_inflight.json").is_file()
    wait_gone(job, 900)
    log = (job_dir / "logs" / f"slurm-{job}.out").read_text()
    assert sacct_state(job) == "COMPLETED", log[-3000:]
    wait_for(lambda: not processes_of_job(job), 30, f"processes of job {job} to disappear")
    assert read_json(job_dir / "slurm" / "attempt-1.json")["restart_count"] == 1
    manifest = read_json(run / "manifest.json")
    assert manifest["resumed_from"].endswith(f"checkpoint-{held - 1}") and manifest["overlap"]["mode"] == "one-step"

    rows, profile = _steps(run), read_jsonl(run / "profile.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step once across the requeue
    assert [p["step"] for p in profile] == list(range(1, STEPS + 1))
    assert len({p["batch_sha"] for p in profile}) == STEPS  # a digest per step that tells the steps apart
    # the steps the first attempt ran, and the resumed attempt ran again, trained on the same batches
    again = {p["step"]: p for p in read_jsonl(run / "profile.superseded.jsonl")}
    assert held in again
    for p in profile:
        if p["step"] in first:
            assert p["batch_sha"] == first[p["step"]]["batch_sha"], (p["step"], held)
            assert p["staleness"] == first[p["step"]]["staleness"]
    assert [p["staleness"] for p in profile] == [0] + [1] * (STEPS - 1)  # never above 1; 1 after the resume too
    assert [r["overlap/staleness"] for r in rows] == [0.0] + [1.0] * (STEPS - 1)
    superseded = {r["step"]: r for r in read_jsonl(run / "metrics.superseded.jsonl") if "loss" in r}
    for r in rows:
        if r["step"] in superseded:
            assert r["loss"] == pytest.approx(superseded[r["step"]]["loss"], rel=1e-4, abs=1e-5), r["step"]
    assert (run / "plots" / "timeline.png").is_file()
    lanes = [p for p in profile if "lanes" in p]
    assert lanes and all(set(p["lanes"]) == {"server", "trainer"} for p in lanes)


def test_one_step_with_the_server_and_the_trainer_on_two_nodes(slurm_cluster, tmp_path):
    from .test_slurm_two_node import node_addr, step_nodes

    nodes = subprocess.run(["sinfo", "-h", "-p", "two", "-N", "-o", "%N"], capture_output=True, text=True)
    if len(set(nodes.stdout.split())) < 2:
        pytest.skip("no partition `two` with two nodes: cluster.sh brings up node2 only as root with `ip netns`")
    recipe = yaml.safe_load((REPO / "ogrpo" / "recipes" / "tiny.yaml").read_text())
    recipe.update({"max_steps": 4, "per_device_train_batch_size": 16, "num_generations": 4, "save_steps": 100})
    recipe["ogrpo"].update({"gpus": "2x1xcpu", "use_vllm": True, "overlap": "one-step", "max_prompt_length": 64})
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(recipe))
    job_dir, run = tmp_path / "job", tmp_path / "job" / "run"
    out = ogrpo("submit", "--config", str(cfg), "--gpus", "2x1xcpu", "--partition", "two", "--time", "15",
                "-o", str(job_dir), env={"OMP_NUM_THREADS": "1"}, check=True).stdout
    assert "server: nodes [0]" in out and "trainer: nodes [1]" in out, out
    job = out.splitlines()[0].split()[-1]
    wait_gone(job, 900)
    log = (job_dir / "logs" / f"slurm-{job}.out").read_text()
    assert sacct_state(job) == "COMPLETED", log[-3000:]
    wait_for(lambda: not processes_of_job(job), 30, f"processes of job {job} to disappear")
    where = step_nodes(job)
    assert len(where["server"]) == 1 and len(where["trainer"]) == 1 and where["server"] != where["trainer"], where
    server_addr = node_addr(next(iter(where["server"])))
    url = read_json(run / "roles" / "trainer.json")["argv"]
    assert url[url.index("--vllm-url") + 1].startswith(f"http://{server_addr}:")
    rows, profile = _steps(run), read_jsonl(run / "profile.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["overlap/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all("overlap/importance_ratio/mean" in r for r in rows)
    assert rows[0]["sampling/sampling_logp_difference/mean"] < 1e-4  # the push crossed the link whole
    assert read_json(run / "manifest.json")["overlap"]["mode"] == "one-step"
    assert all(0.0 <= p["idle_share"][k] <= 1.0 for p in profile for k in ("server", "trainer"))
