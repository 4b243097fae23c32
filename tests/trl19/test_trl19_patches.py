"""Every library patch's check against the images' TRL line as installed (TRL 1.9.2, transformers 5.5.4):
tests/test_patches.py runs the same checks in the main env (TRL 1.16)."""

from __future__ import annotations

import pytest

from ogrpo import patches
from ogrpo.patches.target import PatchTargetMoved


def test_every_patch_check_passes_on_the_images_trl_line():
    report = patches.run_checks()
    assert {name: r["detail"] for name, r in report.items() if r["status"] == "failed"} == {}
    # what a run on this line installs: vouched for here, not skipped
    for name in ("trl_trainer_overrides", "trl_vllm_wraps", "trl_vllm_client", "trl_linear_logprobs",
                 "trl_vllm_serve", "trl_overlap", "transformers_fused_sample", "trl_stream"):
        assert report[name]["status"] == "ok", report[name]
    # what this line never takes is skipped with the reason, not passed (its push has no per-parameter iterator)
    for name in ("trl_zero3_push", "trl_colocate_cpu"):
        assert report[name]["status"] == "skipped" and "trl 1.9.2: " in report[name]["detail"], report[name]


def test_the_overridden_trainer_methods_are_checked_on_this_line(monkeypatch):
    """OgrpoGRPOTrainer's overrides (ogrpo/trainer/overrides.py) against TRL 1.9.2's GRPOTrainer, and the class
    itself built on this line."""
    from trl.trainer import grpo_trainer

    from ogrpo.trainer.grpo import LAYERS, OgrpoGRPOTrainer

    assert OgrpoGRPOTrainer.__mro__[len(LAYERS) + 1] is grpo_trainer.GRPOTrainer
    monkeypatch.delattr(grpo_trainer.GRPOTrainer, "training_step")  # falls back to transformers' Trainer's
    patches.module("trl_trainer_overrides").check()  # inherited still counts: super() reaches it
    monkeypatch.delattr(grpo_trainer.GRPOTrainer, "_generate_and_score_completions")
    with pytest.raises(PatchTargetMoved, match=r"patch trl_trainer_overrides cannot apply to trl 1\.9\.2: .*"
                                               r"_generate_and_score_completions is gone"):
        patches.module("trl_trainer_overrides").check()


@pytest.mark.parametrize("where,attr", [("vllm:LLM", "enqueue"), ("trl.scripts.vllm_serve", "Pipe")])
def test_the_streaming_handler_fails_loudly_when_its_target_moves(where, attr, monkeypatch):
    """ogrpo.serve.trl_stream (O-GRPO's `/generate/` for `trl vllm-serve`) refuses to start on a moved target."""
    import importlib

    module, _, cls = where.partition(":")
    owner = importlib.import_module(module)
    owner = getattr(owner, cls) if cls else owner
    stream = patches.module("trl_stream")
    stream.check()
    monkeypatch.delattr(owner, attr)
    with pytest.raises(PatchTargetMoved, match=rf"patch trl_stream cannot apply to trl 1\.9\.2: .*{attr}"):
        stream.check()

