"""The planner: (cluster, model, run config, profile) -> Plan. Pure: no I/O, no torch.

Placement: one GPU colocates vLLM inside the trainer; a single node splits in-node (the server gets the
smallest tensor-parallel group that holds the model and a KV cache, the trainer the rest); several nodes give
the server whole node(s). `--vllm-gpus N` overrides. On CPU, "devices" are processes: `cpu` colocates,
`NxCPU` runs one server process and N-1 trainer processes.
Then the trainer strategy is the cheapest that fits (DDP → ZeRO-2 → ZeRO-3 → ZeRO-3 + optimizer offload),
the batch arithmetic TRL enforces is checked, and every hardware-aware setting carries its reason.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ogrpo.config import STRATEGIES  # one list: config validates ogrpo.strategy against it
from ogrpo.errors import ConfigError, OgrpoError
from ogrpo.hardware import Cluster, parse_gpus
from ogrpo.memory import Estimate, kv_budget_bytes, kv_bytes_per_token_per_gpu, server_estimate, trainer_estimate
from ogrpo.models import ModelFacts
from ogrpo.train.peft_config import BASE_DTYPE_REASON as LORA_BASE_REASON, lora_spec

PROFILES = ("conservative", "balanced", "aggressive")

# Per profile: share of device memory kept free, vLLM's share (server / colocated), max concurrent sequences.
_PROFILE = {
    "conservative": {"headroom": 0.15, "server_util": 0.85, "colocate_util": 0.25, "max_seqs": 128, "eager": True},
    "balanced": {"headroom": 0.10, "server_util": 0.90, "colocate_util": 0.30, "max_seqs": 256, "eager": False},
    "aggressive": {"headroom": 0.05, "server_util": 0.92, "colocate_util": 0.40, "max_seqs": 512, "eager": False},
}
# Share of host RAM a CPU vLLM may take (measured working value, shared/vllm-cpu): the ceiling its estimate is
# checked against; vLLM itself gets an explicit KV budget on CPU.
CPU_VLLM_UTIL = 0.2
DEFAULT_PROMPT_LENGTH = 512


@dataclass
class Plan:
    cluster: Cluster
    model: ModelFacts
    profile: str
    fits: bool
    reasons: list[str]
    fixes: list[str]
    precision: str
    attn_implementation: str
    mode: str  # "server" | "colocate" | "none"
    vllm: dict
    trainer: dict
    trainer_args: dict
    env: dict[str, str]
    settings: list[dict]
    batch: dict
    warnings: list[str] = field(default_factory=list)
    # Every way the run differs from the recipe as written: [{key, from, to, reason}] (ogrpo/fields.py).
    changes: list[dict] = field(default_factory=list)
    # The fixes as data: [{text, config, cli}]; each was re-planned with it applied and fits.
    fix_actions: list[dict] = field(default_factory=list)
    # O-GRPO's own kernels the trainer installs: {"linear_logprobs": bool, "fused_sample": bool}.
    kernels: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "fits": self.fits,
            "reasons": list(self.reasons),
            "fixes": list(self.fixes),
            "precision": self.precision,
            "attn_implementation": self.attn_implementation,
            "mode": self.mode,
            "profile": self.profile,
            "cluster": self.cluster.to_dict(),
            "model": self.model.to_dict(),
            "vllm": self.vllm,
            "trainer": self.trainer,
            "batch": self.batch,
            "trainer_args": self.trainer_args,
            "env": dict(self.env),
            "settings": list(self.settings),
            "warnings": list(self.warnings),
            "changes": [dict(c) for c in self.changes],
            "fix_actions": [dict(f) for f in self.fix_actions],
            "kernels": dict(self.kernels),
        }


@dataclass(frozen=True)
class Fix:
    """A suggested fix: its text and the overrides that apply it (run-config keys, `ogrpo` options included
    under "ogrpo"; command-line options `gpus` / `vllm_gpus`)."""

    text: str
    config: dict = field(default_factory=dict)
    cli: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"text": self.text, "config": dict(self.config), "cli": dict(self.cli)}


class _Changes:
    """Collects how the run differs from the recipe as written."""

    def __init__(self, trl: dict):
        self.trl = trl
        self.items: list[dict] = []

    def add(self, key: str, old, new, reason: str) -> None:
        from ogrpo.fields import change

        if not any(c["key"] == key for c in self.items):
            self.items.append(change(key, old, new, reason))

    def adapt(self, key: str, value, reason: str):
        """The plan's value for a key: listed when the recipe set the key to something else."""
        user = self.trl.get(key)
        if user is not None and user != value:
            self.add(key, user, value, reason)
        return value


class _Settings:
    def __init__(self):
        self.items: list[dict] = []

    def add(self, name: str, value, reason: str):
        self.items.append({"name": name, "value": value, "reason": reason})
        return value


def valid_tp_sizes(model: ModelFacts, limit: int) -> list[int]:
    """Tensor-parallel sizes vLLM accepts: divide the attention heads and the MLP width, and divide or be a
    multiple of the KV heads (which vLLM then replicates)."""
    out = []
    for t in range(1, max(1, limit) + 1):
        if (model.num_heads % t == 0 and model.intermediate_size % t == 0
                and (model.num_kv_heads % t == 0 or t % model.num_kv_heads == 0)):
            out.append(t)
    return out


def _lengths(run_config, model: ModelFacts) -> tuple[int, int]:
    """(prompt, completion) tokens to budget for. TRL 1.16 does not truncate prompts, so the prompt length is
    O-GRPO's planning assumption: ogrpo.max_prompt_length, else an old recipe's max_prompt_length, else 512
    capped to what the model's positions leave after the completion."""
    completion = int(run_config.get("max_completion_length") or 256)
    prompt = run_config.ogrpo.max_prompt_length or run_config.trl.get("max_prompt_length")
    if not prompt:
        room = model.max_position_embeddings - completion
        prompt = min(DEFAULT_PROMPT_LENGTH, room) if room >= 16 else DEFAULT_PROMPT_LENGTH
    return int(prompt), completion


def _user_set(run_config, key: str) -> bool:
    return key in run_config.trl and run_config.trl[key] is not None


