"""Server mode on CPU through `ogrpo train --vllm-url`: a real `ogrpo serve` (vLLM-CPU, cpu_shm weight sync),
started and torn down by the local launcher from one JobSpec, and the trainer entry of this area."""

from __future__ import annotations

import io
import json

import pytest
import yaml

pytestmark = pytest.mark.integration

STEPS = 3


def test_train_entry_in_server_mode_keeps_logprob_gap_small(tmp_path):
    from ogrpo.config import load_run_config
    from ogrpo.jobspec import JobSpec, Step
    from ogrpo.launch.local import run_local_result

    job_dir = tmp_path / "job"
    job_dir.mkdir()
    from ogrpo import tiny
    from ogrpo.plan import plan_from_config

    rc = load_run_config("tiny", {"dtype": "float32", "max_steps": STEPS, "save_strategy": "no",
                                  "ogrpo": {"use_vllm": True, "max_prompt_length": 32}})
    # what `ogrpo render --gpus cpu` writes: the run config plus its plan (the server reads plan.vllm.args)
    plan = plan_from_config(rc, gpus="cpu", model=str(tiny.ensure_tiny_model())).to_dict()
    assert plan["vllm"]["args"]["kv_cache_memory_bytes"] > 0  # the server gets the plan's KV budget, no share
    run = rc.to_dict()
    run["ogrpo"]["plan"] = plan
    (job_dir / "run.yaml").write_text(yaml.safe_dump(run))
    job = JobSpec(name="train-server", job_dir=str(job_dir), health_timeout_s=300, steps=[
        # Importing TRL (earlier tests in this process did) sets VLLM_LOGGING_LEVEL=ERROR in os.environ, which
        # the server would inherit; INFO shows how vLLM sized its KV cache.
        Step(role="server", nodes=[0], gpus=[], ntasks=1, env={"VLLM_LOGGING_LEVEL": "INFO"},
             argv=["ogrpo", "serve", "--config", "{job_dir}/run.yaml", "--host", "{server_host}",
                   "--port", "{server_port}"]),
        Step(role="trainer", nodes=[0], gpus=[], ntasks=1, env={"OMP_NUM_THREADS": "1"},
             argv=["ogrpo", "train", "--config", "{job_dir}/run.yaml", "--output-dir", "{job_dir}/run",
                   "--vllm-url", "http://{server_host}:{server_port}"]),
    ])
    out = io.StringIO()
    res = run_local_result(job, out=out)
    logs = job_dir / "run" / "logs"
    trainer_log = (logs / "trainer.log").read_text() if (logs / "trainer.log").is_file() else ""
    assert res.rc == 0, out.getvalue() + "\n" + trainer_log[-4000:]

    manifest = json.loads((job_dir / "run" / "manifest.json").read_text())
    assert manifest["grpo_config"]["vllm_mode"] == "server" and manifest["grpo_config"]["use_vllm"] is True
    rows = [json.loads(x) for x in (job_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    gaps = [r["sampling/sampling_logp_difference/mean"] for r in rows if "sampling/sampling_logp_difference/mean" in r]
    assert len(gaps) == STEPS and max(gaps) < 1e-4, gaps
    server_log = (logs / "server.log").read_text()
    assert server_log.count('"POST /update_weights HTTP/1.1" 200') >= STEPS
    assert "Explicitly set" in server_log  # vLLM took the plan's KV budget, not a share of the NUMA node
    profile = [json.loads(x) for x in (job_dir / "run" / "profile.jsonl").read_text().splitlines()]
    assert len(profile) == STEPS and all(p["generation_s"] > 0 and p["train_s"] > 0 for p in profile)
