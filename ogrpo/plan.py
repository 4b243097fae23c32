"""The planner: (cluster, model, run config, profile) -> Plan. Pure: no I/O, no torch.

Placement: one GPU colocates vLLM inside the trainer; a single node splits in-node (the server gets the
smallest tensor-parallel group that holds the model and a KV cache, the trainer the rest); several nodes give
the server whole node(s). `--vllm-gpus N` overrides. On CPU, "devices" are processes: `cpu` colocates,
`NxCPU` runs one server process and N-1 trainer processes.
Then the trainer strategy is the cheapest that fits (DDP → ZeRO-2 → ZeRO-3 → ZeRO-3 + optimizer offload),
the batch arithmetic TRL enforces is checked, and every hardware-aware setting carries its reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ogrpo.errors import ConfigError, OgrpoError
from ogrpo.hardware import Cluster, parse_gpus
from ogrpo.memory import Estimate, kv_budget_bytes, kv_bytes_per_token_per_gpu, server_estimate, trainer_estimate
from ogrpo.models import ModelFacts

PROFILES = ("conservative", "balanced", "aggressive")
STRATEGIES = ("ddp", "zero2", "zero3", "zero3_offload")

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
        }


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


def make_plan(cluster: Cluster, model: ModelFacts, run_config, profile: str = "balanced") -> Plan:
    profile = profile or run_config.ogrpo.profile or "balanced"
    if profile not in PROFILES:
        raise OgrpoError(f"--profile {profile!r}: choose one of {', '.join(PROFILES)}")
    prof = _PROFILE[profile]
    gpu = cluster.gpu
    s = _Settings()
    reasons: list[str] = []
    fixes: list[str] = []
    warnings: list[str] = []
    trl = run_config.trl

    # ---- precision, attention, hardware flags -----------------------------------------------------------
    if gpu.is_cpu:
        precision = s.add("precision", "fp32", "CPU: fp32 keeps vLLM and HF log-probs equal (bf16 differs by ~0.01)")
    elif gpu.bf16:
        if trl.get("fp16") is True:
            precision = s.add("precision", "fp16", "fp16 requested in the run config")
        else:
            precision = s.add("precision", "bf16", f"{gpu.name} (sm_{gpu.sm}) has bf16: no loss scaling needed")
    else:
        if trl.get("bf16") is True:
            raise ConfigError([f"bf16: true cannot run on {gpu.name} (sm_{gpu.sm} has no bf16); remove it, the "
                               "plan sets fp16 there"], run_config.source)
        precision = s.add("precision", "fp16", f"{gpu.name} (sm_{gpu.sm}) has no bf16: fp16 with loss scaling")
    if model.fp32_only and not gpu.is_cpu and not gpu.bf16:
        raise ConfigError([f"{model.name} ({model.model_type}) runs only in fp32 in vLLM, and {gpu.name} cannot serve "
                           "it with --dtype half; use an sm_80+ GPU (A40, A100) or another model"], run_config.source)

    want_attn = trl.get("attn_implementation")
    if gpu.is_cpu:
        attn = s.add("attn_implementation", "sdpa", "CPU: PyTorch SDPA (flash-attn needs CUDA)")
    elif gpu.fa2:
        if want_attn and want_attn != "flash_attention_2":
            attn = s.add("attn_implementation", want_attn, "set in the run config")
        else:
            attn = s.add("attn_implementation", "flash_attention_2", f"sm_{gpu.sm} runs flash-attn 2 (Ampere+)")
    else:
        if want_attn == "flash_attention_2":
            raise ConfigError([f"attn_implementation: flash_attention_2 does not run on {gpu.name} (sm_{gpu.sm}); "
                               "remove it, the plan uses sdpa"], run_config.source)
        attn = s.add("attn_implementation", "sdpa",
                     f"flash-attn 2 needs sm_80+; SDPA's memory-efficient kernel covers sm_{gpu.sm}")

    # ---- placement --------------------------------------------------------------------------------------
    prompt_len, completion_len = _lengths(run_config, model)
    max_model_len = prompt_len + completion_len
    if max_model_len > model.max_position_embeddings:
        reasons.append(f"prompt {prompt_len} + completion {completion_len} tokens exceed the model's "
                       f"{model.max_position_embeddings} positions")
        fixes.append(f"max_completion_length {max(1, model.max_position_embeddings - prompt_len)}")
    use_vllm = run_config.ogrpo.use_vllm
    if use_vllm is None:
        use_vllm = trl.get("use_vllm", True) is not False
    vllm_gpus = run_config.ogrpo.vllm_gpus
    dtype_bytes = 4 if gpu.is_cpu else 2
    total = cluster.total_gpus
    gpn = cluster.gpus_per_node

    mode, server_nodes, server_gpus, tp = "none", [], [], 1
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

    server_est: Estimate | None = None
    trainer_env: dict[str, str] = {}
    server_env: dict[str, str] = {}
    gen_batch_guess = int(run_config.get("per_device_train_batch_size")) * max(1, total - 1) * int(
        run_config.get("steps_per_generation") or run_config.get("gradient_accumulation_steps"))
    max_num_seqs = max(1, min(gen_batch_guess, 64 if gpu.is_cpu else prof["max_seqs"]))

    def _server(t: int, util: float | None = None) -> Estimate:
        if util is None:
            util = CPU_VLLM_UTIL if gpu.is_cpu else prof["server_util"]
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
            if cluster.nodes > 1:
                server_nodes, server_gpus = [0], list(range(tp))
                trainer_nodes, trainer_gpus = list(range(1, cluster.nodes)), list(range(gpn))
                s.add("placement", f"server on node 0 (GPUs 0-{tp - 1}), trainer on nodes 1-{cluster.nodes - 1}",
                      "multi-node: the server gets a whole node so the trainer's collectives stay off it")
                if tp < gpn:
                    warnings.append(f"node 0 keeps {gpn - tp} GPU(s) idle: the server uses tensor parallel {tp} "
                                    f"(data parallel 1 for a dense model)")
            else:
                server_nodes, server_gpus = [0], list(range(tp))
                trainer_nodes, trainer_gpus = [0], list(range(tp, gpn))
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

    # ---- batch arithmetic (GRPOConfig.__post_init__ rules) -----------------------------------------------
    B = int(run_config.get("per_device_train_batch_size"))
    ga = int(run_config.get("gradient_accumulation_steps"))
    G = int(run_config.get("num_generations"))
    gbs_user = trl.get("generation_batch_size")
    spg_user = trl.get("steps_per_generation")
    if gbs_user is not None and spg_user is not None:
        raise ConfigError(["generation_batch_size and steps_per_generation are both set; keep one"],
                          run_config.source)
    global_batch = B * num_processes
    if gbs_user is not None:
        gbs = int(gbs_user)
        if gbs % global_batch:
            reasons.append(f"generation_batch_size {gbs} is not divisible by the global batch {B} x "
                           f"{num_processes} processes = {global_batch}")
            fixes.append(f"generation_batch_size {max(1, round(gbs / global_batch)) * global_batch}")
        spg = max(1, gbs // global_batch)
    else:
        spg = int(spg_user or ga)
        gbs = global_batch * spg
    if gbs % G:
        reasons.append(f"generation batch {gbs} (per_device_train_batch_size {B} x {num_processes} processes x "
                       f"{spg} steps) is not divisible by num_generations {G}")
        step = G // math.gcd(num_processes * spg, G)
        up = math.ceil(B / step) * step
        fixes.append(f"per_device_train_batch_size {up}")
        divs = [g for g in range(2, G + 1) if gbs % g == 0]
        if divs:
            fixes.append(f"num_generations {divs[-1]}")
    batch = {"per_device_train_batch_size": B, "gradient_accumulation_steps": ga, "num_generations": G,
             "steps_per_generation": spg, "generation_batch_size": gbs, "prompts_per_generation": gbs // G if G else 0,
             "num_processes": num_processes, "prompt_length": prompt_len, "completion_length": completion_len,
             "max_model_len": max_model_len}
    seq_cap = 64 if gpu.is_cpu else prof["max_seqs"]
    colocate_util = 0.0
    if mode == "server":
        max_num_seqs = max(1, min(gbs, seq_cap))
        server_est = _server(tp)
        if not _server_ok(server_est):
            reasons.append("vLLM server: " + _no_room(server_est, max_model_len, max_num_seqs, gpu.is_cpu))
            bigger = [t for t in valid_tp_sizes(model, gpn) if t > tp] if not gpu.is_cpu else []
            if bigger:
                fixes.append(f"--vllm-gpus {bigger[0]}")
            fixes.append(f"max_completion_length {max(16, completion_len // 2)}")
    elif mode == "colocate":
        # Each trainer process runs its own vLLM (tensor parallel 1) on its device for its share of the batch.
        max_num_seqs = max(1, min(gbs // max(1, num_processes), seq_cap))
        colocate_util = CPU_VLLM_UTIL if gpu.is_cpu else prof["colocate_util"]
        server_est = _server(1, colocate_util)
        while not gpu.is_cpu and not _server_ok(server_est) and colocate_util < 0.7 - 1e-9:
            colocate_util = round(colocate_util + 0.05, 2)
            server_est = _server(1, colocate_util)
        if not _server_ok(server_est):
            reasons.append("colocated vLLM: " + _no_room(server_est, max_model_len, max_num_seqs, gpu.is_cpu))
            if not gpu.is_cpu:
                fixes.append(f"a separate vLLM server: 2x{gpu.name} or more")
            fixes.append(f"max_completion_length {max(16, completion_len // 2)}")

    # ---- trainer memory and strategy --------------------------------------------------------------------
    headroom = prof["headroom"]
    beta = float(run_config.get("beta") or 0.0)
    liger = bool(trl.get("use_liger_kernel", False))
    lora = bool(trl.get("use_peft", False))
    if gpu.is_cpu:
        # All processes share host RAM: the per-process budget is an equal share of what the server leaves.
        server_gib = server_est.total_gib if (server_est and mode == "server") else 0.0
        # Colocated, every trainer process hosts its own vLLM with its own share.
        host_left = gpu.memory_gib * (1 - headroom - colocate_util * num_processes) - server_gib
        budget = host_left / max(1, num_processes)
    else:
        budget = gpu.memory_gib * (1 - headroom - colocate_util)

    gc_user = trl.get("gradient_checkpointing") if _user_set(run_config, "gradient_checkpointing") else None

    def est(strategy: str, gc: bool, micro: int = B, n: int = num_processes, use_lora: bool = lora,
            use_liger: bool = liger) -> Estimate:
        return trainer_estimate(model, num_processes=n, strategy=strategy, precision=precision, micro_batch=micro,
                                prompt_len=prompt_len, completion_len=completion_len, gradient_checkpointing=gc,
                                beta=beta, liger=use_liger, lora=use_lora, budget_gib=budget, is_cpu=gpu.is_cpu)

    strategies = ("ddp",) if (gpu.is_cpu or lora) else STRATEGIES
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
        fixes.extend(_trainer_fixes(est, strategy, gc, B, ga, G, num_processes, spg, liger, lora, cluster,
                                    len(server_gpus) * len(server_nodes) if mode == "server" else 0, gc_user))
    else:
        strategy, gc = chosen
    trainer_est = est(strategy, gc)
    s.add("trainer.strategy", strategy, _strategy_reason(strategy, num_processes, gpu.is_cpu))
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
    mik_dtype = s.add("model_init_kwargs.dtype", mik_dtype,
                      "fp32 master weights: bf16/fp16 weights would round away updates at lr ~1e-6"
                      if mik_dtype == "float32" else "DeepSpeed keeps fp32 master weights itself; load half to "
                      "save host RAM")
    mik.update(attn_implementation=attn, dtype=mik_dtype)
    targs["model_init_kwargs"] = mik
    if not gpu.is_cpu:
        targs["tf32"] = s.add("tf32", bool(gpu.tf32), "TF32 matmuls on Ampere+" if gpu.tf32 else
                              f"sm_{gpu.sm} has no TF32 (transformers raises if it is set)")
    targs["gradient_checkpointing"] = gc
    if gc:
        targs["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
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
    targs["dataloader_num_workers"] = 0 if gpu.is_cpu else 2
    targs["use_vllm"] = mode != "none"
    if mode == "server":
        targs["vllm_mode"] = "server"
    elif mode == "colocate":
        targs["vllm_mode"] = "colocate"
        targs["vllm_gpu_memory_utilization"] = s.add(
            "vllm_gpu_memory_utilization", colocate_util,
            "colocated vLLM's share of the device; the trainer plans with the rest")
        targs["vllm_tensor_parallel_size"] = 1
        targs["vllm_max_model_length"] = max_model_len
    if mode != "none" and not _user_set(run_config, "vllm_server_timeout"):
        targs["vllm_server_timeout"] = 900.0

    env: dict[str, str] = {"TOKENIZERS_PARALLELISM": "false"}
    if not gpu.is_cpu:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        if gpu.interconnect == "pcie" and (total > 1):
            env["NCCL_P2P_DISABLE"] = s.add("NCCL_P2P_DISABLE", "1",
                                            f"{gpu.name} boxes are PCIe: the trainer→vLLM NCCL broadcast can hang "
                                            "with P2P (TRL #5865, #2923)")
    if isinstance(run_config.ogrpo.env, dict):
        env.update({str(k): str(v) for k, v in run_config.ogrpo.env.items()})

    vllm: dict = {"nodes": server_nodes, "gpus": server_gpus, "num_gpus": len(server_nodes) * len(server_gpus),
                  "tensor_parallel_size": tp if mode != "none" else 0,
                  "data_parallel_size": 1 if mode == "server" else 0,
                  "memory_gib_per_gpu": round(server_est.total_gib, 2) if server_est else 0.0,
                  "memory_terms": server_est.to_dict() if server_est else {}, "env": server_env, "args": {}}
    if mode in ("server", "colocate"):
        vdtype = "float32" if gpu.is_cpu else ("bfloat16" if precision == "bf16" else "half")
        s.add("vllm.dtype", vdtype, "CPU: fp32 so vLLM log-probs match the trainer's" if gpu.is_cpu else
              ("bf16 models fall back badly on sm_70: pass --dtype half" if vdtype == "half" else
               "same dtype as training"))
        util = (CPU_VLLM_UTIL if gpu.is_cpu else prof["server_util"]) if mode == "server" else colocate_util
        memory_arg = {"gpu_memory_utilization": util} if not gpu.is_cpu else {"kv_cache_memory_bytes": s.add(
            "vllm.kv_cache_memory_bytes", server_est.notes["kv_cache_memory_bytes"],
            f"CPU: KV for {max_num_seqs} x {max_model_len} tokens; a share of host memory depends on the NUMA "
            "node's size and the process's resident set (a cold compile cache failed at 0.1)")}
        vllm["args"] = {
            "dtype": vdtype,
            "max_model_len": max_model_len,
            **memory_arg,
            "enable_prefix_caching": s.add("vllm.enable_prefix_caching", True,
                                           "the num_generations completions of a prompt share its KV blocks"),
            "max_num_seqs": max_num_seqs,
            "enforce_eager": bool(prof["eager"] or gpu.is_cpu),
            "tensor_parallel_size": tp,
            "data_parallel_size": 1,
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
    if not fits and not fixes:
        fixes.append("a bigger GPU type or more GPUs")
    return Plan(cluster=cluster, model=model, profile=profile, fits=fits, reasons=reasons, fixes=_dedupe(fixes),
                precision=precision, attn_implementation=attn, mode=mode, vllm=vllm, trainer=trainer,
                trainer_args=targs, env=env, settings=s.items, batch=batch,
                warnings=warnings + ([] if model.exact_shapes else
                                     [f"{model.name}: shapes extrapolated from --params; activations are rough"]))


_STRATEGY_NAMES = {"ddp": "DDP", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
                   "zero3_offload": "ZeRO-3 with optimizer offload"}


def _strategy_reason(strategy: str, n: int, is_cpu: bool) -> str:
    if is_cpu:
        return "CPU: DDP over gloo (DeepSpeed needs CUDA)"
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


def _trainer_fixes(est, strategy, gc, B, ga, G, n, spg, liger, lora, cluster: Cluster, server_gpus: int,
                   gc_user) -> list[str]:
    fixes: list[str] = []
    if gc_user is False and est(strategy, True).fits:
        fixes.append("gradient_checkpointing true")
        return fixes
    # Smaller micro-batches with more accumulation keep the effective batch.
    b = B
    while b > 1:
        b //= 2
        if est(strategy, True, micro=b).fits:
            fixes.append(f"per_device_train_batch_size {b} with gradient_accumulation_steps {ga * (B // b)}")
            break
    if not liger and est(strategy, True, micro=1, use_liger=True).fits:
        fixes.append("use_liger_kernel true (chunked loss: no full B·T·V logits)")
    if not lora and not cluster.is_cpu and est("ddp", True, micro=1, use_lora=True).fits:
        fixes.append("LoRA (use_peft: true)")
    if not cluster.is_cpu:
        found = False
        for micro in dict.fromkeys((B, 1)):
            for extra in range(1, 65):
                if est("zero3_offload", True, micro=micro, n=n + extra).fits:
                    total = server_gpus + n + extra
                    if cluster.nodes == 1 and total <= 8:
                        fix = f"{total}x{cluster.gpu.name}"
                    else:
                        # Multi-node: the server keeps its own node.
                        nodes = (1 + math.ceil((n + extra) / cluster.gpus_per_node) if cluster.nodes > 1
                                 else math.ceil(total / cluster.gpus_per_node))
                        fix = f"{nodes}x{cluster.gpus_per_node}x{cluster.gpu.name}"
                    fixes.append(fix + (f" with per_device_train_batch_size {micro}" if micro != B else ""))
                    found = True
                    break
            if found:
                break
    if strategy != "zero3_offload" and not cluster.is_cpu and not lora:
        fixes.insert(0, "ZeRO-3 with optimizer offload")
    return fixes


def _dedupe(items: list[str]) -> list[str]:
    seen: set[str] = set()
    return [x for x in items if not (x in seen or seen.add(x))]


def plan_from_config(run_config, gpus: str | None = None, profile: str | None = None, model: str | None = None,
                     params=None) -> Plan:
    """Parse gpus (argument, else the config's ogrpo.gpus, else "cpu"), resolve the model, plan."""
    from ogrpo.models import resolve_model

    spec = gpus or run_config.ogrpo.gpus or "cpu"
    cluster = parse_gpus(spec)
    name = model or run_config.ogrpo.model or run_config.model_name_or_path
    facts = resolve_model(name, params if params is not None else run_config.ogrpo.params)
    return make_plan(cluster, facts, run_config, profile or run_config.ogrpo.profile or "balanced")
