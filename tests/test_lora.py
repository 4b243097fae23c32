"""LoRA for real: TRL's ModelConfig fields -> peft LoraConfig -> GRPOTrainer, and the memory the plan counts."""

from __future__ import annotations

import pytest

from error_checks import one_line_error
from ogrpo.errors import OgrpoError
from ogrpo.planner.memory import GiB, lora_params, trainer_estimate
from ogrpo.models import resolve_model
from ogrpo.planner.lora import PEFT_DEFAULT_TARGETS, lora_spec
from ogrpo.trainer.peft_config import peft_config

RECIPES = [
    {"use_peft": True},  # TRL's defaults: r 16, alpha 32, dropout 0.05, peft's targets for the model type
    {"use_peft": True, "lora_r": 64, "lora_alpha": 128, "lora_dropout": 0.0, "lora_target_modules": "all-linear"},
    {"use_peft": True, "lora_r": 8, "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
     "lora_modules_to_save": ["lm_head"], "use_rslora": True},
    {"use_peft": True, "lora_r": 4, "lora_target_modules": ["q_proj", "v_proj", "gate_proj"], "use_dora": True,
     "lora_task_type": "CAUSAL_LM"},
]


@pytest.mark.parametrize("recipe", RECIPES)
def test_same_lora_config_as_trl(recipe):
    """The mapping TRL's own scripts use (trl.trainer.utils.get_peft_config over ModelConfig)."""
    import peft  # noqa: F401  (the train extra is part of the test environment: missing fails)
    from trl import ModelConfig
    from trl.trainer.utils import get_peft_config

    ours = peft_config(recipe)
    theirs = get_peft_config(ModelConfig(**recipe))
    assert ours.to_dict() == theirs.to_dict()


def test_no_peft_no_config():
    assert peft_config({"lora_r": 8}) is None and lora_spec({"use_peft": False}) is None


@pytest.mark.parametrize("bad, word", [({"lora_r": 0}, "lora_r"), ({"lora_alpha": "big"}, "lora_alpha"),
                                       ({"lora_dropout": 1.5}, "lora_dropout"),
                                       ({"lora_target_modules": [1, 2]}, "lora_target_modules")])
def test_bad_values_are_one_line_errors(bad, word):
    assert word in str(one_line_error(peft_config, {"use_peft": True, **bad}))


def test_default_targets_are_peft_defaults():
    import peft  # noqa: F401  (the train extra is part of the test environment: missing fails)
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as peft_map

    for model_type, targets in PEFT_DEFAULT_TARGETS.items():
        assert tuple(peft_map[model_type]) == targets, model_type
    # peft has no default for Phi-3 or Qwen3-MoE: the plan says so instead of a job failing at start.
    assert "phi3" not in peft_map and "qwen3_moe" not in peft_map
    with pytest.raises(OgrpoError, match="lora_target_modules"):
        lora_params(resolve_model("microsoft/phi-4"), lora_spec({"use_peft": True}))


def _peft_trainable(model_type: str, extra: dict, recipe: dict) -> tuple[int, object]:
    """(trainable parameters peft creates, our facts) for a small transformers model of one family."""
    import json

    import torch
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from ogrpo.models import from_config_dict

    shape = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 96, "vocab_size": 300, "tie_word_embeddings": False,
             "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    cfg = AutoConfig.for_model(model_type, **{**shape, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model = get_peft_model(model, peft_config(recipe))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, from_config_dict(json.loads(cfg.to_json_string()), model_type)


@pytest.mark.parametrize("model_type, extra", [
    ("qwen2", {}), ("llama", {}), ("phi3", {}),
    ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [1]}),
])
@pytest.mark.parametrize("recipe", RECIPES[1:])
def test_adapter_count_matches_peft(model_type, extra, recipe):
    """r·(in + out) per targeted linear layer (+ out for DoRA), per layer, against what peft really builds."""
    import peft  # noqa: F401  (the train extra is part of the test environment: missing fails)
    targets = recipe["lora_target_modules"]
    if model_type == "phi3" and targets != "all-linear":
        recipe = {**recipe, "lora_target_modules": ["qkv_proj", "o_proj", "gate_up_proj"]}
    if model_type == "qwen3_moe" and targets != "all-linear":
        # peft refuses gate_proj alone on fused experts ("without also targeting up_proj"): attention only.
        recipe = {**recipe, "lora_target_modules": ["q_proj", "v_proj"]}
    trainable, facts = _peft_trainable(model_type, extra, recipe)
    adapters, saved = lora_params(facts, lora_spec(recipe))
    assert adapters + saved == trainable


