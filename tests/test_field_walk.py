"""No silent drop: every field of TRL's GRPOConfig / ModelConfig / ScriptArguments (TRL 1.16 as installed, TRL 1.9
from the vendored table) and every open-r1 argument has a rule in ogrpo/fields.py, and the rule holds: a recipe
that sets the field gets it in the run (GRPOConfig keyword arguments, model init, LoRA config, data/reward/env
options) or finds it in the plan's `changes` with a reason.

A new TRL field fails `test_every_field_has_a_rule` until someone classifies it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from ogrpo import fields as rules
from ogrpo.config import DATA_DIR, load_run_config
from ogrpo.errors import OgrpoError
from ogrpo.plan import plan_from_config
from ogrpo.trainer.settings import grpo_config_kwargs

# open-r1's own argument classes (huggingface/open-r1 src/open_r1/configs.py: GRPOConfig and GRPOScriptArguments
# additions over TRL's, read at 8d139cbe and 078c5e17, plus the HEAD keys dataset_mixture and the reward
# parameters its README documents) and the keys its older recipes carry.
OPEN_R1_FIELDS = (
    "benchmarks", "callbacks", "chat_template", "system_prompt", "hub_model_revision", "overwrite_hub_revision",
    "push_to_hub_revision", "wandb_entity", "wandb_project", "wandb_run_group", "wandb_log_unique_prompts",
    "num_completions_to_print", "reward_funcs", "cosine_min_value_wrong", "cosine_max_value_wrong",
    "cosine_min_value_correct", "cosine_max_value_correct", "cosine_max_len", "repetition_n_grams",
    "repetition_max_penalty", "code_language", "code_eval_test_batch_size", "code_eval_scoring_mode",
    "parallel_code_exec_per_proc", "dataset_prompt_column", "e2b_router_url", "morph_router_url", "code_provider",
    "ioi_provider", "max_completion_len", "soft_punish_cache", "enforce_same_language", "dataset_mixture",
    "dataset_configs", "dataset_config", "dataset_name",
)
OLDER_RECIPE_KEYS = ("torch_dtype", "max_prompt_length", "overwrite_output_dir", "warmup_ratio", "vllm_device",
                     "vllm_enable_prefix_caching", "evaluation_strategy", "logging_dir", "num_processes",
                     "vllm_data_parallel_size")

LINES = {
    # line -> (cluster the job runs on, GRPOConfig field names of that line)
    rules.CPU_LINE: "cpu",
    rules.IMAGE_LINE: "4xV100-32G",
}


def _installed_tables() -> dict[str, dict]:
    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig
    from trl.scripts.grpo import GRPOScriptArguments

    out = {}
    for cls in (GRPOConfig, ModelConfig, GRPOScriptArguments, DatasetMixtureConfig):
        out[cls.__name__] = {f.name: f for f in dataclasses.fields(cls) if f.init}
    return out


def _image_table() -> dict[str, dict]:
    """TRL 1.9.2's dataclasses as read from its wheel (ogrpo/data/vendor_trl_fields.py)."""
    return json.loads((DATA_DIR / "trl_fields_1.9.json").read_text())


def _image_grpo_fields() -> dict[str, dict]:
    return _image_table()["GRPOConfig"]


def test_every_field_has_a_rule():
    names = set()
    for table in _installed_tables().values():
        names |= set(table)
    image = _image_table()
    for group in ("GRPOConfig", "ModelConfig", "GRPOScriptArguments", "DatasetMixtureConfig"):
        assert image[group], group  # the vendored table has the group
        names |= set(image[group])
    names |= set(OPEN_R1_FIELDS) | set(OLDER_RECIPE_KEYS)
    missing = sorted(n for n in names if rules.rule(n) is None)
    assert not missing, f"classify these in ogrpo/fields.py: {missing}"
    assert {r.kind for r in rules.RULES.values()} <= set(rules.KINDS)
    # A rule that is not `pass` says where the value goes or why it does not.
    for name, r in rules.RULES.items():
        assert r.target if r.kind in (rules.PASS, rules.PLANNED, rules.MAPPED) else r.reason, name


