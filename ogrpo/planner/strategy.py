"""Memory fit: vLLM's share (server or colocated) for the generation batch, then the trainer strategy, the
cheapest that fits (DDP → ZeRO-2 → ZeRO-3 → ZeRO-3 + optimizer offload, as far as the device rules allow)."""

from __future__ import annotations

from dataclasses import dataclass

from ogrpo.planner.memory import Estimate, trainer_estimate
from ogrpo.planner.device_rules import COLOCATE_UTIL_MAX, COLOCATE_UTIL_STEP, STRATEGY_NAMES
from ogrpo.planner.draft import Draft
from ogrpo.planner.fixes import Fix, set_key, trainer_fixes
from ogrpo.planner.kernels import logprobs_where_it_pays, plan_kernels
from ogrpo.planner.placement import Placement, server_load_note, valid_tp_sizes
from ogrpo.planner.lora import lora_spec


@dataclass
class VllmFit:
    estimate: Estimate | None  # None: no vLLM
    util: float  # the device share vLLM gets (server or colocated)
    colocate_util: float  # 0.0 unless colocated: what the trainer must leave to vLLM
    max_num_seqs: int


def fit_vllm(d: Draft, p: Placement, batch: dict) -> VllmFit:
    r, sizer, prof = d.rules, p.sizer, d.prof
    gbs, want_util, max_model_len = batch["generation_batch_size"], p.want_util, p.max_model_len
    cap = r.max_seqs(prof["max_seqs"])
    colocate_util = 0.0
    est = None
    if p.mode == "server":
        sizer.max_num_seqs = max(1, min(gbs, cap))
        est = sizer.estimate(p.tp)
        if (not sizer.ok(est) and want_util and r.raises_server_util() and want_util < prof["server_util"]
                and sizer.ok(sizer.estimate(p.tp, prof["server_util"]))):
            d.changes.add("vllm_gpu_memory_utilization", want_util, prof["server_util"],
                          f"a {want_util} share of {d.gpu.memory_gib:g} GiB leaves the server no KV room for one "
                          f"{max_model_len}-token sequence at tensor parallel {p.tp}")
            sizer.util = prof["server_util"]
            est = sizer.estimate(p.tp)
        if not sizer.ok(est):
            d.reasons.append("vLLM server: " + r.no_room(est, max_model_len, sizer.max_num_seqs))
            bigger = [t for t in valid_tp_sizes(d.model, d.cluster.gpus_per_node) if t > p.tp] \
                if r.wider_tp_fixes() else []
            if bigger:
                d.fixes.append(Fix(f"--vllm-gpus {bigger[0]}", cli={"vllm_gpus": bigger[0]}))
            d.fixes.append(set_key("max_completion_length", max(16, p.completion_len // 2)))
        server_load_note(d, p, gbs, est)
        return VllmFit(est, sizer.util, 0.0, sizer.max_num_seqs)
    if p.mode == "colocate":
        # Each trainer process runs its own vLLM (tensor parallel 1) on its device for its share of the batch.
        sizer.max_num_seqs = max(1, min(gbs // max(1, p.num_processes), cap))
        colocate_util = r.colocate_util(want_util, prof["colocate_util"])
        est = sizer.estimate(1, colocate_util)
        while r.colocate_util_can_grow() and not sizer.ok(est) and colocate_util < COLOCATE_UTIL_MAX - 1e-9:
            colocate_util = round(colocate_util + COLOCATE_UTIL_STEP, 2)
            est = sizer.estimate(1, colocate_util)
        if want_util and r.kv_policy == "utilization" and colocate_util != want_util:
            d.changes.add("vllm_gpu_memory_utilization", want_util, colocate_util,
                          f"a {want_util} share of {d.gpu.memory_gib:g} GiB leaves the colocated vLLM no room for one "
                          f"{max_model_len}-token sequence beside the weights")
        if not sizer.ok(est):
            d.reasons.append("colocated vLLM: " + r.no_room(est, max_model_len, sizer.max_num_seqs))
            d.fixes.append(set_key("max_completion_length", max(16, p.completion_len // 2)))
    return VllmFit(est, colocate_util, colocate_util, sizer.max_num_seqs)


@dataclass
class TrainerFit:
    strategy: str
    gradient_checkpointing: bool
    estimate: Estimate
    lora: object  # ogrpo.trainer.peft_config's LoRA spec, or None
    kernels: dict[str, tuple[bool, str]]


def _top_terms(e: Estimate) -> str:
    top = sorted(((v, k) for k, v in e.terms.items() if v > 0.05), reverse=True)[:3]
    return ", ".join(f"{k} {v:.1f}" for v, k in top)


def fit_trainer(d: Draft, p: Placement, batch: dict, v: VllmFit, precision: str) -> TrainerFit:
    r, trl, s, prof, profile = d.rules, d.trl, d.settings, d.prof, d.profile
    n, B, ga = p.num_processes, batch["per_device_train_batch_size"], batch["gradient_accumulation_steps"]
    beta = float(d.run_config.get("beta") or 0.0)
    liger = bool(trl.get("use_liger_kernel", False))
    lora = lora_spec(trl, precision)  # None without use_peft
    server_gib = v.estimate.total_gib if (v.estimate and p.mode == "server") else 0.0
    budget = r.trainer_budget(d.gpu.memory_gib, prof["headroom"], v.colocate_util, n, server_gib)
    gc_user = trl.get("gradient_checkpointing") if d.user_set("gradient_checkpointing") else None

    wanted_kernels = getattr(d.run_config.ogrpo, "kernels", None)
    kernels = plan_kernels(profile, p.mode, liger, wanted_kernels)

    def est(strategy: str, gc: bool, micro: int = B, fused: bool | None = None) -> Estimate:
        # A smaller micro-batch is suggested with the accumulation that keeps the effective batch (trainer_fixes).
        return trainer_estimate(d.model, num_processes=n, strategy=strategy, precision=precision, micro_batch=micro,
                                prompt_len=p.prompt_len, completion_len=p.completion_len, gradient_checkpointing=gc,
                                beta=beta, liger=liger, lora=lora, budget_gib=budget, device=r.memory_terms,
                                fused_logprobs=kernels["linear_logprobs"][0] if fused is None else fused,
                                grad_accumulation_steps=ga * max(1, B // micro))

    want = getattr(d.run_config.ogrpo, "strategy", None)
    # An explicit strategy is honoured as is, on CPU too (DeepSpeed runs over gloo there): the plan still
    # checks that it fits, and does not fall back to another one. LoRA is chosen by memory like a full
    # fine-tune (TRL trains a peft model under either stage): ZeRO-2 shards only the adapters' gradients and
    # optimizer states, ZeRO-3 also the frozen base, though TRL gathers the whole model to merge the adapters
    # before each weight push (memory.trainer_estimate's zero3_lora_full_gather).
    strategies = (want,) if want is not None else r.strategies
    if gc_user is not None:
        gc_order = [bool(gc_user)]
    elif profile == "aggressive":
        gc_order = [False, True]
    elif profile == "balanced" and est("ddp", False).terms["activations"] <= 0.25 * max(budget, 1e-9):
        gc_order = [False, True]
    else:
        gc_order = [True]

    def pick(fused: bool | None = None) -> tuple[str, bool] | None:
        return next(((st, gc) for st in strategies for gc in gc_order if est(st, gc, fused=fused).fits), None)

    kernels = logprobs_where_it_pays(kernels, r.kind, wanted_kernels, pick,
                                     lambda fused: est(strategies[0], gc_order[0], fused=fused).terms["logits"])
    for name, (on, why) in kernels.items():
        s.add(f"kernels.{name}", on, why)
    chosen = pick()
    if chosen is None:
        gc = gc_order[-1] if gc_user is not None else True
        # The figure named is the least any strategy tried needs, not the last one's: the last is not always the
        # smallest (on one process ZeRO shards nothing, and LoRA's ZeRO-3 gathers the whole model to merge).
        # Within 0.1 GiB (the message's rounding) the cheaper strategy, earlier in the list, is named.
        tried = {st: est(st, gc) for st in strategies}
        least = min(e.total_gib for e in tried.values())
        strategy = next(st for st in strategies if tried[st].total_gib <= least + 0.1)
        e = tried[strategy]
        if len(tried) == 1:
            which = f"with {STRATEGY_NAMES[strategy]} (ogrpo.strategy)"
        else:
            which = f"with {STRATEGY_NAMES[strategy]}, the least of the {len(tried)} strategies tried"
        if n == 1 and "ddp" in tried:
            which += (" (one process: ZeRO has nothing to shard)" if strategy == "ddp" else
                      f"; DDP in one process needs {tried['ddp'].total_gib:.1f}")
        d.reasons.append(f"trainer: {e.total_gib:.1f} GiB per {r.unit} needed ({_top_terms(e)}) > "
                         f"{e.budget_gib:.1f} GiB available {which}")
        want_util = p.want_util
        d.fixes.extend(trainer_fixes(est, strategy, B, ga, liger, lora, gc_user, r.suggests_lora,
                                     prof["colocate_util"] if (p.mode == "colocate" and want_util
                                                               and want_util > prof["colocate_util"]) else None))
    else:
        strategy, gc = chosen
    s.add("trainer.strategy", strategy, r.strategy_reason(strategy, n, want, lora=bool(lora)))
    if gc_user is not None:
        s.add("gradient_checkpointing", gc, "set in the run config")
    else:
        s.add("gradient_checkpointing", gc, "activations fit without recomputation (faster)" if not gc else
              "recompute activations in backward: keeps only each layer's input")
    return TrainerFit(strategy, gc, est(strategy, gc), lora, kernels)
