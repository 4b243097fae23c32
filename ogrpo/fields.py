"""What O-GRPO does with every key a TRL / open-r1 recipe may hold: one table, so nothing is dropped silently.

Each key has one rule:
- `pass`: given to TRL as written (GRPOConfig, or the ModelConfig/ScriptArguments part O-GRPO's trainer reads);
- `planned`: given as written unless the plan must adapt it to the hardware; then the plan lists the change;
- `mapped`: carried to another name or place (`target`) with the same meaning;
- `changed`: not applied as written; a set value is listed as a change with `reason`;
- `unsupported`: O-GRPO has no equivalent; a value other than `default` is listed as a change with `reason`.

tests/test_field_walk.py walks every field of TRL 1.16's (installed) and 1.9's (vendored) dataclasses and of
open-r1's argument classes, and fails for a field without a rule: a new TRL field fails it until it is classified.
Pure data and pure functions: no TRL import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ogrpo.errors import ConfigError
from ogrpo.values import choice_problem, coerce, kinds_from_type

PASS, PLANNED, MAPPED, CHANGED, UNSUPPORTED = "pass", "planned", "mapped", "changed", "unsupported"
KINDS = (PASS, PLANNED, MAPPED, CHANGED, UNSUPPORTED)

CPU_LINE, IMAGE_LINE = "1.16.0", "1.9.2"  # same values as ogrpo.compat (not imported: it is heavier)


@dataclass(frozen=True)
class Rule:
    kind: str
    target: str = ""  # where the value goes (pass / planned / mapped)
    reason: str = ""  # why it is not applied as written (changed / unsupported)
    default: object = None  # unsupported: the value that changes nothing (not listed)
    kinds: tuple[str, ...] = ()  # accepted YAML kinds, for keys outside the vendored TRL table


# ---- GRPOConfig (TrainingArguments included), both TRL lines --------------------------------------------
# Passed to GRPOConfig exactly as written (TRL's own meaning and validation).
_GRPO_PASS = """
accelerator_config adam_beta1 adam_beta2 adam_epsilon auto_find_batch_size average_tokens_across_devices
batch_eval_metrics beta bf16_full_eval cache_implementation cast_lm_head_to_fp32 chat_template_kwargs data_seed
dataloader_drop_last dataloader_in_order dataloader_multiprocessing_context dataloader_persistent_workers
dataloader_pin_memory dataloader_prefetch_factor ddp_backend ddp_broadcast_buffers ddp_bucket_cap_mb
ddp_find_unused_parameters ddp_static_graph ddp_timeout debug delta disable_dropout disable_tqdm do_eval do_predict
do_train ds3_gather_for_generation enable_jit_checkpoint entropy_coef entropy_coef_delta entropy_coef_max
entropy_coef_min entropy_target epsilon epsilon_high eval_accumulation_steps eval_delay eval_do_concat_batches
eval_on_start eval_steps eval_use_gather_object fp16_full_eval full_determinism
generation_batch_size generation_kwargs gradient_accumulation_steps greater_is_better hub_always_push hub_model_id
hub_private_repo hub_revision hub_strategy hub_token ignore_data_skip importance_sampling_level include_for_metrics
include_num_input_tokens_seen label_names label_smoothing_factor learning_rate length_column_name
liger_kernel_config load_best_model_at_end local_rank log_completions log_completions_hub_repo log_level
log_level_replica log_multimodal log_on_each_node log_unique_prompts logging_dir logging_first_step
logging_nan_inf_filter logging_steps logging_strategy loss_type lr_scheduler_kwargs lr_scheduler_type
mask_truncated_completions max_completion_length max_grad_norm max_steps max_tool_calling_iterations
metric_for_best_model min_p multi_objective_aggregation neftune_noise_alpha num_completions_to_print
num_generations num_generations_eval num_iterations num_train_epochs off_policy_mask_threshold optim_args
optim_target_modules pad_to_multiple_of parallelism_config per_device_eval_batch_size per_device_train_batch_size
prediction_loss_only project push_to_hub ref_model_mixup_alpha ref_model_sync_steps remove_unused_columns
repetition_penalty report_to restore_callback_states_from_checkpoint resume_from_checkpoint reward_weights
router_aux_loss_coef run_name sapo_temperature_neg sapo_temperature_pos save_on_each_node save_only_model save_steps
save_strategy save_total_limit scale_rewards seed shuffle_dataset skip_memory_metrics steps_per_generation
sync_ref_model temperature top_entropy_quantile top_k top_p torch_compile_backend torch_compile_mode
torch_empty_cache_steps trackio_bucket_id trackio_space_id trackio_static_space_id train_sampling_strategy
transformers_continuous_batching_config trust_remote_code use_adaptive_entropy use_bias_correction_kl use_cache
use_liger_kernel use_transformers_continuous_batching use_transformers_paged vespo_k_neg vespo_k_pos
vespo_lambda_neg vespo_lambda_pos vllm_enable_sleep_mode vllm_importance_sampling_cap
vllm_importance_sampling_clip_max vllm_importance_sampling_clip_min vllm_importance_sampling_correction
vllm_importance_sampling_mode vllm_model_impl vllm_server_timeout vllm_structured_outputs_regex warmup_ratio
warmup_steps weight_decay
""".split()

# Given as written unless the plan must adapt them to the hardware (each adaptation is listed with its reason).
_GRPO_PLANNED = {
    "bf16": "precision: bf16 on sm_80+, fp16 on V100/T4, fp32 on CPU",
    "fp16": "precision: bf16 on sm_80+, fp16 on V100/T4, fp32 on CPU",
    "tf32": "TF32 exists on sm_80+ only",
    "gradient_checkpointing": "kept when set; else chosen by memory",
    "gradient_checkpointing_kwargs": "kept when set; else use_reentrant false",
    "optim": "kept when set; else fused AdamW on GPU",
    "torch_compile": "kept when set; else by profile and GPU",
    "dataloader_num_workers": "kept when set",
    "use_cpu": "true on a CPU plan",
    "model_init_kwargs": "dtype and attn_implementation adapted to the GPU",
    "use_vllm": "the plan's generation mode",
    "vllm_mode": "server or colocate, by placement",
    "vllm_gpu_memory_utilization": "vLLM's memory share (server or colocated)",
    "vllm_tensor_parallel_size": "vLLM tensor parallel size (server or colocated)",
    "vllm_max_model_length": "colocated vLLM's context: prompt + completion budget",
    "vllm_server_base_url": "the job's own server",
    "vllm_server_host": "the job's own server",
    "vllm_server_port": "the job's own server",
    "vllm_group_port": "the job's own weight-sync port, picked free at start",
    "deepspeed": "the plan's ZeRO stage (deepspeed.json) or DDP",
    "fsdp": "the plan's strategy (DDP or DeepSpeed ZeRO in accelerate.yaml): FSDP is not planned",
    "fsdp_config": "the plan's strategy (DDP or DeepSpeed ZeRO in accelerate.yaml): FSDP is not planned",
    "eval_strategy": "O-GRPO's trainer loads no eval split",
    "output_dir": "the job's run directory (--output-dir)",
}

# ---- ModelConfig / ScriptArguments (read by O-GRPO's trainer, which replaces TRL's script) ----------------
_MODEL_AND_SCRIPT = {
    "model_name_or_path": Rule(PASS, "the model the trainer and server load"),
    "model_revision": Rule(MAPPED, "model_init_kwargs.revision and the server's --revision"),
    "dtype": Rule(PLANNED, "model_init_kwargs.dtype (fp32 master weights for DDP; the plan adapts it per GPU)"),
    "attn_implementation": Rule(PLANNED, "model_init_kwargs.attn_implementation (sdpa where flash-attn 2 "
                                         "cannot run)"),
    "use_peft": Rule(MAPPED, "peft LoraConfig given to GRPOTrainer"),
    "lora_r": Rule(MAPPED, "peft LoraConfig.r"),
    "lora_alpha": Rule(MAPPED, "peft LoraConfig.lora_alpha"),
    "lora_dropout": Rule(MAPPED, "peft LoraConfig.lora_dropout"),
    "lora_target_modules": Rule(MAPPED, "peft LoraConfig.target_modules"),
    "lora_target_parameters": Rule(MAPPED, "peft LoraConfig.target_parameters"),
    "lora_modules_to_save": Rule(MAPPED, "peft LoraConfig.modules_to_save"),
    "lora_task_type": Rule(MAPPED, "peft LoraConfig.task_type"),
    "use_rslora": Rule(MAPPED, "peft LoraConfig.use_rslora"),
    "use_dora": Rule(MAPPED, "peft LoraConfig.use_dora"),
    "load_in_4bit": Rule(UNSUPPORTED, reason="bitsandbytes quantization is not in O-GRPO's images and the memory "
                                             "plan counts full-precision weights: loaded unquantized", default=False),
    "load_in_8bit": Rule(UNSUPPORTED, reason="bitsandbytes quantization is not in O-GRPO's images and the memory "
                                             "plan counts full-precision weights: loaded unquantized", default=False),
    "bnb_4bit_quant_type": Rule(UNSUPPORTED, reason="only used with load_in_4bit, which O-GRPO does not support",
                                default="nf4"),
    "bnb_4bit_quant_storage": Rule(UNSUPPORTED, reason="only used with load_in_4bit, which O-GRPO does not "
                                                       "support"),
    "use_bnb_nested_quant": Rule(UNSUPPORTED, reason="only used with load_in_4bit, which O-GRPO does not support",
                                 default=False),
    # GRPOScriptArguments / ScriptArguments
    "dataset_name": Rule(PASS, "the trainer's dataset (ogrpo/trainer/data.py)"),
    "dataset_config": Rule(PASS, "datasets.load_dataset(name, config)"),
    "dataset_train_split": Rule(PASS, "the training split"),
    "dataset_test_split": Rule(UNSUPPORTED, reason="O-GRPO's trainer loads no eval split", default="test"),
    "dataset_streaming": Rule(UNSUPPORTED, reason="the trainer loads the dataset in memory (no streaming)",
                              default=False),
    "ignore_bias_buffers": Rule(UNSUPPORTED, reason="only TRL's own script reads it (DDP bias buffers)",
                                default=False),
    "reward_funcs": Rule(MAPPED, "O-GRPO's reward registry or package.module:function (ogrpo/rewards/registry.py)"),
    "reward_model_name_or_path": Rule(UNSUPPORTED, reason="reward models are not supported; use reward_funcs"),
    # DatasetMixtureConfig: loaded by the trainer with TRL's own get_dataset (ogrpo/trainer/data.py)
    "datasets": Rule(MAPPED, "the trainer's dataset: TRL's mixture (ogrpo/trainer/data.py)"),
    "streaming": Rule(UNSUPPORTED, reason="the trainer loads the dataset in memory (no streaming)", default=False),
    "test_split_size": Rule(MAPPED, "TRL's mixture split: the trainer trains on its train part"),
}

# ---- open-r1's GRPOScriptArguments / GRPOConfig extensions (src/open_r1/configs.py) ------------------------
_OPEN_R1 = {
    "dataset_prompt_column": Rule(MAPPED, "ogrpo.prompt_column", kinds=("str",)),
    "system_prompt": Rule(MAPPED, "ogrpo.system_prompt", kinds=("str", "none")),
    "dataset_configs": Rule(MAPPED, "dataset_config (the first entry)", kinds=("list", "str", "none")),
    "dataset_mixture": Rule(MAPPED, "the trainer's dataset: open-r1's mixture (ogrpo/trainer/data.py)",
                            kinds=("dict", "none")),
    "chat_template": Rule(MAPPED, "the tokenizer's chat template (set by the trainer, as open-r1 does)",
                          kinds=("str", "none")),
    "wandb_entity": Rule(MAPPED, "env WANDB_ENTITY", kinds=("str", "none")),
    "wandb_project": Rule(MAPPED, "env WANDB_PROJECT", kinds=("str", "none")),
    "wandb_run_group": Rule(MAPPED, "env WANDB_RUN_GROUP", kinds=("str", "none")),
    "wandb_log_unique_prompts": Rule(UNSUPPORTED, reason="open-r1's wandb callback only", default=True,
                                     kinds=("bool",)),
    "callbacks": Rule(UNSUPPORTED, reason="open-r1's hub/benchmark callbacks are not run", default=[],
                      kinds=("list", "none")),
    "benchmarks": Rule(UNSUPPORTED, reason="open-r1's post-training benchmarks are not run", default=[],
                       kinds=("list", "none")),
    "hub_model_revision": Rule(UNSUPPORTED, reason="open-r1's push-to-revision callback is not run (hub_revision "
                                                   "is TRL's key)", default="main", kinds=("str", "none")),
    "overwrite_hub_revision": Rule(UNSUPPORTED, reason="open-r1's push-to-revision callback is not run",
                                   default=False, kinds=("bool",)),
    "push_to_hub_revision": Rule(UNSUPPORTED, reason="open-r1's push-to-revision callback is not run",
                                 default=False, kinds=("bool",)),
    "dataset_test_split_size": Rule(UNSUPPORTED, reason="O-GRPO's trainer loads no eval split",
                                    kinds=("float", "int", "none")),
}
# Reward parameters the reward registry binds to open-r1's reward factories (ogrpo/rewards/registry.py
# RECIPE_PARAMS; tests/test_field_walk.py checks the two lists agree).
for _name, _kinds in (
        ("cosine_min_value_wrong", ("float",)), ("cosine_max_value_wrong", ("float",)),
        ("cosine_min_value_correct", ("float",)), ("cosine_max_value_correct", ("float",)),
        ("cosine_max_len", ("int",)), ("repetition_n_grams", ("int",)), ("repetition_max_penalty", ("float",)),
        ("code_language", ("str",)), ("parallel_code_exec_per_proc", ("int",)), ("enforce_same_language", ("bool",)),
        ("max_completion_len", ("int",)), ("soft_punish_cache", ("int",))):
    _OPEN_R1[_name] = Rule(MAPPED, "reward factory argument (ogrpo/rewards/registry.py)", kinds=_kinds)
# Remote code-execution settings: O-GRPO runs code rewards in its local sandbox.
for _name, _default, _kinds in (
        ("code_eval_test_batch_size", 1, ("int",)), ("code_eval_scoring_mode", "weighted_sum", ("str",)),
        ("code_provider", "e2b", ("str", "none")), ("e2b_router_url", None, ("str", "none")),
        ("morph_router_url", None, ("str", "none")), ("ioi_provider", "piston", ("str", "none")),
        # the codeforces work's first name for code_eval_scoring_mode (true: "partial", false: "pass_fail")
        ("code_eval_partial_grading", False, ("bool",))):
    _OPEN_R1[_name] = Rule(UNSUPPORTED, reason=f"open-r1's remote code-execution setting {_name}: O-GRPO runs code "
                                                "rewards in its local sandbox", default=_default, kinds=_kinds)

# ---- keys of older TRL / transformers / accelerate that recipes still carry --------------------------------
_OLDER = {
    "torch_dtype": Rule(MAPPED, "dtype (model_init_kwargs.dtype; the plan adapts it per GPU)", kinds=("str", "none")),
    "max_prompt_length": Rule(MAPPED, "the plan's prompt-length budget (TRL 1.16 does not truncate prompts)",
                              kinds=("int", "none")),
    "evaluation_strategy": Rule(MAPPED, "eval_strategy", kinds=("str",)),
    "vllm_enable_prefix_caching": Rule(MAPPED, "vllm.args.enable_prefix_caching", kinds=("bool",)),
    "num_processes": Rule(PLANNED, "the plan's trainer processes (accelerate's num_processes)", kinds=("int",)),
    "vllm_data_parallel_size": Rule(PLANNED, "the server's data parallel size", kinds=("int",)),
    "overwrite_output_dir": Rule(CHANGED, reason="transformers 5 removed it; the run directory resumes from its "
                                                 "last checkpoint (--resume auto) instead", kinds=("bool",)),
    "vllm_device": Rule(CHANGED, reason="current TRL has no vllm_device (gone with its vLLM server mode); the plan "
                                        "places the server",
                        kinds=("str", "none")),
    # GRPOConfig fields of TRL 0.15-0.27 renamed since (RENAMED below carries the value to today's name)
    "use_liger_loss": Rule(MAPPED, "use_liger_kernel (TRL 0.17-0.27's name for the Liger GRPO loss)", kinds=("bool",)),
    "use_liger": Rule(MAPPED, "use_liger_kernel (transformers 4.45's name)", kinds=("bool",)),
    "vllm_max_model_len": Rule(MAPPED, "vllm_max_model_length (TRL 0.15-0.17's name)", kinds=("int", "none")),
    "vllm_guided_decoding_regex": Rule(MAPPED, "vllm_structured_outputs_regex (TRL 0.16-0.27's name)",
                                       kinds=("str", "none")),
    "gradient_checkpointing_use_reentrant": Rule(
        MAPPED, "gradient_checkpointing_kwargs.use_reentrant (TRL 0.14-0.26 ScriptArguments)", kinds=("bool",)),
    "vllm_dtype": Rule(UNSUPPORTED, reason="TRL 0.15-0.17's vLLM dtype: the plan gives vLLM the trainer's precision "
                                           "(setting vllm.dtype)", default="auto", kinds=("str", "none")),
    # open-r1's remote-generation experiments (faster-grpo-trainer recipes): a generation/reference server elsewhere
    "remote_gen_model_url": Rule(UNSUPPORTED, reason="open-r1's remote-generation trainer: the job starts its own "
                                                     "vLLM and generates there", kinds=("str", "none")),
    "ref_model_url": Rule(UNSUPPORTED, reason="open-r1's remote reference model: the reference model (beta > 0) is "
                                              "loaded inside the trainer", kinds=("str", "none")),
}

# Older names whose value the loader copies to today's key (unless that key is set too, to the same value): the
# planner, the checks and the trainer then read one key. The older key stays in the config (it round-trips).
RENAMED = {"use_liger_loss": "use_liger_kernel", "use_liger": "use_liger_kernel",
           "vllm_max_model_len": "vllm_max_model_length",
           "vllm_guided_decoding_regex": "vllm_structured_outputs_regex"}
RENAME_NOTES = {"use_liger_loss": " (TRL 0.28 folded the Liger GRPO loss into use_liger_kernel: one switch for "
                                   "Liger's model kernels and its loss)"}
# Fields an older TRL typed Optional, where null had a meaning that today's non-optional field spells as a value.
NULL_MEANS = {"top_k": (0, "TRL 0.16-0.2x's `top_k: null` (no top-k filtering) is today's 0")}

RULES: dict[str, Rule] = {}
RULES.update({k: Rule(PASS, "GRPOConfig") for k in _GRPO_PASS})
RULES.update({k: Rule(PLANNED, "GRPOConfig; " + why) for k, why in _GRPO_PLANNED.items()})
RULES.update(_MODEL_AND_SCRIPT)
RULES.update(_OPEN_R1)
RULES.update(_OLDER)

# GRPOConfig fields one TRL line has and the other lacks: same meaning under another name there.
LINE_RENAMES = {CPU_LINE: {"warmup_ratio": "warmup_steps"}}
# TRL types narrower than TRL's documented meaning (`scale_rewards: str` whose help and __post_init__ take
# True/False as "group"/"none", in 1.9 and 1.16 alike).
KIND_OVERRIDES = {"scale_rewards": ("str", "bool")}


def rule(key: str) -> Rule | None:
    return RULES.get(key)


def open_r1_keys() -> frozenset[str]:
    return frozenset(_OPEN_R1)


def older_keys() -> frozenset[str]:
    return frozenset(_OLDER)


def change(key: str, old, new, reason: str) -> dict:
    return {"key": key, "from": old, "to": new, "reason": reason}


@lru_cache(maxsize=None)
def grpo_fields(line: str) -> frozenset[str] | None:
    """GRPOConfig field names of a TRL line from the vendored tables (None if there is no table)."""
    name = {CPU_LINE: "trl_fields.json", IMAGE_LINE: "trl_fields_1.9.json"}.get(line)
    if name is None:
        return None
    return frozenset(json.loads((Path(__file__).with_name("data") / name).read_text())["GRPOConfig"])


# What TRL does when the recipe leaves a key unset, where the field's default is a placeholder: GRPOConfig turns
# bf16 on unless fp16 is set; transformers loads with SDPA when attn_implementation is None.
EFFECTIVE_DEFAULTS = {"bf16": True, "attn_implementation": "sdpa"}


@lru_cache(maxsize=None)
def _line_table(line: str) -> dict:
    name = {CPU_LINE: "trl_fields.json", IMAGE_LINE: "trl_fields_1.9.json"}.get(line)
    return json.loads((Path(__file__).with_name("data") / name).read_text()) if name else {}


def line_default(line: str, key: str):
    """The value `trl grpo` of this TRL line uses for a key the recipe does not set (GRPOConfig, else
    ModelConfig); None when unknown."""
    if key in EFFECTIVE_DEFAULTS:
        return EFFECTIVE_DEFAULTS[key]
    table = _line_table(line)
    for group in ("GRPOConfig", "ModelConfig"):
        if key in table.get(group, {}):
            return table[group][key].get("default")
    return None


@lru_cache(maxsize=None)  # the planner's fix search plans hundreds of variants of one config
def line_kinds(line: str) -> dict[str, tuple[str, ...]]:
    """Field of `trl grpo`'s dataclasses (GRPOConfig, ModelConfig, script arguments) -> the YAML kinds this TRL
    line's field type takes (ogrpo/config.py's kinds); GRPOConfig first where two classes share a name. Cached:
    read it, never change it."""
    out: dict[str, tuple[str, ...]] = {}
    table = _line_table(line)
    for group in ("GRPOConfig", "ModelConfig", "GRPOScriptArguments", "DatasetMixtureConfig"):
        for name, info in table.get(group, {}).items():
            if name not in out:
                out[name] = tuple(info["kinds"]) if "kinds" in info else tuple(kinds_from_type(info["type"]))
    for name, kinds in KIND_OVERRIDES.items():
        if name in out:
            out[name] = tuple(sorted(set(out[name]) | set(kinds)))
    return out


# Keys whose value never reaches GRPOConfig (the plan lists them as changed): their type on the job's line is moot.
REPLACED_BY_PLAN = frozenset({"fsdp", "fsdp_config", "deepspeed", "output_dir"})


# GRPOConfig fields typed Optional whose null TRL does not honor as written: what it would run is not what the plan
# describes (or does not run at all)
NULL_REFUSED = {
    "num_generations": "TRL cannot size its batches without it",
    "max_completion_length": "unbounded completions: the plan sizes memory and the server's context from this "
                             "budget",
    "report_to": "transformers takes no null logger; write `none` for no logger",
}


def line_type_problems(trl: dict, line: str) -> list[str]:
    """Values the loader accepted (typed by the union of both lines' fields) that the target line's own GRPOConfig
    field type refuses: e.g. a JSON string for generation_kwargs, which TRL 1.16 parses and 1.9 does not; and the
    nulls TRL's types allow but it does not honor (NULL_REFUSED)."""
    kinds = line_kinds(line)
    problems = [f"{key}: null: {why}; give a value or leave the key out" for key, why in NULL_REFUSED.items()
                if key in trl and trl[key] is None]
    for key, value in trl.items():
        if key in kinds and key not in REPLACED_BY_PLAN:
            try:
                coerce(key, value, kinds[key])
            except ValueError as exc:
                problems.append(f"{exc} (TRL {line}, which this plan's job runs)")
                continue
            wrong = choice_problem(key, value, line)
            if wrong:
                problems.append(f"{wrong} (this plan's job runs TRL {line})")
    return problems


def config_changes(trl: dict, line: str) -> list[dict]:
    """Changes that follow from the keys alone (no hardware): unsupported values, keys O-GRPO replaces, and
    GRPOConfig fields the target TRL line does not have. Raises ConfigError for a value the line's own field
    types refuse (line_type_problems)."""
    problems = line_type_problems(trl, line)
    if problems:
        raise ConfigError(problems, "run config")
    out: list[dict] = []
    line_fields = grpo_fields(line) or frozenset()
    renames = LINE_RENAMES.get(line, {})
    every_grpo = (grpo_fields(CPU_LINE) or frozenset()) | (grpo_fields(IMAGE_LINE) or frozenset())
    for key, value in trl.items():
        r = RULES.get(key)
        if r is None or value is None:
            continue
        if r.kind == UNSUPPORTED and value != r.default:
            out.append(change(key, value, r.default, r.reason))
        elif r.kind == CHANGED and value is not False:
            out.append(change(key, value, None, r.reason))
        elif key in RENAMED and trl.get(RENAMED[key]) is not None and trl[RENAMED[key]] != value:
            new = RENAMED[key]
            out.append(change(key, value, trl[new], f"an older name of {new}, which the recipe also sets: {new} is "
                                                    f"applied{RENAME_NOTES.get(key, '')}"))
        elif key == "dataset_configs" and isinstance(value, list) and len(value) > 1:
            out.append(change(key, value, value[0], "TRL's ScriptArguments take one dataset_config: the first "
                                                    "entry is loaded"))
        elif key in renames and key not in line_fields and trl.get(renames[key]) is not None:
            new = renames[key]
            out.append(change(key, value, None, f"TRL {line} has no {key}; its {new} (which the recipe also sets: "
                                                f"{trl[new]!r}) is applied and {key} is dropped"))
        elif key in every_grpo and key not in line_fields and key not in renames:
            out.append(change(key, value, None, f"not a GRPOConfig field of TRL {line}, which this plan's job runs "
                                                "(dropped)"))
    return out