def _value(info_kinds, default, key=""):
    """A value of the field's kind that differs from its default (what a recipe that sets it would hold); for an
    field with a fixed set of values, another of those every TRL line that lists them accepts."""
    from ogrpo.values import _choices

    listed = [set(table[key]) for table in _choices().values() if table.get(key)]
    if listed:
        return sorted(set.intersection(*listed) - {default})[0]
    kinds = set(info_kinds)
    if "bool" in kinds:
        return not default if isinstance(default, bool) else True
    if "int" in kinds:
        return 4 if default == 3 else 3
    if "float" in kinds:
        return 0.25 if default == 0.5 else 0.5
    if "dict" in kinds:
        return {"v": 1}
    if "list" in kinds:
        return ["v"]
    return "v"


def _honored(key, value, kwargs) -> bool:
    if key == "model_init_kwargs":
        return all(kwargs.get(key, {}).get(k) == v for k, v in value.items())
    if key in kwargs:
        return kwargs[key] == value
    renamed = rules.LINE_RENAMES.get(rules.CPU_LINE, {}).get(key)
    return renamed is not None and kwargs.get(renamed) == value


def _line_fields(line: str) -> dict[str, list[str]]:
    """name -> the YAML kinds the config accepts for it (TRL 1.16's where both lines have the field)."""
    from ogrpo.config import _field_index

    names = (json.loads((DATA_DIR / "trl_fields.json").read_text())["GRPOConfig"] if line == rules.CPU_LINE
             else _image_grpo_fields())
    return {k: _field_index()[k]["kinds"] for k in names}


@pytest.mark.slow
@pytest.mark.parametrize("line", sorted(LINES))
def test_every_grpo_config_field_reaches_the_trainer_or_is_listed(line, tiny_model_dir, tmp_path):
    """Set each GRPOConfig field of the line alone; plan for the line's hardware; build the trainer's GRPOConfig
    keyword arguments with that line's field names. `pass` fields must arrive unchanged; the others arrive or
    are listed in plan.changes."""
    line_fields = _line_fields(line)
    names = frozenset(line_fields)
    defaults = (json.loads((DATA_DIR / "trl_fields.json").read_text())["GRPOConfig"] if line == rules.CPU_LINE
                else _image_grpo_fields())
    silent, wrong_pass = [], []
    for key, kinds in sorted(line_fields.items()):
        value = _value(kinds, defaults[key].get("default"), key)
        rc = load_run_config({"model_name_or_path": str(tiny_model_dir), key: value})
        try:
            plan = plan_from_config(rc, gpus=LINES[line])
        except OgrpoError:
            continue  # refused (a feature the line's image cannot run): not silent either

        kwargs, _ = grpo_config_kwargs(rc.trl, plan, tmp_path / "run", fields=names)
        listed = plan.change(key) is not None
        if rules.rule(key).kind == rules.PASS:
            if not _honored(key, value, kwargs):
                wrong_pass.append(key)
        elif not (_honored(key, value, kwargs) or listed):
            silent.append(key)
    assert not wrong_pass, f"`pass` fields that do not reach GRPOConfig as written: {wrong_pass}"
    assert not silent, f"fields changed without a word: {silent}"


def test_a_field_of_the_other_line_is_listed_not_dropped(tiny_model_dir):
    # dataloader_in_order exists in TRL 1.16 only: a GPU plan (TRL 1.9 images) lists it; a CPU plan keeps it.
    rc = load_run_config({"model_name_or_path": str(tiny_model_dir), "dataloader_in_order": True,
                          "logging_dir": "tb"})
    gpu = {c.key: c.to_dict() for c in plan_from_config(rc, gpus="4xV100-32G").changes}
    cpu = {c.key: c.to_dict() for c in plan_from_config(rc, gpus="cpu").changes}
    assert "TRL 1.9.2" in gpu["dataloader_in_order"]["reason"] and "dataloader_in_order" not in cpu
    assert "TRL 1.16.0" in cpu["logging_dir"]["reason"] and "logging_dir" not in gpu