def make_plan(cluster: Cluster, model: ModelFacts, run_config, profile: str = "balanced",
              check_fixes: bool = True) -> Plan:
    """`check_fixes`: re-plan every suggested fix with it applied and keep those that fit (off inside that
    re-planning)."""
    profile = profile or run_config.ogrpo.profile or "balanced"
    if profile not in PROFILES:
        raise OgrpoError(f"--profile {profile!r}: choose one of {', '.join(PROFILES)}")
    prof = _PROFILE[profile]
    gpu = cluster.gpu
    s = _Settings()
    reasons: list[str] = []
    fixes: list[Fix] = []
    warnings: list[str] = list(run_config.warnings)
    trl = run_config.trl
    from ogrpo.fields import CPU_LINE, IMAGE_LINE, config_changes

    ch = _Changes(trl)
    # The job runs the CPU/CI stack's TRL on CPU and the images' TRL on GPUs (ogrpo/compat.py).
    for c in config_changes(trl, CPU_LINE if gpu.is_cpu else IMAGE_LINE):
        ch.add(c["key"], c["from"], c["to"], c["reason"])

    # ---- precision, attention, hardware flags -----------------------------------------------------------
    if gpu.is_cpu:
        precision = s.add("precision", "fp32", "CPU: fp32 keeps vLLM and HF log-probs equal (bf16 differs by ~0.01)")
        for key in ("bf16", "fp16"):
            ch.adapt(key, False, "CPU: fp32 keeps vLLM and HF log-probs equal (no half-precision autocast)")
    elif gpu.bf16:
        if trl.get("fp16") is True:
            precision = s.add("precision", "fp16", "fp16 requested in the run config")
        else:
            precision = s.add("precision", "bf16", f"{gpu.name} (sm_{gpu.sm}) has bf16: no loss scaling needed")
    else:
        precision = s.add("precision", "fp16", f"{gpu.name} (sm_{gpu.sm}) has no bf16: fp16 with loss scaling")
        if trl.get("bf16") is True:
            ch.add("bf16", True, False, f"{gpu.name} (sm_{gpu.sm}) has no bf16: fp16 with dynamic loss scaling "
                                        "(fp16: true)")
    if model.fp32_only and not gpu.is_cpu and not gpu.bf16:
        raise ConfigError([f"{model.name} ({model.model_type}) runs only in fp32 in vLLM, and {gpu.name} cannot serve "
                           "it with --dtype half; use an sm_80+ GPU (A40, A100) or another model"], run_config.source)

    user_mik = trl.get("model_init_kwargs") if isinstance(trl.get("model_init_kwargs"), dict) else {}
    attn_key = "attn_implementation" if trl.get("attn_implementation") else (
        "model_init_kwargs.attn_implementation" if user_mik.get("attn_implementation") else None)
    want_attn = trl.get("attn_implementation") or user_mik.get("attn_implementation")
    # eager and SDPA run everywhere; anything else (flash-attn 2, hub kernels) needs an sm_80+ GPU here.
    if want_attn and (want_attn in ("eager", "sdpa") or gpu.fa2):
        attn = s.add("attn_implementation", want_attn, "set in the run config")
    elif gpu.is_cpu:
        attn = s.add("attn_implementation", "sdpa", "CPU: PyTorch SDPA (flash-attn needs CUDA)")
    elif gpu.fa2:
        attn = s.add("attn_implementation", "flash_attention_2", f"sm_{gpu.sm} runs flash-attn 2 (Ampere+)")
    else:
        attn = s.add("attn_implementation", "sdpa",
                     f"flash-attn 2 needs sm_80+; SDPA's memory-efficient kernel covers sm_{gpu.sm}")
    if attn_key and attn != want_attn:
        ch.add(attn_key, want_attn, attn, f"CPU: {want_attn} needs CUDA; PyTorch SDPA" if gpu.is_cpu else
               f"{want_attn} has no kernels for {gpu.name} (sm_{gpu.sm}, needs sm_80+); SDPA's memory-efficient "
               "kernel instead")

    # ---- placement --------------------------------------------------------------------------------------
    prompt_len, completion_len = _lengths(run_config, model)
    max_model_len = prompt_len + completion_len
    if max_model_len > model.max_position_embeddings:
        reasons.append(f"prompt {prompt_len} + completion {completion_len} tokens exceed the model's "
                       f"{model.max_position_embeddings} positions")
        fixes.append(_set("max_completion_length", max(1, model.max_position_embeddings - prompt_len)))
    use_vllm = run_config.ogrpo.use_vllm
    if use_vllm is None:
        use_vllm = trl.get("use_vllm", True) is not False
    if use_vllm and trl.get("use_vllm") is None:
        ch.add("use_vllm", False, True, "TRL's default generates with transformers; O-GRPO generates with vLLM "
                                        "(several times faster) unless use_vllm: false")
    elif trl.get("use_vllm") is not None and bool(trl["use_vllm"]) != use_vllm:
        ch.add("use_vllm", trl["use_vllm"], use_vllm, "ogrpo.use_vllm")
    vllm_gpus = run_config.ogrpo.vllm_gpus
    # A recipe's server tensor/data parallel sizes are honored where the hardware allows (TRL reads them only
    # when colocated; `trl vllm-serve` takes them as flags).
    want_tp = trl.get("vllm_tensor_parallel_size")
    want_dp = trl.get("vllm_data_parallel_size")
    dtype_bytes = 4 if gpu.is_cpu else 2
    total = cluster.total_gpus
    gpn = cluster.gpus_per_node

    mode, server_nodes, server_gpus, tp, dp = "none", [], [], 1, 1
    trainer_nodes, trainer_gpus = [0], list(range(gpn))
    if not use_vllm:
        mode = "none"
        if vllm_gpus:
            raise ConfigError([f"ogrpo.vllm_gpus {vllm_gpus} with use_vllm false; drop one of them"],
                              run_config.source)
    elif trl.get("vllm_mode") == "colocate" and vllm_gpus is None:
        mode = "colocate"
    elif vllm_gpus == 0 or (vllm_gpus is None and total == 1):
        mode = "colocate"
    else:
        mode = "server"
    if mode in ("server", "colocate"):
        want_mode = trl.get("vllm_mode")
        if want_mode is None and mode == "server":
            ch.add("vllm_mode", "colocate", "server", f"TRL's default colocates vLLM in each trainer process; on "
                                                      f"{total} devices O-GRPO gives the server its own")
        elif want_mode is not None and want_mode != mode:
            ch.add("vllm_mode", want_mode, mode, "--vllm-gpus" if vllm_gpus is not None else
                   "one device: the server cannot have its own, so vLLM is colocated")

    server_est: Estimate | None = None
    trainer_env: dict[str, str] = {}
    server_env: dict[str, str] = {}
    gen_batch_guess = int(run_config.get("per_device_train_batch_size")) * max(1, total - 1) * int(
        run_config.get("steps_per_generation") or run_config.get("gradient_accumulation_steps"))
    max_num_seqs = max(1, min(gen_batch_guess, 64 if gpu.is_cpu else prof["max_seqs"]))

    want_util = trl.get("vllm_gpu_memory_utilization")
    want_util = float(want_util) if want_util is not None else None
    server_util = CPU_VLLM_UTIL if gpu.is_cpu else (want_util or prof["server_util"])
    if gpu.is_cpu and want_util is not None and mode != "none":
        ch.add("vllm_gpu_memory_utilization", want_util, None, "CPU: vLLM gets an explicit KV budget "
               "(kv_cache_memory_bytes) for the generation batch, not a share of host memory")

    def _server(t: int, util: float | None = None) -> Estimate:
        if util is None:
            util = server_util
        # CPU: an explicit KV budget for the whole generation batch (see memory.kv_budget_bytes); the share
        # stays the ceiling the estimate is checked against.
        kv_bytes = kv_budget_bytes(kv_bytes_per_token_per_gpu(model, 1, dtype_bytes), max_num_seqs,
                                   max_model_len) if gpu.is_cpu else None
        return server_estimate(model, tensor_parallel_size=t, dtype_bytes=dtype_bytes, memory_gib=gpu.memory_gib,
                               gpu_memory_utilization=util, max_model_len=max_model_len,
                               max_num_seqs=max_num_seqs, enforce_eager=prof["eager"] or gpu.is_cpu,
                               is_cpu=gpu.is_cpu, kv_cache_bytes=kv_bytes)

    def _server_ok(e: Estimate) -> bool:
        return e.notes["max_concurrent_seqs"] >= 1 and e.fits

    if mode == "server":
        if gpu.is_cpu:
            if total < 2:
                raise ConfigError(["a vLLM server on CPU needs its own process: use --gpus 2xcpu or more, or "
                                   "ogrpo.vllm_gpus 0 to colocate"], run_config.source)
            n_server = vllm_gpus or 1
            if n_server >= total:
                raise ConfigError([f"--vllm-gpus {n_server} leaves no trainer process on {cluster.spec}; use at "
                                   f"most {total - 1}"], run_config.source)
            tp = 1
            if n_server != 1:
                raise ConfigError(["on CPU the server is one process: --vllm-gpus 1 (or 0 to colocate)"],
                                  run_config.source)
            server_nodes, server_gpus = [0], [0]
            trainer_nodes, trainer_gpus = [0], list(range(1, total))
            server_est = _server(1)
            s.add("placement", f"1 server process + {total - 1} trainer process(es)",
                  "CPU devices are processes: the server gets one, the trainer the rest")
            if total - 1 >= 1:
                trainer_env["OMP_NUM_THREADS"] = s.add(
                    "OMP_NUM_THREADS", "1", "vLLM's CPU worker pins a core; a trainer with 2 threads beside it ran "
                    "1.8x slower than with 1 (shared/vllm-cpu)")
        else:
            limit = gpn
            choices = valid_tp_sizes(model, limit)
            if vllm_gpus is not None:
                if vllm_gpus >= total and cluster.nodes == 1:
                    raise ConfigError([f"--vllm-gpus {vllm_gpus} leaves no trainer GPU on {cluster.spec}; use at "
                                       f"most {total - 1} (or 0 to colocate)"], run_config.source)
                if vllm_gpus > gpn:
                    raise ConfigError([f"--vllm-gpus {vllm_gpus}: a tensor-parallel server stays within one node "
                                       f"({gpn} GPUs); use at most {gpn}"], run_config.source)
                if vllm_gpus not in choices:
                    raise ConfigError([f"--vllm-gpus {vllm_gpus}: tensor parallel size must divide the "
                                       f"{model.num_heads} attention heads ({model.num_kv_heads} KV heads); use one of "
                                       f"{', '.join(map(str, choices))}"], run_config.source)
                tp = vllm_gpus
                server_est = _server(tp)
                s.add("vllm.tensor_parallel_size", tp, "--vllm-gpus")
            elif want_tp and want_tp in choices and want_tp <= (gpn if cluster.nodes > 1 else total - 1):
                tp = int(want_tp)
                server_est = _server(tp)
                s.add("vllm.tensor_parallel_size", tp, "vllm_tensor_parallel_size in the run config")
            else:
                cap = gpn if cluster.nodes > 1 else max(1, total - 1)
                cands = [t for t in choices if t <= cap] or [1]
                tp = cands[-1]
                if cluster.nodes > 1:
                    # The server owns node 0 anyway: the widest tensor-parallel group gives the most KV cache.
                    s.add("vllm.tensor_parallel_size", tp,
                          f"largest size dividing {model.num_heads} heads within the server node")
                else:
                    for t in cands:
                        if _server_ok(_server(t)):
                            tp = t
                            break
                    s.add("vllm.tensor_parallel_size", tp,
                          f"smallest size dividing {model.num_heads} heads that holds the weights and a KV cache")
                server_est = _server(tp)
            if want_dp and want_dp > 1 and tp * want_dp <= (gpn if cluster.nodes > 1 else total - 1):
                dp = s.add("vllm.data_parallel_size", int(want_dp), "vllm_data_parallel_size in the run config")
            if cluster.nodes > 1:
                server_nodes, server_gpus = [0], list(range(tp * dp))
                trainer_nodes, trainer_gpus = list(range(1, cluster.nodes)), list(range(gpn))
                s.add("placement", f"server on node 0 (GPUs 0-{tp * dp - 1}), trainer on nodes 1-{cluster.nodes - 1}",
                      "multi-node: the server gets a whole node so the trainer's collectives stay off it")
                if tp * dp < gpn:
                    warnings.append(f"node 0 keeps {gpn - tp * dp} GPU(s) idle: the server uses tensor parallel {tp}"
                                    f" x data parallel {dp}")
            else:
                server_nodes, server_gpus = [0], list(range(tp * dp))
                trainer_nodes, trainer_gpus = [0], list(range(tp * dp, gpn))
                s.add("placement", f"server GPU(s) {server_gpus}, trainer GPU(s) {trainer_gpus}",
                      "one node: the server takes the fewest GPUs that hold the model, the trainer the rest")
    elif mode == "colocate":
        trainer_nodes, trainer_gpus = [0], list(range(total))
        if cluster.nodes > 1:
            trainer_nodes = list(range(cluster.nodes))
            trainer_gpus = list(range(gpn))
        s.add("placement", "vLLM colocated in each trainer process",
              "one device (or --vllm-gpus 0): vLLM shares it with the trainer")
    else:
        trainer_nodes = list(range(cluster.nodes))
        trainer_gpus = list(range(total)) if gpu.is_cpu else list(range(gpn))
        s.add("placement", "no vLLM: the trainer generates with transformers", "use_vllm is false")

    num_processes = len(trainer_nodes) * len(trainer_gpus)
    if mode != "none":
        ch.adapt("vllm_tensor_parallel_size", tp, "colocated vLLM runs tensor parallel 1 in each trainer process"
                 if mode == "colocate" else f"--vllm-gpus {vllm_gpus}" if vllm_gpus is not None else
                 f"tensor parallel {want_tp} does not divide the model's {model.num_heads} heads or leaves no trainer "
                 f"device on {cluster.spec}")
    if want_dp is not None and want_dp != dp:
        ch.add("vllm_data_parallel_size", want_dp, dp, "no separate vLLM server in this placement" if mode != "server"
               else f"{tp} x {want_dp} server GPUs leave no trainer device on {cluster.spec}")
    ch.adapt("num_processes", num_processes, f"the plan's trainer processes on {cluster.spec}: "
             f"{'one device goes to the vLLM server, ' if mode == 'server' else ''}the trainer gets "
             f"{num_processes}")

    # ---- batch arithmetic (GRPOConfig.__post_init__ rules) -----------------------------------------------
    B = int(run_config.get("per_device_train_batch_size"))
    ga = int(run_config.get("gradient_accumulation_steps"))
    G = int(run_config.get("num_generations"))
    gbs_user = trl.get("generation_batch_size")
    spg_user = trl.get("steps_per_generation")
    if gbs_user is not None and spg_user is not None:
        raise ConfigError(["generation_batch_size and steps_per_generation are both set; keep one"],
                          run_config.source)
    eval_active = bool(run_config.get("do_eval")) and _eval_strategy(trl) != "no" and not _eval_dropped(trl)
    rule = batch_rules(B, ga, G, num_processes, gbs_user, spg_user,
                       eval_batch=int(run_config.get("per_device_eval_batch_size") or 8) if eval_active else None,
                       eval_generations=int(trl.get("num_generations_eval") or G))
    reasons += rule["reasons"]
    fixes += rule["fixes"]
    spg, gbs = rule["steps_per_generation"], rule["generation_batch_size"]
    batch = {"per_device_train_batch_size": B, "gradient_accumulation_steps": ga, "num_generations": G,
             "steps_per_generation": spg, "generation_batch_size": gbs, "prompts_per_generation": gbs // G if G else 0,
             "num_processes": num_processes, "prompt_length": prompt_len, "completion_length": completion_len,
             "max_model_len": max_model_len}
    seq_cap = 64 if gpu.is_cpu else prof["max_seqs"]
    colocate_util = 0.0
    if mode == "server":
        max_num_seqs = max(1, min(gbs, seq_cap))
        server_est = _server(tp)
        if (not _server_ok(server_est) and want_util and not gpu.is_cpu and want_util < prof["server_util"]
                and _server_ok(_server(tp, prof["server_util"]))):
            ch.add("vllm_gpu_memory_utilization", want_util, prof["server_util"],
                   f"a {want_util} share of {gpu.memory_gib:g} GiB leaves the server no KV room for one "
                   f"{max_model_len}-token sequence at tensor parallel {tp}")
            server_util = prof["server_util"]
            server_est = _server(tp)
        if not _server_ok(server_est):
            reasons.append("vLLM server: " + _no_room(server_est, max_model_len, max_num_seqs, gpu.is_cpu))
            bigger = [t for t in valid_tp_sizes(model, gpn) if t > tp] if not gpu.is_cpu else []
            if bigger:
                fixes.append(Fix(f"--vllm-gpus {bigger[0]}", cli={"vllm_gpus": bigger[0]}))
            fixes.append(_set("max_completion_length", max(16, completion_len // 2)))
    elif mode == "colocate":
        # Each trainer process runs its own vLLM (tensor parallel 1) on its device for its share of the batch.
        max_num_seqs = max(1, min(gbs // max(1, num_processes), seq_cap))
        colocate_util = CPU_VLLM_UTIL if gpu.is_cpu else float(want_util or prof["colocate_util"])
        server_est = _server(1, colocate_util)
        while not gpu.is_cpu and not _server_ok(server_est) and colocate_util < 0.7 - 1e-9:
            colocate_util = round(colocate_util + 0.05, 2)
            server_est = _server(1, colocate_util)
        if want_util and not gpu.is_cpu and colocate_util != want_util:
            ch.add("vllm_gpu_memory_utilization", want_util, colocate_util,
                   f"a {want_util} share of {gpu.memory_gib:g} GiB leaves the colocated vLLM no room for one "
                   f"{max_model_len}-token sequence beside the weights")
        if not _server_ok(server_est):
            reasons.append("colocated vLLM: " + _no_room(server_est, max_model_len, max_num_seqs, gpu.is_cpu))
            fixes.append(_set("max_completion_length", max(16, completion_len // 2)))

    # ---- trainer memory and strategy --------------------------------------------------------------------
    headroom = prof["headroom"]
    beta = float(run_config.get("beta") or 0.0)
    liger = bool(trl.get("use_liger_kernel", False))
    lora = lora_spec(trl, precision)  # None without use_peft
    if gpu.is_cpu:
        # All processes share host RAM: the per-process budget is an equal share of what the server leaves.
        server_gib = server_est.total_gib if (server_est and mode == "server") else 0.0
        # Colocated, every trainer process hosts its own vLLM with its own share.
        host_left = gpu.memory_gib * (1 - headroom - colocate_util * num_processes) - server_gib
        budget = host_left / max(1, num_processes)
    else:
        budget = gpu.memory_gib * (1 - headroom - colocate_util)

    gc_user = trl.get("gradient_checkpointing") if _user_set(run_config, "gradient_checkpointing") else None

    kernels = plan_kernels(profile, mode, liger, getattr(run_config.ogrpo, "kernels", None))
    for name, (on, why) in kernels.items():
        s.add(f"kernels.{name}", on, why)

    def est(strategy: str, gc: bool, micro: int = B, n: int = num_processes, use_lora=lora,
            use_liger: bool = liger) -> Estimate:
        return trainer_estimate(model, num_processes=n, strategy=strategy, precision=precision, micro_batch=micro,
                                prompt_len=prompt_len, completion_len=completion_len, gradient_checkpointing=gc,
                                beta=beta, liger=use_liger, lora=use_lora, budget_gib=budget, is_cpu=gpu.is_cpu,
                                fused_logprobs=kernels["linear_logprobs"][0])

    want_strategy = getattr(run_config.ogrpo, "strategy", None)
    if want_strategy is not None and lora and want_strategy != "ddp":
        raise ConfigError([f"ogrpo.strategy {want_strategy} with use_peft: LoRA plans train with DDP (the frozen "
                           "base is not worth sharding); drop one of them"], run_config.source)
    # An explicit strategy is honoured as is, on CPU too (DeepSpeed runs over gloo there): the plan still
    # checks that it fits, and does not fall back to another one.
    strategies = ((want_strategy,) if want_strategy is not None else
                  ("ddp",) if (gpu.is_cpu or lora) else STRATEGIES)
    if gc_user is not None:
        gc_order = [bool(gc_user)]
    elif profile == "aggressive":
        gc_order = [False, True]
    elif profile == "balanced" and est("ddp", False).terms["activations"] <= 0.25 * max(budget, 1e-9):
        gc_order = [False, True]
    else:
        gc_order = [True]
    chosen: tuple[str, bool] | None = None
    for strategy in strategies:
        for gc in gc_order:
            if est(strategy, gc).fits:
                chosen = (strategy, gc)
                break
        if chosen:
            break
    if chosen is None:
        strategy, gc = strategies[-1], (gc_order[-1] if gc_user is not None else True)
        e = est(strategy, gc)
        reasons.append(f"trainer: {e.total_gib:.1f} GiB per {'process' if gpu.is_cpu else 'GPU'} needed "
                       f"({_top_terms(e)}) > {e.budget_gib:.1f} GiB available even with {_STRATEGY_NAMES[strategy]}")
        fixes.extend(_trainer_fixes(est, strategy, B, ga, liger, lora, gc_user, gpu.is_cpu,
                                    prof["colocate_util"] if (mode == "colocate" and want_util
                                                              and want_util > prof["colocate_util"]) else None))
    else:
        strategy, gc = chosen
    trainer_est = est(strategy, gc)
    s.add("trainer.strategy", strategy, _strategy_reason(strategy, num_processes, gpu.is_cpu, want_strategy))
    if gc_user is not None:
        s.add("gradient_checkpointing", gc, "set in the run config")
    else:
        s.add("gradient_checkpointing", gc, "activations fit without recomputation (faster)" if not gc else
              "recompute activations in backward: keeps only each layer's input")

    # ---- trainer_args, vllm args, env -------------------------------------------------------------------
    targs: dict = {}
    mik = dict(trl.get("model_init_kwargs") or {}) if isinstance(trl.get("model_init_kwargs"), dict) else {}
    if gpu.is_cpu:
        targs.update(bf16=False, fp16=False, use_cpu=True)
        s.add("use_cpu", True, "CPU plan: TrainingArguments must not look for CUDA")
        mik_dtype = "float32"
    elif precision == "bf16":
        targs.update(bf16=True, fp16=False)
        mik_dtype = "float32" if strategy == "ddp" else "bfloat16"
    else:
        # TRL turns bf16 on unless fp16 is set, so both are explicit (shared/compat.md).
        targs.update(bf16=False, fp16=True)
        s.add("bf16", False, "GRPOConfig enables bf16 unless told otherwise; V100-class GPUs would fail")
        mik_dtype = "float32"
    if lora:
        mik_dtype = lora.base_dtype
    mik_dtype = s.add("model_init_kwargs.dtype", mik_dtype, LORA_BASE_REASON if lora else
                      "fp32 master weights: bf16/fp16 weights would round away updates at lr ~1e-6"
                      if mik_dtype == "float32" else "DeepSpeed keeps fp32 master weights itself; load half to "
                      "save host RAM")
    for key in ("bf16", "fp16"):
        ch.adapt(key, targs[key], f"{gpu.name} (sm_{gpu.sm}) trains in {precision}")
    for key, user in (("dtype", trl.get("dtype")), ("torch_dtype", trl.get("torch_dtype")),
                      ("model_init_kwargs.dtype", user_mik.get("dtype") or user_mik.get("torch_dtype"))):
        if user is not None and str(user).removeprefix("torch.") != mik_dtype:
            ch.add(key, user, mik_dtype, (f"{gpu.name} (sm_{gpu.sm}) has no bf16: " if str(user).endswith("bfloat16")
                                          and not gpu.bf16 and not gpu.is_cpu else "") +
                   (LORA_BASE_REASON if lora else
                    "fp32 master weights under half-precision autocast: half weights would round away updates "
                    "at lr ~1e-6" if mik_dtype == "float32" else "DeepSpeed keeps fp32 master weights itself"))
    mik.update(attn_implementation=attn, dtype=mik_dtype)
    targs["model_init_kwargs"] = mik
    if not gpu.is_cpu:
        tf32 = bool(gpu.tf32) if (trl.get("tf32") is None or not gpu.tf32) else bool(trl["tf32"])
        targs["tf32"] = s.add("tf32", tf32, ("set in the run config" if trl.get("tf32") is not None else
                                             "TF32 matmuls on Ampere+") if gpu.tf32 else
                              f"sm_{gpu.sm} has no TF32 (transformers raises if it is set)")
        ch.adapt("tf32", tf32, f"{gpu.name} (sm_{gpu.sm}) has no TF32 (transformers raises if it is set)")
    elif trl.get("tf32"):
        targs["tf32"] = ch.adapt("tf32", False, "CPU: no TF32")
    targs["gradient_checkpointing"] = gc
    if gc:
        targs["gradient_checkpointing_kwargs"] = trl.get("gradient_checkpointing_kwargs") or {"use_reentrant": False}
    optim = "adamw_torch" if gpu.is_cpu else "adamw_torch_fused"
    if not _user_set(run_config, "optim"):
        targs["optim"] = s.add("optim", optim, "fused AdamW: one kernel per step on GPU" if not gpu.is_cpu else
                               "CPU: plain AdamW")
    compile_ok = (not gpu.is_cpu) and gpu.triton_tensor_cores and profile == "aggressive"
    if not _user_set(run_config, "torch_compile"):
        targs["torch_compile"] = s.add(
            "torch_compile", compile_ok,
            "Triton has tensor cores on sm_80+ and the aggressive profile accepts compile time" if compile_ok else
            ("CPU: compile time dominates short runs" if gpu.is_cpu else
             f"Triton's tl.dot has no tensor cores on sm_{gpu.sm}" if not gpu.triton_tensor_cores else
             "compile time and recompiles on varying lengths outweigh the gain outside the aggressive profile"))
    if not _user_set(run_config, "dataloader_num_workers"):
        targs["dataloader_num_workers"] = 0 if gpu.is_cpu else 2
    if gpu.is_cpu:
        ch.adapt("use_cpu", True, "CPU plan: TrainingArguments must not look for CUDA")
    elif trl.get("use_cpu"):
        targs["use_cpu"] = ch.adapt("use_cpu", False, f"a {gpu.name} plan trains on its GPUs")
    targs["use_vllm"] = mode != "none"
    if mode == "server":
        targs["vllm_mode"] = "server"
        for key in ("vllm_server_base_url", "vllm_server_host", "vllm_server_port"):
            if trl.get(key) is not None:
                ch.add(key, trl[key], None, "the job starts its own vLLM server and gives the trainer its URL")
    elif mode == "colocate":
        targs["vllm_mode"] = "colocate"
        targs["vllm_gpu_memory_utilization"] = s.add(
            "vllm_gpu_memory_utilization", colocate_util,
            "colocated vLLM's share of the device; the trainer plans with the rest")
        targs["vllm_tensor_parallel_size"] = 1
        targs["vllm_max_model_length"] = ch.adapt("vllm_max_model_length", max_model_len,
                                                  "the prompt + completion budget the memory plan holds")
    if mode != "none" and not _user_set(run_config, "vllm_server_timeout"):
        targs["vllm_server_timeout"] = 900.0
    if trl.get("deepspeed") is not None:
        # accelerate.yaml names the job's deepspeed.json; a second file in TrainingArguments would conflict.
        targs["deepspeed"] = None
        ch.add("deepspeed", trl["deepspeed"], "deepspeed.json" if strategy != "ddp" else None,
               f"the plan picks {_STRATEGY_NAMES[strategy]} for {cluster.spec}"
               + (" and renders its own DeepSpeed config" if strategy != "ddp" else ", which needs no DeepSpeed config")
               + "; the recipe's file is not read")
    if _eval_dropped(trl):
        targs["eval_strategy"] = "no"
        key = "eval_strategy" if trl.get("eval_strategy") not in (None, "no") else "evaluation_strategy"
        ch.add(key, trl[key], "no", "O-GRPO's trainer loads no eval split (transformers refuses an eval strategy "
                                    "without one)")
    if trl.get("output_dir") is not None:
        ch.add("output_dir", trl["output_dir"], "<job dir>/run", "the job's run directory (--output-dir) holds "
                                                                 "checkpoints, logs and the manifest")

    env: dict[str, str] = {"TOKENIZERS_PARALLELISM": "false"}
    if not gpu.is_cpu:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        if gpu.interconnect == "pcie" and (total > 1):
            env["NCCL_P2P_DISABLE"] = s.add("NCCL_P2P_DISABLE", "1",
                                            f"{gpu.name} boxes are PCIe: the trainer→vLLM NCCL broadcast can hang "
                                            "with P2P (TRL #5865, #2923)")
    for key, var in (("wandb_entity", "WANDB_ENTITY"), ("wandb_project", "WANDB_PROJECT"),
                     ("wandb_run_group", "WANDB_RUN_GROUP")):
        if trl.get(key):
            env[var] = str(trl[key])  # what open-r1's init_wandb_training does with these keys
    if isinstance(run_config.ogrpo.env, dict):
        env.update({str(k): str(v) for k, v in run_config.ogrpo.env.items()})

    vllm: dict = {"nodes": server_nodes, "gpus": server_gpus, "num_gpus": len(server_nodes) * len(server_gpus),
                  "tensor_parallel_size": tp if mode != "none" else 0,
                  "data_parallel_size": dp if mode == "server" else 0,
                  "memory_gib_per_gpu": round(server_est.total_gib, 2) if server_est else 0.0,
                  "memory_terms": server_est.to_dict() if server_est else {}, "env": server_env, "args": {}}
    if mode in ("server", "colocate"):
        vdtype = "float32" if gpu.is_cpu else ("bfloat16" if precision == "bf16" else "half")
        s.add("vllm.dtype", vdtype, "CPU: fp32 so vLLM log-probs match the trainer's" if gpu.is_cpu else
              ("bf16 models fall back badly on sm_70: pass --dtype half" if vdtype == "half" else
               "same dtype as training"))
        util = server_util if mode == "server" else colocate_util
        memory_arg = {"gpu_memory_utilization": util} if not gpu.is_cpu else {"kv_cache_memory_bytes": s.add(
            "vllm.kv_cache_memory_bytes", server_est.notes["kv_cache_memory_bytes"],
            f"CPU: KV for {max_num_seqs} x {max_model_len} tokens; a share of host memory depends on the NUMA "
            "node's size and the process's resident set (a cold compile cache failed at 0.1)")}
        vllm["args"] = {
            "dtype": vdtype,
            "max_model_len": max_model_len,
            **memory_arg,
            "enable_prefix_caching": s.add("vllm.enable_prefix_caching", True,
                                           "the num_generations completions of a prompt share its KV blocks")
            if trl.get("vllm_enable_prefix_caching") is None else bool(trl["vllm_enable_prefix_caching"]),
            "max_num_seqs": max_num_seqs,
            "enforce_eager": bool(prof["eager"] or gpu.is_cpu),
            "tensor_parallel_size": tp,
            "data_parallel_size": dp,
            "logprobs_mode": "processed_logprobs",
        }
        s.add("vllm.logprobs_mode", "processed_logprobs",
              "TRL's importance-sampling correction compares against the sampler's processed log-probs")
        if mode == "server":
            from ogrpo.serve import CPU_SERVER_ENV, SERVER_ARGS

            vllm["args"]["disable_log_stats"] = s.add(
                "vllm.disable_log_stats", SERVER_ARGS["disable_log_stats"],
                "per-step engine statistics run on the engine's critical path (-12 % tokens/s on CPU, ogrpo bench "
                "rollout); ogrpo's profiler reports generation throughput, TRL's own vllm-serve keeps none")
            server_env["VLLM_SERVER_DEV_MODE"] = "1"
            if gpu.is_cpu:
                for key, value in CPU_SERVER_ENV.items():
                    server_env[key] = s.add(key, value, "CPU: the engine computes on all the server's cores in one "
                                                        "process instead of busy-polling one (1.8x tokens/s)")
            if not gpu.is_cpu and gpu.interconnect == "pcie" and total > 1:
                server_env["NCCL_P2P_DISABLE"] = "1"

    trainer: dict = {"nodes": trainer_nodes, "gpus": trainer_gpus, "num_gpus": 0 if gpu.is_cpu else num_processes,
                     "num_processes": num_processes, "strategy": strategy,
                     "memory_gib_per_gpu": round(trainer_est.total_gib, 2), "memory_terms": trainer_est.to_dict(),
                     "gradient_checkpointing": gc, "env": trainer_env}
    if gpu.is_cpu:
        vllm["num_gpus"] = 0

    fits = not reasons
    held: list[Fix] = []
    if not fits and check_fixes:
        held = _fixes_that_hold(fixes, cluster, model, run_config, profile)
    return Plan(cluster=cluster, model=model, profile=profile, fits=fits, reasons=reasons,
                fixes=[f.text for f in held], precision=precision, attn_implementation=attn, mode=mode, vllm=vllm,
                trainer=trainer, trainer_args=targs, env=env, settings=s.items, batch=batch,
                warnings=warnings + ([] if model.exact_shapes else
                                     [f"{model.name}: shapes extrapolated from --params; activations are rough"]),
                changes=ch.items, fix_actions=[f.to_dict() for f in held],
                kernels={name: on for name, (on, _) in kernels.items()})


_STRATEGY_NAMES = {"ddp": "DDP", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
                   "zero3_offload": "ZeRO-3 with optimizer offload"}


def plan_kernels(profile: str, mode: str, liger: bool, wanted: bool | None) -> dict[str, tuple[bool, str]]:
    """O-GRPO's own kernels (ogrpo/kernels) for this run: name -> (on, reason). `wanted`: `ogrpo.kernels`."""
    if wanted is False:
        return {k: (False, "ogrpo.kernels: false in the run config") for k in ("linear_logprobs", "fused_sample")}
    safe = profile != "conservative" or wanted is True
    if liger:
        logprobs = (False, "use_liger_kernel: Liger's chunked loss already avoids the full logits")
    elif safe:
        logprobs = (True, "log-probs and entropies one token chunk at a time: the B·C·V logits are never held "
                          "(memory term: one chunk)")
    else:
        logprobs = (False, "the conservative profile keeps TRL's own log-prob path")
    if mode != "none":
        sample = (False, "vLLM samples the rollouts")
    elif safe:
        sample = (True, "HF generate rollouts: penalty, temperature, top-k/p and the draw in one pass per row")
    else:
        sample = (False, "the conservative profile keeps transformers' sampling")
    return {"linear_logprobs": logprobs, "fused_sample": sample}


def _strategy_reason(strategy: str, n: int, is_cpu: bool, wanted: str | None = None) -> str:
    if wanted is not None:
        return (f"set in the run config (ogrpo.strategy {wanted})"
                + (f": {_STRATEGY_NAMES[wanted]} over gloo on {n} CPU processes" if is_cpu and wanted != "ddp"
                   else ""))
    if is_cpu:
        return "CPU: DDP over gloo; ogrpo.strategy picks DeepSpeed ZeRO (it runs over gloo too, but slower)"
    return {"ddp": "weights, gradients and optimizer fit on each GPU unsharded (fastest)",
            "zero2": f"gradients and optimizer states sharded over {n} GPUs to fit",
            "zero3": f"weights, gradients and optimizer sharded over {n} GPUs to fit",
            "zero3_offload": "even sharded, the optimizer does not fit: moved to host RAM"}[strategy]


def _no_room(e: Estimate, max_model_len: int, seqs: int, is_cpu: bool) -> str:
    if is_cpu:
        return (f"weights {e.terms['weights']:.1f} GiB + KV for {seqs} x {max_model_len} tokens "
                f"{e.terms['kv_cache']:.1f} GiB + overhead exceed {e.budget_gib:.1f} GiB of host RAM")
    return (f"weights {e.terms['weights']:.1f} GiB + overhead leave no room for one {max_model_len}-token sequence "
            f"in {e.budget_gib:.1f} GiB per GPU")


def _top_terms(e: Estimate) -> str:
    top = sorted(((v, k) for k, v in e.terms.items() if v > 0.05), reverse=True)[:3]
    return ", ".join(f"{k} {v:.1f}" for v, k in top)


def _set(key: str, value, text: str | None = None) -> Fix:
    """A fix that sets one run-config key (None: removes it)."""
    return Fix(text or f"{key} {value}", config={key: value})


def _trainer_fixes(est, strategy, B, ga, liger, lora, gc_user, is_cpu, colocate_util) -> list[Fix]:
    """Candidate fixes for a trainer that does not fit; _fixes_that_hold keeps those that re-plan to a fit."""
    fixes: list[Fix] = []
    if gc_user is False:
        fixes.append(_set("gradient_checkpointing", True, "gradient_checkpointing true"))
    # Smaller micro-batches with more accumulation keep the effective batch and the generation batch.
    b = B
    while b > 1:
        b //= 2
        if B % b == 0 and est(strategy, True, micro=b).fits:
            fixes.append(Fix(f"per_device_train_batch_size {b} with gradient_accumulation_steps {ga * (B // b)}",
                             config={"per_device_train_batch_size": b, "gradient_accumulation_steps": ga * (B // b)}))
            break
    if not liger:
        fixes.append(_set("use_liger_kernel", True, "use_liger_kernel true (chunked loss: no full B·T·V logits)"))
    if not lora and not is_cpu:
        fixes.append(_set("use_peft", True, "LoRA (use_peft: true)"))
    if colocate_util is not None:
        fixes.append(_set("vllm_gpu_memory_utilization", colocate_util))
    return fixes


def _apply_fix(run_config, fix: Fix):
    trl = dict(run_config.trl)
    opts = run_config.ogrpo
    for key, value in fix.config.items():
        if key == "ogrpo":
            opts = dataclasses.replace(opts, **value)
        elif value is None:
            trl.pop(key, None)
        else:
            trl[key] = value
    if "vllm_gpus" in fix.cli:
        opts = dataclasses.replace(opts, vllm_gpus=fix.cli["vllm_gpus"])
    return dataclasses.replace(run_config, trl=trl, ogrpo=opts, warnings=[])


def _holds(fix: Fix, cluster: Cluster, model: ModelFacts, run_config, profile: str) -> bool:
    """Re-plan with the fix applied: it holds when that plan fits (memory and TRL's batch rules)."""
    try:
        target = parse_gpus(fix.cli["gpus"]) if "gpus" in fix.cli else cluster
        return make_plan(target, model, _apply_fix(run_config, fix), profile, check_fixes=False).fits
    except OgrpoError:
        return False


def _hardware_candidates(cluster: Cluster) -> list[str]:
    """Specs of the same GPU type with more GPUs, smallest first: one node up to 8, then whole nodes."""
    gpn = cluster.gpus_per_node if cluster.nodes > 1 else 8
    specs: list[tuple[int, str]] = [(c, f"{c}x{cluster.gpu.name}") for c in range(cluster.total_gpus + 1, 9)
                                    if cluster.nodes == 1]
    specs += [(n * gpn, f"{n}x{gpn}x{cluster.gpu.name}") for n in range(2, 9) if n * gpn > cluster.total_gpus]
    return [spec for _, spec in sorted(specs)]


def _bigger_types(cluster: Cluster) -> list[str]:
    """Same layout on each catalog GPU type with more memory, smallest memory first."""
    from ogrpo.hardware import known_types

    if cluster.is_cpu:
        # A host with more RAM: the same processes, 2x / 4x / 8x the memory.
        count = f"{cluster.total_gpus}x" if cluster.total_gpus > 1 else ""
        return [f"{count}cpu-{cluster.gpu.memory_gib * k:g}G" for k in (2, 4, 8)]
    out = []
    for name in known_types():
        if name == "cpu":
            continue
        g = parse_gpus(name).gpu
        if g.memory_gib > cluster.gpu.memory_gib:
            layout = f"{cluster.nodes}x{cluster.gpus_per_node}" if cluster.nodes > 1 else f"{cluster.gpus_per_node}"
            out.append((g.memory_gib, f"{layout}x{g.name}"))
    return [spec for _, spec in sorted(out)]


def _with(fix: Fix, other: Fix) -> Fix:
    return Fix(f"{fix.text} with {other.text}", config={**fix.config, **other.config}, cli={**fix.cli, **other.cli})


def _fixes_that_hold(candidates: list[Fix], cluster: Cluster, model: ModelFacts, run_config, profile: str,
                     ) -> list[Fix]:
    """The candidates that re-plan to a fit; one that does not hold alone is tried with micro-batch 1 (same
    effective batch through accumulation), since full B·T·V logits often dominate. Then hardware: the fewest
    GPUs of this type, and the smallest bigger GPU type (CPU: host) with this layout."""
    B = int(run_config.get("per_device_train_batch_size"))
    ga = int(run_config.get("gradient_accumulation_steps"))
    micro = (Fix(f"per_device_train_batch_size 1 and gradient_accumulation_steps {ga * B}",
                 config={"per_device_train_batch_size": 1, "gradient_accumulation_steps": ga * B})
             if B > 1 and run_config.trl.get("generation_batch_size") is None else None)

    def first_holding(options: list[Fix]) -> Fix | None:
        for f in options:
            if _holds(f, cluster, model, run_config, profile):
                return f
        return None

    held: list[Fix] = []
    for fix in _dedupe_fixes(candidates):
        options = [fix] + ([_with(fix, micro)] if micro and "per_device_train_batch_size" not in fix.config else [])
        found = first_holding(options)
        if found:
            held.append(found)
    # CPU: a host with more RAM (more processes share the same RAM, so they do not help).
    for specs in ((_bigger_types(cluster),) if cluster.is_cpu else
                  (_hardware_candidates(cluster), _bigger_types(cluster))):
        hw = [Fix(spec, cli={"gpus": spec}) for spec in specs]
        found = first_holding(hw) or (first_holding([_with(f, micro) for f in hw]) if micro else None)
        if found:
            held.append(found)
    return _dedupe_fixes(held)


def _dedupe_fixes(items: list[Fix]) -> list[Fix]:
    seen: set[str] = set()
    return [f for f in items if not (f.text in seen or seen.add(f.text))]


def _eval_strategy(trl: dict) -> str:
    return str(trl.get("eval_strategy") or trl.get("evaluation_strategy") or "no")


def _eval_dropped(trl: dict) -> bool:
    """O-GRPO's trainer loads no eval split, so an eval strategy other than "no" is changed to "no"."""
    return _eval_strategy(trl) != "no"


def batch_rules(B: int, ga: int, G: int, n: int, gbs_user=None, spg_user=None, eval_batch: int | None = None,
                eval_generations: int | None = None) -> dict:
    """TRL's GRPOConfig.__post_init__ batch rules (1.9 and 1.16 alike) for n trainer processes:
    {reasons, fixes, steps_per_generation, generation_batch_size}. `eval_batch`: per_device_eval_batch_size
    when evaluation runs (None: it does not)."""
    reasons: list[str] = []
    fixes: list[Fix] = []
    global_batch = B * n
    if gbs_user is not None:
        gbs = int(gbs_user)
        if gbs % global_batch:
            reasons.append(f"generation_batch_size {gbs} is not divisible by the global batch {B} x {n} processes = "
                           f"{global_batch}")
        spg = max(1, gbs // global_batch)
    else:
        spg = int(spg_user or ga)
        gbs = global_batch * spg
    if gbs % global_batch or gbs % G:
        if gbs % G:
            reasons.append(f"generation batch {gbs} (per_device_train_batch_size {B} x {n} processes x {spg} steps) "
                           f"is not divisible by num_generations {G}")
        # The nearest generation batch that both rules accept: a multiple of lcm(global batch, G).
        unit = global_batch * G // math.gcd(global_batch, G)
        if gbs_user is not None:
            fixes.append(_set("generation_batch_size", max(1, round(gbs / unit)) * unit))
        else:
            step = G // math.gcd(n * spg, G)
            fixes.append(_set("per_device_train_batch_size", math.ceil(B / step) * step))
        divs = [g for g in range(2, G + 1) if gbs % g == 0 and gbs % global_batch == 0]
        if divs:
            fixes.append(_set("num_generations", divs[-1]))
    if eval_batch is not None:
        Ge = eval_generations or G
        if (eval_batch * n) % Ge:
            reasons.append(f"eval batch {eval_batch} x {n} processes is not divisible by num_generations {Ge}")
            step = Ge // math.gcd(n, Ge)
            fixes.append(_set("per_device_eval_batch_size", math.ceil(eval_batch / step) * step))
    return {"reasons": reasons, "fixes": fixes, "steps_per_generation": spg, "generation_batch_size": gbs}


def plan_from_config(run_config, gpus: str | None = None, profile: str | None = None, model: str | None = None,
                     params=None) -> Plan:
    """Parse gpus (argument, else the config's ogrpo.gpus, else "cpu"), resolve the model, plan."""
    from ogrpo.models import resolve_model

    spec = gpus or run_config.ogrpo.gpus or "cpu"
    cluster = parse_gpus(spec)
    name = model or run_config.ogrpo.model or run_config.model_name_or_path
    facts = resolve_model(name, params if params is not None else run_config.ogrpo.params)
    return make_plan(cluster, facts, run_config, profile or run_config.ogrpo.profile or "balanced")
