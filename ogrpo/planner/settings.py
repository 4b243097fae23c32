"""Hardware-aware settings, each with its reason: precision and attention first (they decide the memory
model), then what the trainer (TrainingArguments/GRPOConfig), the job's environment and vLLM are given."""

from __future__ import annotations

from ogrpo.errors import ConfigError
from ogrpo.fields import line_default, rule
from ogrpo.planner import overlap_stream
from ogrpo.planner import rank_balance as rank_balance_rule
from ogrpo.planner import train_ahead as train_ahead_rule
from ogrpo.planner.batch import eval_dropped
from ogrpo.planner.draft import Draft
from ogrpo.planner.lora import BASE_DTYPE_REASON as LORA_BASE_REASON
from ogrpo.planner.placement import Placement, bf16_server
from ogrpo.planner.strategy import STRATEGY_NAMES, TrainerFit, VllmFit
from ogrpo.stacks import parse_version

# vLLM options every O-GRPO server gets from its plan (the reasons are the settings below): the offline `LLM`
# that TRL's own vllm-serve wraps has the same defaults.
SERVER_ARGS = {"disable_log_stats": True}


def _user_mik(trl: dict) -> dict:
    return trl.get("model_init_kwargs") if isinstance(trl.get("model_init_kwargs"), dict) else {}


def precision(d: Draft) -> str:
    r, trl = d.rules, d.trl
    value, why, adapts = r.precision(trl)
    d.settings.add("precision", value, why)
    for key, to, reason in adapts:
        d.changes.adapt(key, to, reason)
    problem = r.model_problem(d.model)
    if problem:
        raise ConfigError([problem], d.run_config.source)
    return value


def attention(d: Draft) -> str:
    r, trl = d.rules, d.trl
    top, inner = trl.get("attn_implementation"), _user_mik(trl).get("attn_implementation")
    # model_init_kwargs is what from_pretrained gets: its explicit value is the more specific one and wins over
    # ModelConfig's top-level key (which `trl grpo` would write over it); the top-level value then is a change.
    key = "model_init_kwargs.attn_implementation" if inner else "attn_implementation" if top else None
    want = inner or top
    if want and r.attn_supported(want):
        attn = d.settings.add("attn_implementation", want, "set in the run config")
    else:
        attn = d.settings.add("attn_implementation", *r.default_attn())
    if key and attn != want:
        d.changes.add(key, want, attn, r.attn_change_reason(want))
    if top and inner and top != attn:
        d.changes.add("attn_implementation", top, attn, "model_init_kwargs.attn_implementation is set too, "
                      f"to {inner!r}, and wins (the more specific setting)"
                      + ("" if attn == inner else f"; {r.attn_change_reason(inner)}"))
    return attn