def test_model_config_and_script_arguments(tiny_model_dir, tmp_path):
    """The ModelConfig / ScriptArguments / older keys O-GRPO's trainer reads instead of TRL's script."""
    rc = load_run_config({"model_name_or_path": str(tiny_model_dir), "model_revision": "v2", "torch_dtype": "float16",
                          "attn_implementation": "eager", "evaluation_strategy": "no", "max_prompt_length": 40,
                          "vllm_enable_prefix_caching": False, "wandb_project": "p", "wandb_entity": "e",
                          "wandb_run_group": "g", "load_in_4bit": True, "dataset_streaming": True,
                          "reward_model_name_or_path": "rm", "datasets": [{"path": "x"}], "dataset_mixture": {"a": 1},
                          "chat_template": "{{x}}", "callbacks": ["push_to_hub_revision"], "vllm_device": "auto",
                          "use_vllm": True, "ignore_bias_buffers": True, "dataset_test_split": "val",
                          "code_provider": "morph"})
    plan = plan_from_config(rc, gpus="cpu")
    kwargs, _ = grpo_config_kwargs(rc.trl, plan, tmp_path / "run")
    init = kwargs["model_init_kwargs"]
    assert init["revision"] == "v2"
    changes = {c.key: c.to_dict() for c in plan.changes}
    # CPU trains in fp32: the recipe's float16 is listed; its "eager" attention runs on CPU and is kept.
    assert changes["torch_dtype"]["to"] == "float32" and init["dtype"] == "float32"
    assert init["attn_implementation"] == "eager" == plan.attn_implementation and "attn_implementation" not in changes
    assert plan.batch.prompt_length == 40
    assert plan.vllm.args.to_dict()["enable_prefix_caching"] is False
    assert (plan.env["WANDB_PROJECT"], plan.env["WANDB_ENTITY"], plan.env["WANDB_RUN_GROUP"]) == ("p", "e", "g")
    for key in ("load_in_4bit", "dataset_streaming", "reward_model_name_or_path", "callbacks", "vllm_device", "ignore_bias_buffers", "dataset_test_split", "code_provider"):
        assert key in changes and changes[key]["reason"], key
    # the trainer loads both mixtures (ogrpo/trainer/data.py) and sets the recipe's chat template on the tokenizer:
    # used, so not listed as dropped
    assert "datasets" not in changes and "dataset_mixture" not in changes and "chat_template" not in changes
    from ogrpo.trainer.assembly import load_tokenizer

    assert load_tokenizer(str(tiny_model_dir), rc.trl).chat_template == "{{x}}"
    assert not any("dataset_mixture" in w and "not applied" in w for w in rc.warnings)


def test_open_r1_mapped_keys_reach_their_targets(tiny_model_dir):
    from ogrpo.rewards import registry as rewards

    rc = load_run_config({"model_name_or_path": str(tiny_model_dir), "dataset_prompt_column": "problem",
                          "system_prompt": "think", "dataset_configs": ["all"]})
    assert (rc.ogrpo.prompt_column, rc.ogrpo.system_prompt, rc.trl["dataset_config"]) == ("problem", "think", "all")
    mapped_to_rewards = {k for k, r in rules.RULES.items() if r.target.startswith("reward factory")}
    # the reward registry binds exactly these recipe keys to open-r1's reward factories
    assert mapped_to_rewards == set(rewards.RECIPE_KEYS)