def test_lora_memory_is_base_plus_adapters():
    """Qwen2.5-7B-Instruct, bf16, DDP, TRL's default LoRA (r 16 on q_proj, v_proj):
    A = 28 layers x 16 x ((3584 + 3584) + (3584 + 512)) = 28 x 16 x 11264 = 5,046,272 adapter parameters.
    Full fine-tune: 16 B per parameter (fp32 weights 4 + grads 4 + Adam 8) = 16 P.
    LoRA: bf16 base 2 P + fp32 adapters 4 A, grads 4 A, Adam 8 A = 2 P + 16 A.
    Difference: 14 P - 16 A = 14 x 7,615,616,512 - 16 x 5,046,272 = 106,538,893,312 B = 99.2 GiB."""
    m = resolve_model("Qwen/Qwen2.5-7B-Instruct")
    P, A = 7_615_616_512, 28 * 16 * ((3584 + 3584) + (3584 + 512))
    assert m.params == P and lora_params(m, lora_spec({"use_peft": True}, "bf16")) == (A, 0)
    common = dict(num_processes=1, strategy="ddp", precision="bf16", micro_batch=4, prompt_len=256,
                  completion_len=512, gradient_checkpointing=True, beta=0.04, budget_gib=40.0)
    full = trainer_estimate(m, **common)
    lora = trainer_estimate(m, lora=lora_spec({"use_peft": True}, "bf16"), **common)
    state = ("weights", "gradients", "optimizer")
    assert sum(full.terms[k] for k in state) - sum(lora.terms[k] for k in state) == pytest.approx(
        (14 * P - 16 * A) / GiB)
    # The frozen base doubles as the reference model (adapters disabled): no second copy for beta > 0. The full
    # fine-tune's reference is loaded like the policy under DDP: fp32, 4 B per parameter.
    assert full.terms["reference_model"] == pytest.approx(4 * P / GiB) and lora.terms["reference_model"] == 0
    assert full.total_gib - lora.total_gib == pytest.approx((14 * P - 16 * A + 4 * P) / GiB)


def test_fp32_base_when_asked_and_fp16_without_bf16():
    """A run config's float32 base is kept (4 B per base parameter); bf16 asked on a V100 plan loads fp16."""
    m = resolve_model("Qwen/Qwen2.5-1.5B-Instruct")
    fp32 = lora_spec({"use_peft": True, "torch_dtype": "float32"}, "bf16")
    v100 = lora_spec({"use_peft": True, "torch_dtype": "bfloat16"}, "fp16")
    assert (fp32.base_dtype, v100.base_dtype) == ("float32", "float16")
    common = dict(num_processes=1, strategy="ddp", micro_batch=1, prompt_len=16, completion_len=16,
                  gradient_checkpointing=True, beta=0.0)
    A = lora_params(m, fp32)[0]
    assert trainer_estimate(m, precision="bf16", lora=fp32, **common).terms["weights"] == pytest.approx(
        (4 * m.params + 4 * A) / GiB)
    assert trainer_estimate(m, precision="fp16", lora=v100, **common).terms["weights"] == pytest.approx(
        (2 * m.params + 4 * A) / GiB)


def test_plan_loads_the_base_it_counts(write_recipe):
    """The plan's model_init_kwargs.dtype is the base dtype its memory terms use (bf16 on an A40 with LoRA,
    where a DDP full fine-tune would load fp32 master weights): on one A40 a 7B full fine-tune needs DeepSpeed
    (16 B x 7.6B = 113 GiB of DDP state), LoRA fits with plain DDP."""
    from ogrpo.config import load_run_config
    from ogrpo.plan import plan_from_config

    recipe = ("model_name_or_path: Qwen/Qwen2.5-7B-Instruct\nper_device_train_batch_size: 8\n"
              "num_generations: 8\nmax_completion_length: 256\nuse_vllm: false\n")
    full = plan_from_config(load_run_config(write_recipe(recipe, "full.yaml")), gpus="1xA40").to_dict()
    lora = plan_from_config(load_run_config(write_recipe(recipe + "use_peft: true\nlora_r: 32\n", "lora.yaml")),
                            gpus="1xA40").to_dict()
    assert lora["trainer_args"]["model_init_kwargs"]["dtype"] == "bfloat16"
    assert full["trainer"]["strategy"] != "ddp"
    assert lora["trainer"]["strategy"] == "ddp" and lora["fits"]
    A = 28 * 32 * ((3584 + 3584) + (3584 + 512))
    assert lora["trainer"]["memory_terms"]["terms"]["weights"] == pytest.approx(
        (2 * 7_615_616_512 + 4 * A) / GiB, abs=1e-3)