def trainer_args(d: Draft, p: Placement, v: VllmFit, t: TrainerFit, precision: str, attn: str,
                 batch: dict) -> dict:
    """What the trainer's GRPOConfig gets from the plan (the recipe's own keys pass through separately);
    `batch`: the plan's batch section (ogrpo.planner.batch.check_batch)."""
    r, trl, s, ch = d.rules, d.trl, d.settings, d.changes
    gpu = d.gpu
    targs, flag_settings, mik_dtype = r.precision_args(precision, t.strategy)
    targs = dict(targs)
    for name, value, why in flag_settings:
        s.add(name, value, why)
    if t.lora:
        mik_dtype = t.lora.base_dtype
    mik_dtype = s.add("model_init_kwargs.dtype", mik_dtype, LORA_BASE_REASON if t.lora else
                      "fp32 master weights: bf16/fp16 weights would round away updates at lr ~1e-6"
                      if mik_dtype == "float32" else "DeepSpeed keeps fp32 master weights itself; load half to "
                      "save host RAM")
    for key in ("bf16", "fp16"):
        ch.adapt(key, targs[key], f"{gpu.name} (sm_{gpu.sm}) trains in {precision}")
    user_mik = _user_mik(trl)
    for key, user in (("dtype", trl.get("dtype")), ("torch_dtype", trl.get("torch_dtype")),
                      ("model_init_kwargs.dtype", user_mik.get("dtype") or user_mik.get("torch_dtype"))):
        if user is not None and str(user).removeprefix("torch.") != mik_dtype:
            ch.add(key, user, mik_dtype, r.dtype_change_prefix(str(user)) +
                   (LORA_BASE_REASON if t.lora else
                    "fp32 master weights under half-precision autocast: half weights would round away updates "
                    "at lr ~1e-6" if mik_dtype == "float32" else "DeepSpeed keeps fp32 master weights itself"))
    mik = dict(trl.get("model_init_kwargs") or {}) if isinstance(trl.get("model_init_kwargs"), dict) else {}
    mik.update(attn_implementation=attn, dtype=mik_dtype)
    targs["model_init_kwargs"] = mik
    tf32 = r.tf32(trl.get("tf32"))
    if tf32 is not None:
        value, why, change_why = tf32
        targs["tf32"] = s.add("tf32", value, why) if why else value
        ch.adapt("tf32", value, change_why)
    gc = t.gradient_checkpointing
    targs["gradient_checkpointing"] = gc
    if gc:
        targs["gradient_checkpointing_kwargs"] = trl.get("gradient_checkpointing_kwargs") or {"use_reentrant": False}
    if not d.user_set("optim"):
        targs["optim"] = s.add("optim", *r.optim())
    if not d.user_set("torch_compile"):
        targs["torch_compile"] = s.add("torch_compile", *r.torch_compile(d.profile))
    if not d.user_set("dataloader_num_workers"):
        workers = r.dataloader_workers()
        targs["dataloader_num_workers"] = s.add("dataloader_num_workers", workers, "loader processes prepare the "
                                                "next prompts while the device steps") if workers else workers
    use_cpu = r.use_cpu(trl.get("use_cpu"))
    if use_cpu is not None:
        set_arg, value, why = use_cpu
        ch.adapt("use_cpu", value, why)
        if set_arg:
            targs["use_cpu"] = value
    targs["use_vllm"] = p.mode != "none"
    if p.mode == "server":
        targs["vllm_mode"] = "server"
        for key in ("vllm_server_base_url", "vllm_server_host", "vllm_server_port"):
            if trl.get(key) is not None:
                ch.add(key, trl[key], None, "the job starts its own vLLM server and gives the trainer its URL")
        for key in ("vllm_model_impl", "vllm_enable_sleep_mode"):
            if trl.get(key) not in (None, False, "auto", "vllm"):
                ch.add(key, trl[key], None, "TRL reads it only for colocated generation; the job's server runs "
                                            "vLLM's defaults")
        if trl.get("vllm_group_port") is not None:
            ch.add("vllm_group_port", trl["vllm_group_port"], None,
                   "the job picks a free port for its weight-sync group at start (a fixed one collides between "
                   "jobs sharing a node)")
    elif p.mode == "colocate":
        targs["vllm_mode"] = "colocate"
        targs["vllm_gpu_memory_utilization"] = s.add(
            "vllm_gpu_memory_utilization", v.colocate_util,
            "colocated vLLM's share of the device; the trainer plans with the rest")
        targs["vllm_tensor_parallel_size"] = 1
        targs["vllm_max_model_length"] = ch.adapt("vllm_max_model_length", p.max_model_len,
                                                  "the prompt + completion budget the memory plan holds")
    if p.mode != "none" and not d.user_set("vllm_server_timeout"):
        targs["vllm_server_timeout"] = s.add(
            "vllm_server_timeout", 900.0, "the trainer waits for the vLLM engine to load the weights and warm up; "
            "large models on shared filesystems take longer than TRL's 240 s")
    mode = overlap(d, p, targs)
    if bf16_server(p):  # a bf16 server samples off the fp32 trainer's log-probs: the correction covers the gap
        targs["vllm_importance_sampling_correction"] = s.add("vllm_importance_sampling_correction", True,
                                                             bf16_server(p))
    old_policy_pass(d, p, targs, mode)
    train_ahead(d, p, targs, t, batch["prompts_per_generation"])
    rank_balance(d, p, targs)
    padding_free(d)
    return targs


# Where a separate server exists: lossless gives off's samples, losses and updates (tests/test_overlap.py and
# tests/trl19/test_trl19_overlap.py compare them step by step) and only waits less.
OVERLAP_DEFAULT = "lossless"
# The aggressive profile trades exact on-policy sampling for time: a step costs about max(generation, training)
# instead of their sum, with samples at most one policy version old and the importance-sampling correction on.
AGGRESSIVE_OVERLAP = ("the aggressive profile: the server generates the next batch while the trainer trains on this "
                      "one (a step costs about max(generation, training), not their sum); samples are at most one "
                      "policy version old, corrected by TRL's importance sampling")


