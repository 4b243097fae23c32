"""One forward for the old policy and the loss (ogrpo/trainer/old_policy.py): the plan says where TRL's separate
old-policy pass is redundant and why; there the trainer skips it and trains exactly as with it (losses, rewards,
TRL's sampling/* statistics, completions), with one log-prob pass fewer per step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from lossless_checks import CASES, assert_same_training


def _old_policy(tmp_path, gpus="2xcpu", ogrpo=None, **trl):
    from ogrpo.config import load_run_config
    from ogrpo.plan import plan_from_config

    cfg = tmp_path / "r.yaml"
    cfg.write_text(yaml.safe_dump({"model_name_or_path": "ogrpo:tiny", "dataset_name": "ogrpo:tiny",
                                   "reward_funcs": ["tiny_letter"], **trl,
                                   "ogrpo": {"use_vllm": True, **(ogrpo or {})}}))
    plan = plan_from_config(load_run_config(str(cfg)), gpus=gpus)
    return plan.old_policy_pass, plan.reason_of("old_policy_pass")


def test_the_plan_skips_the_old_policy_pass_exactly_where_it_is_redundant(tmp_path):
    value, why = _old_policy(tmp_path)
    assert value == "from_loss" and "aligned" in why
    assert _old_policy(tmp_path, gpus="cpu")[0] == "from_loss"  # colocated vLLM: the same rule
    assert _old_policy(tmp_path, ogrpo={"use_vllm": False}) == (None, None)  # no vLLM: no correction, no pass
    value, why = _old_policy(tmp_path, num_iterations=2)
    assert value == "separate" and "num_iterations=2" in why
    # two generations per optimizer step, both with its weights: aligned (TRL's own rule)
    assert _old_policy(tmp_path, gradient_accumulation_steps=4, steps_per_generation=2)[0] == "from_loss"
    value, why = _old_policy(tmp_path, gradient_accumulation_steps=2, steps_per_generation=4)
    assert value == "separate" and "earlier version" in why
    value, why = _old_policy(tmp_path, ogrpo={"overlap": "one-step"})
    assert value == "separate" and "one-step" in why
    value, why = _old_policy(tmp_path, ogrpo={"old_policy_pass": "separate"})
    assert value == "separate" and "run config" in why
    value, why = _old_policy(tmp_path, vllm_importance_sampling_correction=False)
    assert value == "none" and "runs no old-policy pass" in why


def _trainer(**kw):
    import torch

    args = dict(steps_per_generation=1, gradient_accumulation_steps=1, use_liger_kernel=False)
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(kw.pop("dropout", 0.0)))
    return SimpleNamespace(**{"args": SimpleNamespace(**args), "num_iterations": 1, "use_vllm": True,
                              "vllm_importance_sampling_correction": True, "model": model, **kw})


def test_the_trainer_keeps_trls_pass_where_only_it_sees_why():
    """The built trainer's own check (the plan cannot see the model): TRL's pass stays where the loss forward's
    log-probs are not the old policy's."""
    from ogrpo.trainer.old_policy import why_not

    assert why_not(_trainer()) is None
    assert "dropout" in why_not(_trainer(dropout=0.1))
    assert "earlier version" in why_not(_trainer(num_iterations=2))
    assert "earlier version" in why_not(_trainer(steps_per_generation=2))
    assert why_not(_trainer(steps_per_generation=2, gradient_accumulation_steps=4)) is None
    assert "Liger" in why_not(_trainer(use_liger_kernel=True))
    assert "no vLLM importance-sampling correction" in why_not(_trainer(vllm_importance_sampling_correction=False))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_loss_forwards_old_policy_trains_exactly_as_trls_separate_pass(tmp_path, case):
    """Per loss type and importance-sampling mode, in one process on TRL 1.16 (tests/old_policy_checks.py; the
    server runs of tests/test_overlap.py hold lossless with it to off with TRL's pass, under DDP, ZeRO-3, LoRA)."""
    assert_same_training(tmp_path, case, from_loss=True)


@pytest.mark.parametrize("key, value, hint", [("old_policy_pass", "seperate", "separate"),
                                              ("padding_free", "of", "off"), ("train_ahead", "of", "off")])
def test_a_wrong_word_for_a_lossless_switch_is_one_line_exit_2(run_cli, tmp_path, key, value, hint):
    cfg = tmp_path / "r.yaml"
    cfg.write_text("model_name_or_path: ogrpo:tiny\ndataset_name: ogrpo:tiny\nreward_funcs: [tiny_letter]\n"
                   f"ogrpo:\n  {key}: {value}\n")
    proc = run_cli("plan", "--config", str(cfg))
    assert proc.returncode == 2 and f"ogrpo.{key}: {value!r} is not one of" in proc.stderr, proc.stderr
    assert f"did you mean {hint}" in proc.stderr and "Traceback" not in proc.stderr
