"""The plan's hardware-aware settings reach the trainer: the GRPOConfig GRPOTrainer received, for a V100 plan and
an A40 plan made by the real planner. The trainer is intercepted at construction, so no model is built with
settings this CPU cannot run; transformers' hardware checks are told they run on that GPU (TF32 and bf16 exist
on an A40, not on this CPU), and nothing else is faked."""

from __future__ import annotations

import os

import pytest
import yaml

from ogrpo import tiny


class Received(BaseException):
    """Raised by the recorder: not an Exception, which the trainer entry turns into a one-line build error."""


@pytest.fixture
def captured(monkeypatch):
    """Replace the trainer class by a recorder; the run stops right after the trainer gets its arguments."""
    from ogrpo.trainer import grpo

    got = {}

    class Recorder:
        def __init__(self, *args, **kwargs):
            got.update(kwargs)
            raise Received

    monkeypatch.setattr(grpo, "OgrpoGRPOTrainer", Recorder)
    saved = dict(os.environ)
    yield got
    os.environ.clear()
    os.environ.update(saved)  # the plan's env (e.g. PYTORCH_CUDA_ALLOC_CONF) must not leak into other tests


def _pretend_gpu(monkeypatch, tf32: bool, bf16: bool, catalog: str, memory_gib: float):
    import transformers.training_args as ta

    from ogrpo import device_check
    from ogrpo.trainer import settings

    monkeypatch.setattr(settings, "cuda_available", lambda: True)
    # the trainer's start-up check sees the planned GPU model (it refuses a GPU plan without one)
    monkeypatch.setattr(device_check, "visible_gpus", lambda: [
        {"index": 0, "name": catalog, "catalog": catalog, "memory_gib": memory_gib}])
    monkeypatch.setattr(ta, "is_torch_tf32_available", lambda: tf32)
    monkeypatch.setattr(ta, "is_torch_bf16_gpu_available", lambda: bf16)
    monkeypatch.setattr(ta, "enable_tf32", lambda on: None)  # would flip torch.backends flags process-wide


def _rendered_config(tmp_path, gpus: str) -> str:
    """A run config as `ogrpo render` writes it: the recipe plus the plan made for `gpus`."""
    from ogrpo.config import load_run_config
    from ogrpo.plan import plan_from_config

    rc = load_run_config("tiny")
    plan = plan_from_config(rc, gpus=gpus, model=str(tiny.ensure_tiny_model())).to_dict()
    data = rc.to_dict()
    data["ogrpo"] = {**data.get("ogrpo", {}), "gpus": gpus, "plan": plan}
    path = tmp_path / f"run-{gpus}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _train_until_trainer(config: str, out) -> None:
    from ogrpo.trainer.assembly import train

    with pytest.raises(Received):
        train(config, output_dir=out)


def test_v100_plan_gives_fp16_sdpa_no_tf32(tmp_path, captured, monkeypatch):
    _pretend_gpu(monkeypatch, tf32=False, bf16=False, catalog="V100-32G", memory_gib=32.0)
    _train_until_trainer(_rendered_config(tmp_path, "2xV100"), tmp_path / "out")
    args = captured["args"]
    assert type(args).__name__ == "GRPOConfig"
    assert args.fp16 is True and args.bf16 is False and args.tf32 is False
    assert args.model_init_kwargs["attn_implementation"] == "sdpa"
    assert args.use_cpu is False and args.optim == "adamw_torch_fused"
    assert captured["model"] == str(tiny.ensure_tiny_model())  # a path: TRL builds the model with these kwargs


def test_a40_plan_gives_bf16_tf32_flash_attention(tmp_path, captured, monkeypatch):
    _pretend_gpu(monkeypatch, tf32=True, bf16=True, catalog="A40", memory_gib=45.0)
    _train_until_trainer(_rendered_config(tmp_path, "3xA40"), tmp_path / "out")
    args = captured["args"]
    assert args.bf16 is True and args.fp16 is False and args.tf32 is True
    assert args.model_init_kwargs["attn_implementation"] == "flash_attention_2"
    assert args.dataloader_num_workers == 2


def test_cpu_plan_on_this_machine(tmp_path, captured):
    _train_until_trainer("tiny", tmp_path / "out")
    args = captured["args"]
    assert args.use_cpu is True and args.bf16 is False and args.fp16 is False
    assert args.model_init_kwargs == {"attn_implementation": "sdpa", "dtype": "float32"}
    assert args.use_vllm is False and args.seed == 42


def test_plan_overrides_run_config_and_vllm_url_selects_server_mode(tmp_path):
    """Pure part: plan trainer_args win over the recipe; unknown plan keys are reported, not passed."""
    from ogrpo.trainer.settings import grpo_config_kwargs

    trl = {"bf16": True, "learning_rate": 1e-5, "dataset_name": "x", "attn_implementation": "eager",
           "dtype": "bfloat16"}
    from ogrpo.hardware import parse_gpus
    from ogrpo.planner.types import Plan

    plan = Plan.from_dict({"cluster": parse_gpus("4xV100-32G").to_dict(), "precision": "fp16",
                           "attn_implementation": "sdpa",
                           "trainer_args": {"bf16": False, "fp16": True, "not_a_grpo_field": 1,
                                            "model_init_kwargs": {"attn_implementation": "sdpa"}}})
    kw, notes = grpo_config_kwargs(trl, plan, tmp_path, vllm_url="http://h:1234")
    assert kw["bf16"] is False and kw["fp16"] is True and kw["learning_rate"] == 1e-5
    assert "dataset_name" not in kw and "not_a_grpo_field" not in kw and "not_a_grpo_field" in notes[0]
    assert kw["model_init_kwargs"] == {"attn_implementation": "sdpa", "dtype": "bfloat16"}
    assert kw["vllm_server_base_url"] == "http://h:1234" and kw["use_vllm"] is True and kw["vllm_mode"] == "server"
