"""ogrpo.patches: every patch's check passes against the libraries installed here, and fails loudly (naming the
patch, the library and its version) when its target is moved away."""

from __future__ import annotations

import importlib

import pytest

from ogrpo import patches
from ogrpo.patches.target import PatchTargetMoved, version


def test_every_check_passes_on_the_installed_libraries():
    report = patches.run_checks()
    assert set(report) == set(patches.PATCHES)
    assert {name: r["detail"] for name, r in report.items() if r["status"] == "failed"} == {}
    assert report["typer_options"]["status"] == "ok"  # the CLI's own dependency is always here


def _vllm_generation():
    from ogrpo import compat

    return compat.vllm_generation_module()


# patch -> (module path, attribute chain of the target to take away); "@gen" is TRL's generation module
MOVES = {
    "typer_options": ("typer.core", "_TyperParameter.get_runtime_param"),
    "vllm_completions": ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest.to_sampling_params"),
    "vllm_cpu_reload": ("vllm.model_executor.model_loader.reload", "finalize_layerwise_reload"),
    "trl_colocate_cpu": ("@gen", "VLLMGeneration.sync_weights"),
    "trl_linear_logprobs": ("trl", "GRPOTrainer._get_per_token_logps_and_entropies"),
    "transformers_fused_sample": ("transformers.generation.utils", "GenerationMixin._sample"),
    "trl_vllm_client": ("@gen", "VLLMClient.init_communicator"),
    "trl_vllm_serve": ("trl.scripts.vllm_serve", "make_parser"),
    "trl_overlap": ("trl.trainer.grpo_trainer", "GRPOTrainer._calculate_rewards"),
    "starlette_job_key": ("starlette.applications", "Starlette.__call__"),
    "submitit_adapter": ("submitit.slurm.slurm", "_make_sbatch_string"),
}


def test_every_patch_has_a_move_test():
    assert set(MOVES) == set(patches.PATCHES)


@pytest.mark.parametrize("name", sorted(MOVES))
def test_check_fails_loudly_when_its_target_moves(name, monkeypatch):
    dist, _ = patches.PATCHES[name]
    for need in (dist, *patches.REQUIRES.get(name, ())):
        if not patches.installed(need):
            pytest.skip(f"{need} is not installed")
    where, chain = MOVES[name]
    owner = _vllm_generation() if where == "@gen" else importlib.import_module(where)
    *parents, attr = chain.split(".")
    for part in parents:
        owner = getattr(owner, part)
    assert attr in vars(owner), f"{chain} is not defined where the test removes it"
    module = patches.module(name)
    module.check()  # passes while the target is there
    monkeypatch.delattr(owner, attr)
    with pytest.raises(PatchTargetMoved) as info:
        module.check()
    text = str(info.value)
    assert f"patch {name}" in text and f"{dist} {version(dist)}" in text and attr in text, text
