"""A server-mode GRPO job on the split placement, as `ogrpo submit --backend local` runs it: the tiny recipe with
vLLM, planned for `gpus` with `ogrpo.overlap: mode`, rendered and run by the local supervisor (a real `ogrpo
serve` and real trainer processes). Shared by tests/test_overlap.py and tests/trl19/."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import yaml

from serve_fixtures import group_members, jsonl

REPO = Path(__file__).resolve().parents[1]
# vLLM's API server hands a request's prompts to the engine one by one, and the engine batches whatever has
# arrived: the same run twice can differ even with `off` (without a seed the sampler's draws follow the batch's
# make-up; with one, a sequence's logits still depend on its batch and on prefix-cache hits, and the tiny model's
# near-uniform distributions flip tokens on that noise). A per-request seed (vLLM gives the n completions of a
# prompt seed + i), one sequence at a time and no prefix cache make each completion a function of the prompt and
# the weights only, so a difference between modes can only come from the trainer side.
# The bar between a packed pass and TRL's padded one (lossless's defaults against `off` with TRL's own passes): a
# packed forward sums in another order, fp32 noise of up to ~1e-5 in a log-prob, which TRL's sampling/* statistics
# (differences and ratios of the trainer's and the server's log-probs) show as is. Losses stay within 1e-5 and the
# grad norm within 1e-5 of each other.
PACKED = {"rel": 1e-4, "abs": 1e-5}
SEEDED = {"seed": 1234}
DETERMINISTIC_SERVER = {"max_num_seqs": 1, "enable_prefix_caching": False}


def run_job(tmp: Path, mode: str, gpus: str = "2xcpu", steps: int = 3, ogrpo: dict | None = None,
            **recipe_keys) -> Path:
    """Runs the job; returns its run directory. Asserts it finished (rc 0) and left no process behind."""
    from ogrpo.config import load_run_config
    from ogrpo.jobspec import build_jobspec
    from ogrpo.launch.local import run_local
    from ogrpo.plan import plan_from_config
    from ogrpo.render import render_job, write_job

    recipe = yaml.safe_load((REPO / "ogrpo" / "recipes" / "tiny.yaml").read_text())
    recipe.update({"max_steps": steps, "save_strategy": "no", "per_device_train_batch_size": 16,
                   "num_generations": 4, "log_completions": True, "generation_kwargs": SEEDED, **recipe_keys})
    recipe["ogrpo"].update({"gpus": gpus, "use_vllm": True, "overlap": mode, **(ogrpo or {})})
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = tmp / "recipe.yaml"
    cfg.write_text(yaml.safe_dump(recipe))
    rc = load_run_config(str(cfg))
    plan = plan_from_config(rc, gpus=gpus)
    plan.vllm = dataclasses.replace(plan.vllm, args=dataclasses.replace(plan.vllm.args, **DETERMINISTIC_SERVER))
    job_dir = tmp / "job"
    spec = build_jobspec(plan, rc, str(job_dir))
    write_job(render_job(plan, rc, spec), str(job_dir))
    (job_dir / "jobspec.json").write_text(json.dumps(spec.to_dict(), indent=2) + "\n")
    code = run_local(str(job_dir))
    run = job_dir / "run"
    logs = run / "logs"
    tails = "".join(f"\n--- {p.name}\n" + p.read_text()[-4000:] for p in sorted(logs.glob("*.log"))) \
        if logs.is_dir() else ""
    assert code == 0, tails
    for role in ("server", "trainer"):
        pid = json.loads((run / "roles" / f"{role}.json").read_text())["pid"]
        assert group_members(pid) == [], f"{role} left processes behind"
    return run


def metrics(run: Path) -> list[dict]:
    """One row per optimizer step (TRL's logged metrics)."""
    return [r for r in jsonl(run / "metrics.jsonl") if "loss" in r]


def completions(run: Path, step: int):
    import pandas as pd

    return pd.read_parquet(run / "completions" / f"completions_{step:05d}.parquet")


def requests(run: Path) -> int:
    """Generation requests the server answered."""
    log = (run / "logs" / "server.log").read_text()
    return log.count('"POST /v1/completions HTTP/1.1" 200') + log.count('"POST /generate/ HTTP/1.1" 200')
