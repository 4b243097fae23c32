"""The plan chooses O-GRPO's kernels and the memory model follows: with linear_logprobs on, the logits term is
one chunk, whatever the batch and completion length."""

from __future__ import annotations

from ogrpo.config import load_run_config
from ogrpo.planner.memory import trainer_estimate
from ogrpo.models import resolve_model
from ogrpo.plan import plan_from_config, plan_kernels

GiB = 1024**3


def test_logits_term_is_one_chunk_with_the_kernel():
    m = resolve_model("Qwen/Qwen2.5-1.5B-Instruct")  # V = 151,936
    kw = dict(num_processes=2, strategy="ddp", precision="bf16", micro_batch=8, prompt_len=512, completion_len=1024,
              gradient_checkpointing=True, beta=0.0)
    full = trainer_estimate(m, **kw).terms["logits"]
    fused = trainer_estimate(m, **kw, fused_logprobs=True).terms["logits"]
    # TRL: 8 x 1024 tokens x 151,936 x (2 x 2 B bf16 + 4 B fp32) = 9.27 GiB
    assert abs(full - 8 * 1024 * 151_936 * 8 / GiB) < 1e-6
    # ours: 2 fp32 buffers of one chunk: 331 rows (192 MiB / (4 B x V)) x V x 4 B x 2 = 0.37 GiB
    assert abs(fused - 2 * 331 * 151_936 * 4 / GiB) < 1e-6
    assert trainer_estimate(m, **{**kw, "micro_batch": 64}, fused_logprobs=True).terms["logits"] == fused


def test_choice_follows_profile_mode_and_the_config():
    assert plan_kernels("balanced", "none", False, None)["fused_sample"][0] is True
    assert plan_kernels("balanced", "server", False, None)["fused_sample"][0] is False  # vLLM samples
    assert plan_kernels("conservative", "none", False, None)["linear_logprobs"][0] is False
    assert plan_kernels("conservative", "none", False, True)["linear_logprobs"][0] is True
    assert plan_kernels("aggressive", "none", True, None)["linear_logprobs"][0] is False  # Liger owns the loss
    assert not any(on for on, _ in plan_kernels("aggressive", "none", False, False).values())


def test_plan_reports_its_kernels_and_a_config_can_turn_them_off(tmp_path):
    plan = plan_from_config(load_run_config("tiny"), gpus="cpu").to_dict()
    assert plan["kernels"] == {"linear_logprobs": True, "fused_sample": True}
    names = {s["name"]: s for s in plan["settings"]}
    assert "chunk" in names["kernels.linear_logprobs"]["reason"]
    off = plan_from_config(load_run_config("tiny", {"ogrpo": {"kernels": False}}), gpus="cpu").to_dict()
    assert off["kernels"] == {"linear_logprobs": False, "fused_sample": False}


def _logprobs(recipe: str, gpus: str, overrides: dict | None = None) -> tuple[bool, str, str]:
    plan = plan_from_config(load_run_config(recipe, overrides), gpus=gpus)
    reason = next(s.reason for s in plan.settings if s.name == "kernels.linear_logprobs")
    return plan.kernels.to_dict()["linear_logprobs"], reason, plan.trainer.strategy


MATH_1_5B = "slurm/examples/recipes/qwen2.5-1.5b-math.yaml"  # Qwen2.5-1.5B, 8 x 1024 completion tokens


def test_on_a_gpu_the_kernel_is_on_only_where_memory_needs_it():
    """issue 34: on an H200 linear_logprobs ran ~1.5x slower than TRL's full logits, so a GPU plan keeps it only
    where the full logits would not fit or would force a worse fit; on CPU (where it is faster) it stays on."""
    # a small model on one A40: 0.0 GiB of logits fit beside DDP either way
    on, why, strategy = _logprobs("tiny-math", "1xA40")
    assert (on, strategy) == (False, "ddp") and why.startswith("full logits fit: DDP either way")
    # the 1.5B recipe on 4xV100-32G fits ZeRO-2 with 9.3 GiB of full logits too: off, TRL's faster path
    on, why, strategy = _logprobs(MATH_1_5B, "4xV100-32G")
    assert (on, strategy) == (False, "zero2") and "full logits fit: ZeRO-2" in why and "9.3 GiB" in why
    # ... with 2048-token completions (18.5 GiB of logits) only ZeRO-3 + offload would hold them: on
    on, why, strategy = _logprobs(MATH_1_5B, "4xV100-32G", {"max_completion_length": 2048})
    assert (on, strategy) == (True, "zero2")
    assert why.startswith("without it ZeRO-3 with optimizer offload") and "instead of ZeRO-2" in why
    # on 3xA40 the full logits would push DDP to ZeRO-2 (the all-reduce buckets leave no room for them)
    on, why, strategy = _logprobs(MATH_1_5B, "3xA40")
    assert (on, strategy) == (True, "ddp") and why.startswith("without it ZeRO-2") and "instead of DDP" in why
    # on 4xV100-16G the full logits would force ZeRO-3 + offload (the optimizer states then live on the host)
    on, why, strategy = _logprobs(MATH_1_5B, "4xV100-16G")
    assert (on, strategy) == (True, "zero2") and why.startswith("without it ZeRO-3 with optimizer offload")
    # and where nothing fits without it, it stays on: the only answer is a smaller micro-batch
    on, why, _ = _logprobs(MATH_1_5B, "4xV100-16G", {"max_completion_length": 2048})
    assert on and why.startswith("without it nothing fits")
    # `ogrpo.kernels: true` keeps it on regardless; CPU keeps it on (it is the faster path there)
    assert _logprobs("tiny-math", "1xA40", {"ogrpo": {"kernels": True}})[0] is True
    on, why, _ = _logprobs("tiny-math", "cpu")
    assert on and "chunk" in why