LORA_ATTRS = {"lora_r": ("r", 8), "lora_alpha": ("lora_alpha", 7), "lora_dropout": ("lora_dropout", 0.2),
              "lora_target_modules": ("target_modules", ["q_proj"]), "lora_modules_to_save": ("modules_to_save",
                                                                                         ["lm_head"]),
              "lora_task_type": ("task_type", "CAUSAL_LM"), "use_rslora": ("use_rslora", True),
              "use_dora": ("use_dora", True), "lora_target_parameters": ("target_parameters", ["mlp.experts"])}


def test_lora_fields_reach_the_peft_config():
    import peft  # noqa: F401  (the train extra is part of the test environment: missing fails)
    from ogrpo.trainer.peft_config import peft_config

    lora_rules = {k for k, r in rules.RULES.items() if r.target.startswith("peft LoraConfig")}
    assert lora_rules == set(LORA_ATTRS) | {"use_peft"}
    trl = {"use_peft": True, **{k: v for k, (_, v) in LORA_ATTRS.items()}}
    cfg = peft_config(trl)
    for key, (attr, value) in LORA_ATTRS.items():
        got = getattr(cfg, attr)
        got = sorted(got) if isinstance(got, (set, list)) else got
        assert got == (sorted(value) if isinstance(value, list) else value), key


def _flat_plan_values(plan) -> dict:
    targs = plan.trainer_args.to_dict()
    mik = targs.pop("model_init_kwargs", None) or {}
    return {**targs, **{k: v for k, v in mik.items() if k in ("attn_implementation", "dtype")}}


@pytest.mark.parametrize("gpus", ["3xA40", "4xV100-32G", "cpu"])
def test_changes_list_every_value_the_plan_sets(gpus, basic_recipe, open_r1_recipe):
    """Each value the plan gives the trainer is the recipe's own, or (unset there) what `trl grpo` of the job's TRL
    line would use, or a listed change. A recipe that sets none of them gets TF32, attention, fused AdamW and
    dataloader workers listed too."""
    for recipe in (basic_recipe, open_r1_recipe):
        rc = load_run_config(recipe)
        plan = plan_from_config(rc, gpus=gpus)
        line = rules.CPU_LINE if gpus == "cpu" else rules.IMAGE_LINE
        listed = {c.key for c in plan.changes}
        aliases = {"dtype": ("dtype", "torch_dtype"), "attn_implementation": ("attn_implementation",)}
        for key, value in _flat_plan_values(plan).items():
            user = next((rc.trl[k] for k in aliases.get(key, (key,)) if rc.trl.get(k) is not None), None)
            expected = user if user is not None else rules.line_default(line, key)
            if value != expected:
                assert set(aliases.get(key, (key,))) & listed, (recipe.name, gpus, key, value, expected)
    basic = {c.key: c.to_dict() for c in plan_from_config(load_run_config(basic_recipe), gpus=gpus).changes}
    if gpus == "3xA40":
        assert basic["tf32"]["to"] is True and basic["optim"]["to"] == "adamw_torch_fused"
        assert basic["attn_implementation"]["to"] == "flash_attention_2"
        assert basic["dataloader_num_workers"]["to"] == 2
        assert "not set in the recipe" in basic["tf32"]["reason"]
    if gpus == "cpu":
        assert basic["optim"] == {"key": "optim", "from": "adamw_torch_fused", "to": "adamw_torch",
                                  "reason": basic["optim"]["reason"]}


def test_strict_refuses_settings_for_unset_keys(run_cli, basic_recipe):
    proc = run_cli("plan", "--gpus", "3xA40", "--config", basic_recipe, "--strict")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    for key in ("tf32 would change", "optim would change", "attn_implementation would change",
                "dataloader_num_workers would change"):
        assert key in proc.stderr, key


