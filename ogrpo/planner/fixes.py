"""Suggested fixes for a plan that does not fit: candidates from the steps, kept only when a re-plan with the
fix applied fits (memory and TRL's batch rules); then hardware: the smallest that fits."""

from __future__ import annotations

import dataclasses

from ogrpo.errors import OgrpoError
from ogrpo.planner.types import Fix  # the plan's fix_actions are these
from ogrpo.hardware import parse_gpus


def set_key(key: str, value, text: str | None = None) -> Fix:
    """A fix that sets one run-config key (None: removes it)."""
    return Fix(text or f"{key} {value}", config={key: value})


def trainer_fixes(est, strategy, B, ga, liger, lora, gc_user, suggests_lora, colocate_util) -> list[Fix]:
    """Candidate fixes for a trainer that does not fit; fixes_that_hold keeps those that re-plan to a fit."""
    fixes: list[Fix] = []
    if gc_user is False:
        fixes.append(set_key("gradient_checkpointing", True, "gradient_checkpointing true"))
    # Smaller micro-batches with more accumulation keep the effective batch and the generation batch.
    b = B
    while b > 1:
        b //= 2
        if B % b == 0 and est(strategy, True, micro=b).fits:
            fixes.append(Fix(f"per_device_train_batch_size {b} with gradient_accumulation_steps {ga * (B // b)}",
                             config={"per_device_train_batch_size": b, "gradient_accumulation_steps": ga * (B // b)}))
            break
    if not liger:
        fixes.append(set_key("use_liger_kernel", True, "use_liger_kernel true (chunked loss: no full B·T·V logits)"))
    if not lora and suggests_lora:
        fixes.append(set_key("use_peft", True, "LoRA (use_peft: true)"))
    if colocate_util is not None:
        fixes.append(set_key("vllm_gpu_memory_utilization", colocate_util))
    return fixes


def apply_fix(run_config, fix: Fix):
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


def _holds(fix: Fix, cluster, model, run_config, profile: str, replan) -> bool:
    """Re-plan with the fix applied: it holds when that plan fits (memory and TRL's batch rules)."""
    try:
        target = parse_gpus(fix.cli["gpus"]) if "gpus" in fix.cli else cluster
        return replan(target, model, apply_fix(run_config, fix), profile).fits
    except OgrpoError:
        return False


def _with(fix: Fix, other: Fix) -> Fix:
    return Fix(f"{fix.text} with {other.text}", config={**fix.config, **other.config}, cli={**fix.cli, **other.cli})


def micro_batches(B: int, ga: int) -> list[Fix]:
    """Smaller micro-batches that keep the effective batch through accumulation, largest first (the smallest
    change): each divisor B/2, B/4 ... 1 of B with ga x B/b accumulation steps."""
    out, b = [], B
    while b > 1:
        b //= 2
        while B % b:
            b -= 1
        out.append(Fix(f"per_device_train_batch_size {b} and gradient_accumulation_steps {ga * (B // b)}",
                       config={"per_device_train_batch_size": b, "gradient_accumulation_steps": ga * (B // b)}))
    return out


def fixes_that_hold(candidates: list[Fix], cluster, model, run_config, profile: str, rules, replan) -> list[Fix]:
    """The candidates that re-plan to a fit; one that does not hold alone is tried with smaller micro-batches
    (same effective batch through accumulation, the largest micro-batch that fits), since full B·T·V logits
    often dominate. Then hardware, in the groups the device rules name (GPUs: the fewest GPUs of any type at
    least this large, then the fewest of this type; CPU: a host with more RAM). `replan(cluster, model,
    run_config, profile) -> Plan` is the planner itself, handed in by its caller: the steps sit below it."""
    B = int(run_config.get("per_device_train_batch_size"))
    ga = int(run_config.get("gradient_accumulation_steps"))
    micro = micro_batches(B, ga) if run_config.trl.get("generation_batch_size") is None else []

    def first_holding(options) -> Fix | None:
        return next((f for f in options if _holds(f, cluster, model, run_config, profile, replan)), None)

    held: list[Fix] = []
    for fix in dedupe(candidates):
        options = [fix] + ([_with(fix, m) for m in micro] if "per_device_train_batch_size" not in fix.config else [])
        found = first_holding(options)
        if found:
            held.append(found)
    # A recipe's num_processes is kept on other hardware too; where only more trainer processes fit, the
    # hardware fix says it drops it.
    procs = run_config.trl.get("num_processes")
    unpin = Fix(f"num_processes unset (was {procs})", config={"num_processes": None}) if procs is not None else None
    for specs in rules.hardware_fix_specs(cluster):
        found = first_holding(_variants([Fix(spec, cli={"gpus": spec}) for spec in specs], micro, unpin))
        if found:
            held.append(found)
    return dedupe(held)


def _variants(hw: list[Fix], micro: list[Fix], unpin: Fix | None):
    """Each hardware option as is, then with each smaller micro-batch, then with num_processes unset (and the
    micro-batches): the first that holds is the smallest change on the fewest GPUs."""
    yield from hw
    for m in micro:
        yield from (_with(f, m) for f in hw)
    if unpin:
        yield from (_with(f, unpin) for f in hw)
        for m in micro:
            yield from (_with(_with(f, m), unpin) for f in hw)


def dedupe(items: list[Fix]) -> list[Fix]:
    seen: set[str] = set()
    return [f for f in items if not (f.text in seen or seen.add(f.text))]