def overlap(d: Draft, p: Placement, targs: dict) -> str:
    """ogrpo.overlap (ogrpo/overlap/pipeline.py): whether server and trainer work at the same time. Only the split
    placement has two device sets to overlap; a mode that cannot apply runs as `off`, listed as a change when the
    run config asked for it."""
    trl, s, ch = d.trl, d.settings, d.changes
    wanted = getattr(d.run_config.ogrpo, "overlap", None)
    mode, why = (wanted, "set in the run config") if wanted else (
        OVERLAP_DEFAULT, "the default on the split placement: the same samples, losses and updates as off; the "
                         "weight push and the next request go out when the optimizer step ends, and the rewards "
                         "run beside the log-prob passes")
    blocked = None
    if p.mode != "server":
        blocked = ("generation runs inside the trainer (colocated or no vLLM): there is no separate server to "
                   "work beside the trainer")
    elif (trl.get("num_iterations") or 1) != 1:
        blocked = f"num_iterations={trl['num_iterations']}: a batch trains over several policy versions"
    elif trl.get("steps_per_generation") not in (None, trl.get("gradient_accumulation_steps") or 1):
        blocked = ("steps_per_generation differs from gradient_accumulation_steps: the pipeline needs one "
                   "generation per optimizer step")
    if blocked and mode != "off":
        if wanted:
            ch.add("ogrpo.overlap", wanted, "off", blocked)
        mode, why = "off", blocked
    elif not wanted and d.profile == "aggressive":
        mode, why = "one-step", AGGRESSIVE_OVERLAP
        ch.add("ogrpo.overlap", OVERLAP_DEFAULT, mode, why)
    s.add("overlap", mode, why)
    if mode == "lossless":
        rc = d.run_config  # one generation per optimizer step (above): a rank's rows are its micro-batches'
        rows = int(rc.get("per_device_train_batch_size")) * int(rc.get("gradient_accumulation_steps"))
        s.add("overlap.stream", *overlap_stream.decide(overlap_stream.trl_version(d.rules), p.num_processes, rows,
                                                       int(rc.get("num_generations")), max(1, p.dp or 1)))
    if mode == "one-step":
        key, reason = ("vllm_importance_sampling_correction",
                       "ogrpo.overlap one-step samples with weights one step old: TRL's importance-sampling "
                       "correction on the server's log-probs corrects for the stale sampler")
        if trl.get(key) is False:
            ch.add(key, False, True, reason)
        targs[key] = s.add(key, True, reason)
    return mode


def earlier_old_policy(iterations: int, per_generation: int, accumulation: int) -> str | None:
    """Why TRL's old policy is an earlier version of the weights than the loss forward's (its separate pass is
    real work then), else None: the one rule the plan and the trainer's layer (ogrpo/trainer/old_policy.py) share."""
    if iterations != 1 or accumulation % per_generation:
        return (f"num_iterations={iterations}, steps_per_generation={per_generation}, gradient_accumulation_steps="
                f"{accumulation}: the old policy is an earlier version of the weights than the loss forward's")
    return None


def old_policy_pass(d: Draft, p: Placement, targs: dict, overlap_mode: str) -> None:
    """`old_policy_pass` (ogrpo/trainer/old_policy.py): where TRL runs a separate old-policy log-prob pass only for
    vLLM's importance-sampling correction, with generation and the optimizer step aligned, the loss forward's own
    log-probs (detached) are that pass's numbers: one forward instead of two. The trainer still keeps TRL's pass
    where only it can see why (dropout, vision inputs)."""
    trl, s = d.trl, d.settings
    if p.mode not in ("server", "colocate"):
        return  # no vLLM: TRL runs no old-policy pass when the steps are aligned, and its own when not
    key = "vllm_importance_sampling_correction"
    correction = targs.get(key, trl.get(key))
    if correction is None:  # the target TRL line's default (True in 1.9.2 and 1.16)
        correction = line_default(d.rules.trl_line, key)
    iterations = int(trl.get("num_iterations") or 1)
    accumulation = int(trl.get("gradient_accumulation_steps") or 1)
    per_generation = int(trl.get("steps_per_generation") or accumulation)
    wanted = getattr(d.run_config.ogrpo, "old_policy_pass", None) or "auto"
    if wanted == "separate":
        value, why = "separate", "set in the run config (ogrpo.old_policy_pass: separate): TRL's own pass"
    elif not correction and accumulation % (per_generation * iterations) == 0:
        value, why = "none", ("vLLM's importance-sampling correction is off and the steps are aligned: TRL runs no "
                              "old-policy pass")
    elif earlier_old_policy(iterations, per_generation, accumulation):
        value, why = "separate", earlier_old_policy(iterations, per_generation, accumulation)
    elif overlap_mode == "one-step":
        value, why = "separate", "ogrpo.overlap one-step reads its importance-ratio statistics at scoring time"
    elif trl.get("use_liger_kernel"):
        value, why = "separate", "Liger's GRPO loss reads the old log-probs without TRL's per-token forward"
    else:
        value, why = "from_loss", ("generation and the optimizer step are aligned: the loss forward's log-probs, "
                                   "detached, are the old policy's; TRL's separate pass (for vLLM's importance-"
                                   "sampling correction) is skipped, the ratio and its statistics computed from "
                                   "them (one forward instead of two)")
    s.add("old_policy_pass", value, why)


