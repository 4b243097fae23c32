"""The preemption policy, the planner's last step: how long before the time limit the job is warned
(`--signal`), and how often it checkpoints (`save_steps`), from how long the cluster gives a job between
SIGTERM and SIGKILL and how long a step and a checkpoint take.

Two different warnings reach a job:
- the time-limit warning (`#SBATCH --signal=B:USR2@delay`): the trainer finishes its step, saves and exits,
  and the supervisor stops the server and requeues. `delay` must cover one step, one save and the supervisor's
  own stop; Slurm sends the warning up to 30 s early, never late (ogrpo.launch.slurm.sbatch.MIN_SIGNAL_DELAY_S).
- SIGTERM, on `scontrol requeue`, a preemption or a node drain: SIGKILL follows after the cluster's KillWait
  (`scontrol show config`) — after the partition's GraceTime plus KillWait for a preemption on a cluster that
  preempts. When that window is shorter than a step plus a save, the running step is lost whatever the trainer
  does, so the plan checkpoints every step: a requeue then loses at most the step that was running.

Step time, in this order: `ogrpo.step_time_s`; the median step of an earlier attempt of the same run directory
(`run/profile.jsonl`, written by the trainer's profiler); else a default meant to be on the long side
(DEFAULT_STEP_S). Checkpoint time is a rough figure from the model size (CHECKPOINT_BYTES_PER_PARAM at
WRITE_GBPS, plus SAVE_FIXED_S).

Pure: the cluster's window and a recorded step time are read by the command before planning
(ogrpo/launch/slurm/grace.py `gather`) and handed in as one `PreemptionFacts`; a plan made without them (a plan
that runs on this machine, a fix being re-planned) has no policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ogrpo.planner.draft import Draft
from ogrpo.planner.types import Change, Grace, Preemption

# Unknown step time: long enough for a GRPO step of a <= 7B model with a server on one GPU node (10-60 s), and
# for the CPU recipes (0.5-3 s a step on two cores) with room for a loaded machine.
DEFAULT_STEP_S = {"gpu": 45.0, "cpu": 10.0}
# A step can run longer than the typical one (longer completions, a slow reward): the lead time allows for it.
STEP_MARGIN = 1.25
# Full checkpoint: weights (fp32 at most, 4 B) + Adam's two moments (8 B) + DeepSpeed's fp32 master copy (4 B).
CHECKPOINT_BYTES_PER_PARAM = 16
# Shared-filesystem write rate one node gets, GB/s: on the low side of what Lustre/GPFS/NFS give a job.
WRITE_GBPS = 1.0
# fsync, renames, RNG/scheduler/trainer state, the ranks' barriers (make_checkpoints_atomic, the trainer's preemption)
SAVE_FIXED_S = 2.0
# After the trainer's exit on the time-limit warning: stopping the server (the supervisor's 10 s grace before
# SIGKILL) and `scontrol requeue`.
SUPERVISOR_S = 20
DEFAULT_SIGNAL_DELAY_S = 90


@dataclass(frozen=True)
class PreemptionFacts:
    """What the policy needs from outside the recipe, gathered by the command before planning."""

    grace: Grace | None = None  # None: no Slurm here, or it did not answer
    unread: str | None = None  # why an installed Slurm gave no Grace (the plan then says what it assumed)
    recorded_step: tuple[float, str] | None = None  # (seconds, where from): an earlier attempt's median step
    signal_delay_s: int | None = None  # the user's --signal-delay (None: chosen by the policy)


def step_estimate(kind: str, step_time_s: float | None = None, recorded: tuple[float, str] | None = None
                  ) -> tuple[float, str]:
    """(seconds per optimizer step, where the figure comes from) for a plan of device kind `kind`."""
    if step_time_s:
        return float(step_time_s), "ogrpo.step_time_s"
    if recorded:
        return recorded
    return DEFAULT_STEP_S[kind], f"default for {kind.upper()} plans (set ogrpo.step_time_s)"


def save_estimate_s(params) -> float:
    """Rough seconds to write one checkpoint of a model of `params` parameters."""
    return round(SAVE_FIXED_S + float(params or 0) * CHECKPOINT_BYTES_PER_PARAM / (WRITE_GBPS * 1e9), 1)


def lead_time_s(step_s: float, save_s: float) -> int:
    """Seconds before the time limit the warning must come: one step and a save, then the supervisor's stop."""
    return math.ceil(step_s * STEP_MARGIN + save_s + SUPERVISOR_S)