def test_fsdp_with_a_deepspeed_or_ddp_plan_is_a_change(tiny_model_dir, tmp_path):
    """O-GRPO plans DDP or ZeRO via accelerate: the recipe's FSDP is listed as changed and kept out of
    GRPOConfig (it would conflict with the DeepSpeed launch)."""
    rc = load_run_config({"model_name_or_path": str(tiny_model_dir), "fsdp": "full_shard auto_wrap",
                          "fsdp_config": {"min_num_params": 1}})
    for gpus in ("cpu", "4xV100-32G"):
        plan = plan_from_config(rc, gpus=gpus)
        changes = {c.key: c.to_dict() for c in plan.changes}
        assert changes["fsdp"]["from"] == "full_shard auto_wrap" and changes["fsdp"]["to"] is None
        assert "not FSDP" in changes["fsdp"]["reason"] and "fsdp_config" in changes
        kwargs, _ = grpo_config_kwargs(rc.trl, plan, tmp_path / "run")
        assert kwargs.get("fsdp") is None and kwargs.get("fsdp_config") is None


def test_older_names_are_mapped_or_listed(tiny_model_dir, tmp_path):
    base = {"model_name_or_path": str(tiny_model_dir)}
    rc = load_run_config({**base, "use_liger_loss": True, "vllm_max_model_len": 2048,
                          "vllm_guided_decoding_regex": "a+", "top_k": None, "gradient_checkpointing_use_reentrant":
                          True})
    assert rc.trl["use_liger_kernel"] is True and rc.trl["vllm_max_model_length"] == 2048
    assert rc.trl["vllm_structured_outputs_regex"] == "a+" and rc.trl["top_k"] == 0
    assert rc.trl["gradient_checkpointing_kwargs"] == {"use_reentrant": True}
    warned = " ".join(rc.warnings)
    assert "use_liger_loss: a key of older TRL" in warned and "mapped to use_liger_kernel" in warned
    assert "top_k: null mapped to 0" in warned
    # both names set to different values: today's key wins and the older one is a listed change
    rc = load_run_config({**base, "use_liger_loss": False, "use_liger_kernel": True,
                          "code_eval_partial_grading": True, "remote_gen_model_url": "http://x",
                          "vllm_dtype": "bfloat16"})
    changes = {c.key: c.to_dict() for c in plan_from_config(rc, gpus="4xV100-32G").changes}
    assert changes["use_liger_loss"]["to"] is True and "use_liger_kernel is applied" in changes[
        "use_liger_loss"]["reason"]
    for key in ("code_eval_partial_grading", "remote_gen_model_url", "vllm_dtype"):
        assert changes[key]["reason"], key


MODEL = "model_name_or_path: Qwen/Qwen2.5-1.5B\n"


@pytest.mark.parametrize("key", sorted(rules.NULL_REFUSED))
def test_a_null_trl_does_not_honor_is_refused(write_recipe, key):
    """GRPOConfig types these Optional, but TRL (or the plan) cannot run what a null says: one line, not a plan of
    something else or a failure at job start."""
    with pytest.raises(OgrpoError, match=f"{key}: null: .*give a value or leave the key out"):
        plan_from_config(load_run_config(write_recipe(f"{MODEL}{key}: null\n")), gpus="cpu")


def test_warmup_ratio_beside_warmup_steps_is_listed_as_dropped(write_recipe):
    plan = plan_from_config(load_run_config(write_recipe(f"{MODEL}warmup_ratio: 0.1\nwarmup_steps: 5\n")),
                            gpus="cpu")
    changed = {c["key"]: c for c in plan.to_dict()["changes"]}
    assert "warmup_ratio" in changed and "warmup_steps" in changed["warmup_ratio"]["reason"]


def test_what_the_jobs_server_decides_is_listed_where_the_recipe_set_it(write_recipe):
    """The weight-sync port the job picks free, and TRL's colocated-only vLLM keys, on a plan with a server."""
    rc = load_run_config(write_recipe(f"{MODEL}vllm_group_port: 51300\nvllm_model_impl: transformers\n"
                                      "vllm_enable_sleep_mode: true\n"))
    changed = {c["key"] for c in plan_from_config(rc, gpus="3xA40").to_dict()["changes"]}
    assert {"vllm_group_port", "vllm_model_impl", "vllm_enable_sleep_mode"} <= changed
