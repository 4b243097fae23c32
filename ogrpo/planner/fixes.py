"""Suggested fixes for a plan that does not fit: candidates from the steps, kept only when a re-plan with the
fix applied fits (memory and TRL's batch rules); then hardware: the smallest that fits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ogrpo.errors import OgrpoError


@dataclass(frozen=True)
class Fix:
    """A suggested fix: its text and the overrides that apply it (run-config keys, `ogrpo` options included
    under "ogrpo"; command-line options `gpus` / `vllm_gpus`)."""

    text: str
    config: dict = field(default_factory=dict)
    cli: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"text": self.text, "config": dict(self.config), "cli": dict(self.cli)}


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


def _holds(fix: Fix, cluster, model, run_config, profile: str) -> bool:
    """Re-plan with the fix applied: it holds when that plan fits (memory and TRL's batch rules)."""
    from ogrpo.hardware import parse_gpus
    from ogrpo.plan import make_plan

    try:
        target = parse_gpus(fix.cli["gpus"]) if "gpus" in fix.cli else cluster
        return make_plan(target, model, apply_fix(run_config, fix), profile, check_fixes=False).fits
    except OgrpoError:
        return False


def _with(fix: Fix, other: Fix) -> Fix:
    return Fix(f"{fix.text} with {other.text}", config={**fix.config, **other.config}, cli={**fix.cli, **other.cli})


def fixes_that_hold(candidates: list[Fix], cluster, model, run_config, profile: str, rules) -> list[Fix]:
    """The candidates that re-plan to a fit; one that does not hold alone is tried with micro-batch 1 (same
    effective batch through accumulation), since full B·T·V logits often dominate. Then hardware, in the
    groups the device rules name (GPUs: the fewest GPUs of this type, then the smallest bigger type; CPU: a
    host with more RAM)."""
    B = int(run_config.get("per_device_train_batch_size"))
    ga = int(run_config.get("gradient_accumulation_steps"))
    micro = (Fix(f"per_device_train_batch_size 1 and gradient_accumulation_steps {ga * B}",
                 config={"per_device_train_batch_size": 1, "gradient_accumulation_steps": ga * B})
             if B > 1 and run_config.trl.get("generation_batch_size") is None else None)

    def first_holding(options: list[Fix]) -> Fix | None:
        return next((f for f in options if _holds(f, cluster, model, run_config, profile)), None)

    held: list[Fix] = []
    for fix in dedupe(candidates):
        options = [fix] + ([_with(fix, micro)] if micro and "per_device_train_batch_size" not in fix.config else [])
        found = first_holding(options)
        if found:
            held.append(found)
    for specs in rules.hardware_fix_specs(cluster):
        hw = [Fix(spec, cli={"gpus": spec}) for spec in specs]
        found = first_holding(hw) or (first_holding([_with(f, micro) for f in hw]) if micro else None)
        if found:
            held.append(found)
    return dedupe(held)


def dedupe(items: list[Fix]) -> list[Fix]:
    seen: set[str] = set()
    return [f for f in items if not (f.text in seen or seen.add(f.text))]