def unread_warning(reason: str, trl: dict, step: tuple[float, str], save_s: float) -> str | None:
    """What a plan made without the cluster's KillWait assumed, when it matters: the recipe's save_steps is kept
    (as if SIGTERM left time to finish and save the running step), so a requeue may lose up to that many steps."""
    strategy = str(trl.get("save_strategy") or "steps")
    current = trl.get("save_steps")
    if strategy == "steps" and current == 1:
        return None
    need = step[0] * STEP_MARGIN + save_s
    kept = f"save_steps stays {current}" if strategy == "steps" else f"save_strategy stays {strategy!r}"
    return (f"KillWait could not be read ({reason}): assumed that SIGTERM leaves time to finish and save the running "
            f"step (~{need:.0f} s); {kept}, so a requeue or preemption may lose every step since the last "
            "checkpoint where KillWait is shorter (plan where `scontrol show config` answers to have it checked, "
            "or set save_steps: 1)")


def policy(trl: dict, *, grace: Grace | None, step: tuple[float, str], save_s: float, signal_delay_s: int | None
           ) -> tuple[Preemption, list[str], list[Change]]:
    """The preemption policy for the recipe's TRL args, with the warnings and changes it adds to the plan.
    `signal_delay_s`: the user's --signal-delay (None: chosen here, at least DEFAULT_SIGNAL_DELAY_S)."""
    step_s, source = step
    lead = lead_time_s(step_s, save_s)
    need = step_s * STEP_MARGIN + save_s
    delay = int(signal_delay_s) if signal_delay_s is not None else max(DEFAULT_SIGNAL_DELAY_S, lead)
    pol = Preemption(step_s=step_s, step_source=source, save_s=save_s, need_s=need, signal_delay_s=delay,
                     grace=grace)
    warnings: list[str] = []
    if signal_delay_s is not None and signal_delay_s < lead:
        warnings.append(
            f"--signal-delay {signal_delay_s} s is shorter than one step + checkpoint + server stop (~{lead} s: "
            f"step {step_s:g} s from {source}, save ~{save_s:g} s): the trainer may be killed at the time limit "
            "before its checkpoint; leave --signal-delay out to have it chosen")
    if grace is None or grace.window_s >= need:
        return pol, warnings, []
    strategy = str(trl.get("save_strategy") or "steps")
    current = trl.get("save_steps")
    text = (f"{grace.describe()} between SIGTERM and SIGKILL is shorter than one step + checkpoint (~{need:.0f} s: "
            f"step {step_s:g} s from {source}, save ~{save_s:g} s): on a requeue or preemption the running step "
            "cannot be saved")
    if strategy != "steps":
        warnings.append(f"{text}, and save_strategy {strategy!r} saves no step checkpoints: set "
                        "save_strategy: steps, save_steps: 1 to lose at most one step")
        return pol, warnings, []
    if current == 1:
        warnings.append(f"{text}; save_steps is 1, so it loses at most that step")
        return pol, warnings, []
    overhead = save_s / step_s if step_s else 0.0
    cost = f" (checkpoints add ~{overhead:.0%} to each step)" if overhead >= 0.2 else ""
    warnings.append(f"{text}; checkpointing every step so that it loses at most that step{cost}")
    change = Change("save_steps", current, 1, f"{grace.describe()} < one step + checkpoint (~{need:.0f} s): lose at "
                                              "most one step on a requeue")
    return replace(pol, save_steps=1), warnings, [change]


def plan_preemption(d: Draft, facts: PreemptionFacts | None) -> Preemption | None:
    """The plan's policy from the facts the command gathered, its warnings and its save_steps change added to the
    plan's (each once); None without facts."""
    if facts is None:
        return None
    step = step_estimate(d.rules.kind, d.run_config.ogrpo.step_time_s, facts.recorded_step)
    save_s = save_estimate_s(d.model.params)
    pol, warnings, changes = policy(d.trl, grace=facts.grace, step=step, save_s=save_s,
                                    signal_delay_s=facts.signal_delay_s)
    note = unread_warning(facts.unread, d.trl, step, save_s) if facts.unread else None
    for w in warnings + ([note] if note else []):
        if w not in d.warnings:
            d.warnings.append(w)
    for c in changes:
        d.changes.add(c.key, c.old, c.new, c.reason)
    return pol