def _trl_getter(d: Draft, targs: dict):
    """key -> the run's GRPOConfig value, the TRL line's default where the recipe has none."""
    def trl_get(key):
        value = targs.get(key, d.trl.get(key))
        return line_default(d.rules.trl_line, key) if value is None else value

    return trl_get


def train_ahead(d: Draft, p: Placement, targs: dict, t: TrainerFit, groups: int) -> None:
    """`overlap.train_ahead` (ogrpo/planner/train_ahead.py): a lossless run whose batches stream group by group
    trains each finished group while the server generates the rest, where that gives `off`'s updates; `groups`:
    the prompt groups of a generation batch (one trainer process: all of them are its own)."""
    s = d.settings
    if next((i.value for i in s.items if i.name == "overlap.stream"), None) != "groups":
        return

    trl_get = _trl_getter(d, targs)
    old_policy = next((i.value for i in s.items if i.name == "old_policy_pass"), None)
    on = s.add("overlap.train_ahead", *train_ahead_rule.decide(
        getattr(d.run_config.ogrpo, "train_ahead", None), trl_get, p.num_processes,
        t.strategy != "ddp", old_policy, bool(trl_get("vllm_importance_sampling_correction")),
        t.strategy == "zero3_offload")) == "on"
    # one trainer process on vLLM's API server: completions come back one by one (the ranks, and TRL 1.9's
    # server, give whole groups: there is no completion to run ahead of its group)
    one_by_one = p.num_processes == 1 and \
        parse_version(overlap_stream.trl_version(d.rules))[:2] >= overlap_stream.FIRST_VLLM_API_LINE
    if on and one_by_one:
        e = t.estimate
        sums = 2 * e.terms.get("gradients", 0.0)  # sum (r_j - c) d_j and sum d_j, as large as the gradients
        early, why, held = train_ahead_rule.decide_early_backward(
            getattr(d.run_config.ogrpo, "early_backward", None), trl_get, sums, e.budget_gib - e.total_gib,
            max(1, groups), t.strategy != "ddp")
        s.add("overlap.early_backward", early, why)
        if early == "on":
            s.add("overlap.early_backward_groups", held, "the open groups whose gradient sums fit at once")
            e.terms["early_backward_sums"] = held * sums
    elif on:
        whole = (f"each of the {p.num_processes} trainer processes receives its prompts' completions as whole groups"
                 if p.num_processes > 1 else "TRL's own server (before TRL "
                 f"{'.'.join(map(str, overlap_stream.FIRST_VLLM_API_LINE))}) answers whole groups")
        s.add("overlap.early_backward", "off", f"a group's backward waits for the whole group: {whole}, so no "
              "completion ends before its group")


def rank_balance(d: Draft, p: Placement, targs: dict) -> None:
    """`rank_balance` (ogrpo/planner/rank_balance.py): several trainer processes share a batch's tokens evenly."""
    trl_get = _trl_getter(d, targs)
    ahead = next((i.value for i in d.settings.items if i.name == "overlap.train_ahead"), None) == "on"
    decided = rank_balance_rule.decide(getattr(d.run_config.ogrpo, "rank_balance", None), trl_get,
                                       p.num_processes, ahead)
    if decided is not None:
        d.settings.add("rank_balance", *decided)


