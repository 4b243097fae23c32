"""Batch rules: the arithmetic TRL's GRPOConfig.__post_init__ enforces, checked for the plan's trainer processes
(a plan that breaks them would fail at the trainer's start, after the allocation was granted)."""

from __future__ import annotations

import math

from ogrpo.errors import ConfigError
from ogrpo.planner.draft import Draft
from ogrpo.planner.fixes import Fix, set_key
from ogrpo.planner.placement import Placement


# Completions in one generation round (per_device_train_batch_size x processes x steps_per_generation): open-r1's
# largest recipes generate a few thousand; a million is beyond any dataset a GRPO run steps through in one round
# and beyond what vLLM could hold, so a larger batch is a typo to refuse, not a plan to fix with accumulation.
MAX_GENERATION_BATCH = 2**20


def eval_strategy(trl: dict) -> str:
    return str(trl.get("eval_strategy") or trl.get("evaluation_strategy") or "no")


def eval_dropped(trl: dict) -> bool:
    """O-GRPO's trainer loads no eval split, so an eval strategy other than "no" is changed to "no"."""
    return eval_strategy(trl) != "no"


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
            fixes.append(set_key("generation_batch_size", max(1, round(gbs / unit)) * unit))
        else:
            step = G // math.gcd(n * spg, G)
            fixes.append(set_key("per_device_train_batch_size", math.ceil(B / step) * step))
        divs = [g for g in range(2, G + 1) if gbs % g == 0 and gbs % global_batch == 0]
        if divs:
            fixes.append(set_key("num_generations", divs[-1]))
    if eval_batch is not None:
        Ge = eval_generations or G
        if (eval_batch * n) % Ge:
            reasons.append(f"eval batch {eval_batch} x {n} processes is not divisible by num_generations {Ge}")
            step = Ge // math.gcd(n, Ge)
            fixes.append(set_key("per_device_eval_batch_size", math.ceil(eval_batch / step) * step))
    return {"reasons": reasons, "fixes": fixes, "steps_per_generation": spg, "generation_batch_size": gbs}


def check_batch(d: Draft, p: Placement) -> dict:
    """The plan's batch section; TRL's rules broken become reasons and fixes."""
    rc, trl = d.run_config, d.trl
    B = int(rc.get("per_device_train_batch_size"))
    ga = int(rc.get("gradient_accumulation_steps"))
    G = int(rc.get("num_generations"))
    gbs_user = trl.get("generation_batch_size")
    spg_user = trl.get("steps_per_generation")
    if gbs_user is not None and spg_user is not None:
        raise ConfigError(["generation_batch_size and steps_per_generation are both set; keep one"], rc.source)
    eval_active = bool(rc.get("do_eval")) and eval_strategy(trl) != "no" and not eval_dropped(trl)
    n = p.num_processes
    rule = batch_rules(B, ga, G, n, gbs_user, spg_user,
                       eval_batch=int(rc.get("per_device_eval_batch_size") or 8) if eval_active else None,
                       eval_generations=int(trl.get("num_generations_eval") or G))
    spg, gbs = rule["steps_per_generation"], rule["generation_batch_size"]
    if gbs > MAX_GENERATION_BATCH:
        keys = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                "generation_batch_size")
        set_ = ", ".join(f"{k} {rc.get(k)}" for k in keys if trl.get(k) is not None)
        raise ConfigError([f"{set_}: {gbs:,} completions per generation on {n} trainer process(es), more than "
                           f"{MAX_GENERATION_BATCH:,}; GRPO recipes generate a few thousand (e.g. "
                           "per_device_train_batch_size 16 x 8 processes x 4 steps)"], rc.source)
    d.reasons += rule["reasons"]
    d.fixes += rule["fixes"]
    return {"per_device_train_batch_size": B, "gradient_accumulation_steps": ga, "num_generations": G,
            "steps_per_generation": spg, "generation_batch_size": gbs, "prompts_per_generation": gbs // G if G else 0,
            "num_processes": n, "prompt_length": p.prompt_len, "completion_length": p.completion_len,
            "max_model_len": p.max_model_len}
