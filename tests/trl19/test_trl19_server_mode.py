"""Server-mode GRPO on the images' line, end to end on CPU: the tiny recipe planned for 3xcpu renders a job whose
server is `trl vllm-serve` (TRL 1.9.2's own script and routes on vLLM 0.19.1's CPU build,
ogrpo.serve.trl_serve_cpu) and whose 2 trainer processes run TRL 1.9.2's GRPOTrainer, VLLMGeneration and
VLLMClient; only the NCCL group is gloo here.

Weights must reach the server every step: TRL's logged log-prob gap between server and trainer stays < 1e-4 in
fp32 (without a push it is ~0.3 after one step), and the server log shows one
`/update_named_param/` per parameter per step. About 3-4 minutes on 2 cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from serve_fixtures import group_members, jsonl

pytestmark = pytest.mark.integration

STEPS = 3
GAP = "sampling/sampling_logp_difference/mean"


def test_local_job_server_mode_trl_vllm_serve(tmp_path):
    """What `ogrpo submit --backend local --gpus 3xcpu` does, step by step: plan, JobSpec, rendered files, local
    supervisor (server + 2 trainer processes)."""
    from ogrpo.config import load_run_config
    from ogrpo.jobspec import build_jobspec
    from ogrpo.launch.local import run_local
    from ogrpo.plan import plan_from_config
    from ogrpo.render import render_job, write_job

    recipe = yaml.safe_load((Path(__file__).parents[2] / "ogrpo" / "recipes" / "tiny.yaml").read_text())
    recipe.update({"max_steps": STEPS, "save_steps": 100, "per_device_train_batch_size": 8, "num_generations": 4})
    recipe["ogrpo"].update({"gpus": "3xcpu", "use_vllm": True})
    cfg = tmp_path / "tiny-server.yaml"
    cfg.write_text(yaml.safe_dump(recipe))
    job_dir = tmp_path / "job"
    rc = load_run_config(str(cfg))
    plan = plan_from_config(rc, gpus="3xcpu")
    spec = build_jobspec(plan, rc, str(job_dir))
    write_job(render_job(plan, rc, spec), str(job_dir))
    (job_dir / "jobspec.json").write_text(json.dumps(spec.to_dict(), indent=2) + "\n")
    rc_job = run_local(str(job_dir))
    logs = job_dir / "run" / "logs"
    tails = "".join(f"\n--- {p.name}\n" + p.read_text()[-3000:] for p in sorted(logs.glob("*.log"))) \
        if logs.is_dir() else ""
    assert rc_job == 0, tails

    spec = json.loads((job_dir / "jobspec.json").read_text())
    assert [s["role"] for s in spec["steps"]] == ["server", "trainer"]
    assert spec["health_path"] == "/health/"  # TRL's route: the plan was rendered for the installed TRL 1.9

    rows = [r for r in jsonl(job_dir / "run" / "metrics.jsonl") if GAP in r]
    assert len(rows) == STEPS and max(r[GAP] for r in rows) < 1e-4, rows

    server_log = (logs / "server.log").read_text()
    assert "trl_serve_cpu" in server_log  # ogrpo serve chose TRL's server on CPU
    assert '"GET /get_world_size/ HTTP/1.1" 200' in server_log
    assert '"POST /init_communicator/ HTTP/1.1" 200' in server_log
    pushes = server_log.count('"POST /update_named_param/ HTTP/1.1" 200')
    resets = server_log.count('"POST /reset_prefix_cache/ HTTP/1.1" 200')
    assert resets >= STEPS and pushes >= resets * 10, (pushes, resets)  # every parameter, every step
    assert "Failed to load weights" not in server_log  # tied lm_head / rotary: expected, filtered (cpu_reload)
    trainer_log = (logs / "trainer.log").read_text()
    assert "gloo group on port" in trainer_log

    manifest = json.loads((job_dir / "run" / "manifest.json").read_text())
    versions = json.dumps(manifest)
    assert '"1.9.2"' in versions, "the manifest does not record TRL 1.9.2"
    for role in ("server", "trainer"):
        pid = json.loads((job_dir / "run" / "roles" / f"{role}.json").read_text())["pid"]
        assert group_members(pid) == [], f"{role} left processes behind"