def padding_free(d: Draft) -> None:
    """`padding_free` (ogrpo/trainer/packing.py): every log-prob pass, the loss forward's included, computes its
    rows' real tokens packed end to end instead of rows padded to the longest. The trainer still keeps TRL's
    padded pass where only the built model shows why (no rotary positions, vision inputs)."""
    wanted = getattr(d.run_config.ogrpo, "padding_free", None) or "auto"
    if wanted == "off":
        d.settings.add("padding_free", "off", "set in the run config (ogrpo.padding_free: off): TRL's padded passes")
        return
    if wanted == "rows":
        d.settings.add("padding_free", "rows", "set in the run config (ogrpo.padding_free: rows): each log-prob "
                       "pass packs its rows' real tokens end to end, each row computing its own prompt")
        return
    d.settings.add("padding_free", "on", "each log-prob pass packs its rows' real tokens end to end, positions "
                   "restarting per sequence (block-causal attention: FlashAttention-2's varlen path, else "
                   "transformers' packed-sequence mask for SDPA and eager), so no padding is computed; under SDPA "
                   "the generations of one prompt share it (computed once, a custom mask) where that costs less; "
                   "the numbers are TRL's padded pass's up to the order of floating-point sums")


def job_env(d: Draft) -> dict[str, str]:
    """The environment of every step: the device rules' variables, the recipe's W&B keys, ogrpo.env."""
    trl = d.trl
    env: dict[str, str] = {"TOKENIZERS_PARALLELISM": "false"}
    for key, value, why in d.rules.job_env(d.cluster.total_gpus):
        env[key] = d.settings.add(key, value, why) if why else value
    for key, var in (("wandb_entity", "WANDB_ENTITY"), ("wandb_project", "WANDB_PROJECT"),
                     ("wandb_run_group", "WANDB_RUN_GROUP")):
        if trl.get(key):
            env[var] = str(trl[key])  # what open-r1's init_wandb_training does with these keys
    if isinstance(d.run_config.ogrpo.env, dict):
        env.update({str(k): str(v) for k, v in d.run_config.ogrpo.env.items()})
    return env


def vllm_args(d: Draft, p: Placement, v: VllmFit, precision: str) -> tuple[dict, dict[str, str]]:
    """(vLLM engine arguments, the server step's environment); both empty without vLLM."""
    r, trl, s = d.rules, d.trl, d.settings
    if p.mode not in ("server", "colocate"):
        return {}, {}
    bf16 = bf16_server(p)
    vdtype = s.add("vllm.dtype", *(("bfloat16", bf16) if bf16 else r.vllm_dtype(precision)))
    if bf16:
        d.changes.add("vllm.dtype", r.vllm_dtype(precision)[0], vdtype, bf16)
    if r.kv_policy == "kv_bytes":
        memory_arg = {"kv_cache_memory_bytes": s.add("vllm.kv_cache_memory_bytes",
                                                     v.estimate.notes["kv_cache_memory_bytes"],
                                                     r.kv_setting_reason(v.max_num_seqs, p.max_model_len))}
    else:
        memory_arg = {"gpu_memory_utilization": v.util}
    args = {
        "dtype": vdtype,
        "max_model_len": p.max_model_len,
        **memory_arg,
        "enable_prefix_caching": s.add("vllm.enable_prefix_caching", True,
                                       "the num_generations completions of a prompt share its KV blocks")
        if trl.get("vllm_enable_prefix_caching") is None else bool(trl["vllm_enable_prefix_caching"]),
        "max_num_seqs": v.max_num_seqs,
        "enforce_eager": s.add("vllm.enforce_eager", *d.server_eager()),
        "tensor_parallel_size": p.tp,
        "data_parallel_size": p.dp,
        "logprobs_mode": "processed_logprobs",
    }
    s.add("vllm.logprobs_mode", "processed_logprobs",
          "TRL's importance-sampling correction compares against the sampler's processed log-probs")
    env: dict[str, str] = {}
    if p.mode == "server":
        args["disable_log_stats"] = s.add(
            "vllm.disable_log_stats", SERVER_ARGS["disable_log_stats"],
            "per-step engine statistics run on the engine's critical path (-12 % tokens/s on CPU, ogrpo bench "
            "rollout); ogrpo's profiler reports generation throughput, TRL's own vllm-serve keeps none")
        env["VLLM_SERVER_DEV_MODE"] = "1"
        for key, value, why in r.server_env(d.cluster.total_gpus):
            env[key] = s.add(key, value, why) if why else value
    return args, env