def test_two_grpo_steps_change_only_the_adapters(tmp_path, monkeypatch):
    """A real 2-step GRPO run on the tiny model with use_peft: every base weight is bit-identical to the
    checkpoint it was loaded from, every LoRA B matrix (zero at init) has moved."""
    import torch
    import peft  # noqa: F401  (the train extra is part of the test environment: missing fails)
    from safetensors.torch import load_file

    from ogrpo.trainer.assembly import build_trainer, prepare

    monkeypatch.chdir(tmp_path)
    p = prepare("tiny", output_dir=tmp_path / "run",
                overrides={"max_steps": 2, "save_strategy": "no", "use_peft": True, "lora_r": 8,
                           "lora_target_modules": ["q_proj", "v_proj", "down_proj"], "lora_dropout": 0.0})
    trainer = build_trainer(p)
    model = trainer.model
    before = {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" in k}
    trainer.train()
    assert trainer.state.global_step == 2
    base = load_file(f"{p.model_path}/model.safetensors")
    merged_names = 0
    for name, param in model.named_parameters():
        if "lora_" in name:
            continue
        key = name.replace("base_model.model.", "").replace(".base_layer", "")
        assert not param.requires_grad, name
        assert torch.equal(param.detach(), base[key]), name
        merged_names += 1
    assert merged_names == len({k for k in base})  # every base tensor compared (tied head counted once)
    lora_b = [k for k in before if "lora_B" in k]
    assert len(lora_b) == 2 * 3  # 2 layers x 3 targeted modules
    for k, v in model.named_parameters():
        if k in before and "lora_B" in k:
            assert not torch.equal(v.detach(), before[k]), k


def test_weight_file_holds_the_merged_weights(tmp_path):
    """TRL's PEFT sync yields the merged weights and unmerges them in place when the iteration ends, before
    the CPU client writes its file: the file must hold what was yielded, not what the tensors hold later."""
    import torch
    from safetensors.torch import load_file

    from ogrpo.serve.client import write_weights_file

    base = torch.zeros(4, 4)
    delta = torch.ones(4, 4)

    def merged_then_unmerged():  # the shape of VLLMGeneration._iter_named_params with a PeftModel
        base.add_(delta)  # merge_adapter()
        yield "model.layers.0.self_attn.q_proj.weight", base.data
        base.sub_(delta)  # unmerge_adapter(), run when the consumer asks for the next item

    path, n = write_weights_file(merged_then_unmerged(), str(tmp_path))
    assert n == 1 and torch.equal(load_file(path)["model.layers.0.self_attn.q_proj.weight"], delta)
    assert torch.equal(base, torch.zeros(4, 4))


def test_v100_lora_loads_fp16_base_and_lists_the_change(write_recipe):
    """A LoRA recipe written for bf16 GPUs: on V100 (no bf16) the base loads in fp16, listed as a change."""
    from ogrpo.config import load_run_config
    from ogrpo.plan import plan_from_config

    recipe = write_recipe("model_name_or_path: Qwen/Qwen2.5-1.5B-Instruct\ntorch_dtype: bfloat16\nbf16: true\n"
                          "use_peft: true\nper_device_train_batch_size: 8\nnum_generations: 8\n"
                          "max_completion_length: 512\n", "v100.yaml")
    p = plan_from_config(load_run_config(recipe), gpus="4xV100-32G").to_dict()
    assert p["fits"] and p["trainer_args"]["model_init_kwargs"]["dtype"] == "float16"
    assert [c["to"] for c in p["changes"] if c["key"] == "torch_dtype"] == ["float16"]
    A = 28 * 16 * ((1536 + 1536) + (1536 + 256))
    assert p["trainer"]["memory_terms"]["terms"]["weights"] == pytest.approx(
        (2 * 1_543_714_304 + 4 * A) / GiB, abs=1e-3)


@pytest.mark.integration
@pytest.mark.slow
def test_colocated_vllm_gets_the_merged_weights(tmp_path):
    """Colocate mode on CPU with LoRA (ogrpo/patches/trl_colocate_cpu.py reloads vLLM from TRL's PEFT iterator):
    after each push vLLM's log-probs match the trainer's base + adapters within 1e-4."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "run"
    steps = 3
    sets = ["ogrpo.use_vllm=true", f"max_steps={steps}", "save_strategy=no", "use_peft=true", "lora_r=8",
            "lora_alpha=16", "lora_dropout=0.0", "learning_rate=0.01"]
    argv = [str(Path(sys.executable).with_name("ogrpo")), "train", "--config", "tiny", "--output-dir", str(out)]
    for item in sets:
        argv += ["--set", item]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=str(tmp_path), timeout=540,
                          env=dict(os.environ, COLUMNS="120", OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    gaps = [r["sampling/sampling_logp_difference/mean"] for r in rows if "sampling/sampling_logp_difference/mean" in r]
    assert len(gaps) == steps and max(gaps) < 1e-4, gaps
    assert json.loads((out / "manifest.json").read_text())["grpo_config"]["vllm_mode"] == "colocate"
