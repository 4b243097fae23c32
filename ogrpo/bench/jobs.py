"""A run config planned for the split placement (`--gpus 2xcpu`: a vLLM server on one core, the trainer on the
other) with an `ogrpo.overlap` mode, rendered and run as a local job, the way `ogrpo submit --backend local`
runs it (a real `ogrpo serve` and trainer under the supervisor). Shared by the step and overlap benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from ogrpo.config import load_run_config
from ogrpo.errors import LaunchError
from ogrpo.jobspec import build_jobspec
from ogrpo.launch.local import run_local
from ogrpo.plan import plan_from_config
from ogrpo.render import render_job, write_job

SPLIT = "2xcpu"


def split_plan(workdir: Path, name: str, recipe: dict, mode: str, **ogrpo_keys):
    """(run config, plan) of `recipe` on the split placement with `ogrpo.overlap: mode`; `ogrpo_keys`: other
    O-GRPO options (`use_vllm=False`: two trainer processes on the two cores instead, generating themselves)."""
    ogrpo = {**(recipe.get("ogrpo") or {}), "gpus": SPLIT, "use_vllm": True, "overlap": mode, **ogrpo_keys}
    if not ogrpo["use_vllm"]:
        ogrpo.pop("vllm_compile", None)  # the bench's server setting: no server here (a plan refuses it without one)
    cfg = workdir / f"{name}-recipe.yaml"
    cfg.write_text(yaml.safe_dump({**recipe, "ogrpo": ogrpo}))
    rc = load_run_config(str(cfg))
    return rc, plan_from_config(rc, gpus=SPLIT)


def run_split_job(workdir: Path, name: str, recipe: dict, mode: str, adjust=None, **ogrpo_keys) -> Path:
    """Runs the job in workdir/<name>-job; returns its run directory (LaunchError naming the logs if it fails: the
    bench commands end on it in one line, exit 1).
    `adjust(plan) -> plan`: a bench's own change to the plan it runs (`ogrpo bench overlap --broken`), made after
    planning, where no recipe can reach it."""
    rc, plan = split_plan(workdir, name, recipe, mode, **ogrpo_keys)
    if adjust is not None:
        plan = adjust(plan)
    job = workdir / f"{name}-job"
    spec = build_jobspec(plan, rc, str(job))
    write_job(render_job(plan, rc, spec), str(job))
    (job / "jobspec.json").write_text(json.dumps(spec.to_dict(), indent=2) + "\n")
    code = run_local(str(job))
    if code != 0:
        raise LaunchError(f"{name} (split placement, overlap {mode}): the job failed (exit {code}); see "
                           f"{job / 'run' / 'logs'}")
    return job / "run"