def replaced_by_job(d: Draft, targs: dict, strategy: str) -> None:
    """Recipe keys the job replaces with its own: a DeepSpeed file, evaluation, the output directory."""
    trl, ch = d.trl, d.changes
    if trl.get("deepspeed") is not None:
        # accelerate.yaml names the job's deepspeed.json; a second file in TrainingArguments would conflict.
        targs["deepspeed"] = None
        ch.add("deepspeed", trl["deepspeed"], "deepspeed.json" if strategy != "ddp" else None,
               f"the plan picks {STRATEGY_NAMES[strategy]} for {d.cluster.spec}"
               + (" and renders its own DeepSpeed config" if strategy != "ddp" else ", which needs no DeepSpeed config")
               + "; the recipe's file is not read")

    if eval_dropped(trl):
        targs["eval_strategy"] = "no"
        key = "eval_strategy" if trl.get("eval_strategy") not in (None, "no") else "evaluation_strategy"
        ch.add(key, trl[key], "no", "O-GRPO's trainer loads no eval split (transformers refuses an eval strategy "
                                    "without one)")
    if trl.get("output_dir") is not None:
        ch.add("output_dir", trl["output_dir"], "<job dir>/run", "the job's run directory (--output-dir) holds "
                                                                 "checkpoints, logs and the manifest")
    for key in ("fsdp", "fsdp_config"):
        if trl.get(key) not in (None, "", [], {}, False):
            # TrainingArguments' FSDP beside accelerate's DeepSpeed/DDP launch would conflict (or shard twice)
            targs[key] = None
            ch.add(key, trl[key], None, f"O-GRPO plans DDP or DeepSpeed ZeRO, not FSDP: this plan trains with "
                                        f"{STRATEGY_NAMES[strategy]} (accelerate.yaml); FSDP is not applied")
    list_plan_values(d, targs)


def _recipe_value(trl: dict, key: str):
    """The recipe's value for a key the plan sets (ModelConfig keys also as model_init_kwargs, older names)."""
    mik = _user_mik(trl)
    if key == "dtype":
        return next((v for v in (trl.get("dtype"), trl.get("torch_dtype"), mik.get("dtype"), mik.get("torch_dtype"))
                     if v is not None), None)
    if key == "attn_implementation":
        return trl.get(key) if trl.get(key) is not None else mik.get(key)
    return trl.get(key)


def _same(a, b) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return a.removeprefix("torch.") == b.removeprefix("torch.")
    return a == b and type(a) is type(b) or (isinstance(a, (int, float)) and not isinstance(a, bool)
                                              and isinstance(b, (int, float)) and not isinstance(b, bool) and a == b)


def list_plan_values(d: Draft, targs: dict) -> None:
    """Every value the plan gives the trainer that the recipe did not set, or set otherwise, is a change: `trl grpo`
    with the same recipe would have used the recipe's value or the target TRL line's default. The steps above list
    adaptations with their own reasons first (Changes keeps the first reason per key); this pass lists the rest
    (TF32, attention, fused AdamW, dataloader workers, vLLM mode ...) with the setting's reason."""
    line, trl = d.rules.trl_line, d.trl
    why = {}
    for item in d.settings.items:
        why.setdefault(item.name.removeprefix("model_init_kwargs."), item.reason)
    values = {k: v for k, v in targs.items() if k != "model_init_kwargs"}
    for k, v in (targs.get("model_init_kwargs") or {}).items():
        if k in ("attn_implementation", "dtype"):
            values[k] = v
    aliases = {"dtype": ("dtype", "torch_dtype", "model_init_kwargs.dtype"),
               "attn_implementation": ("attn_implementation", "model_init_kwargs.attn_implementation")}
    for key, value in values.items():
        if any(c.key in aliases.get(key, (key,)) for c in d.changes.items):
            continue  # listed by the step that decided it
        user = _recipe_value(trl, key)
        if user is not None:
            if not _same(user, value):
                r = rule(key)
                d.changes.add(key, user, value, why.get(key) or (r.target if r else "set by the plan"))
            continue
        default = line_default(line, key)
        if _same(value, default):
            continue
        r = rule(key)
        reason = why.get(key) or (r.target.removeprefix("GRPOConfig; ") if r and r.target else "set by the plan")
        d.changes.add(key, default, value, f"not set in the recipe (TRL {line}'s default {default!r}); {reason}")
