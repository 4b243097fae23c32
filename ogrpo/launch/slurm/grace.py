"""Preemption timing: how long a job has between Slurm's SIGTERM and its SIGKILL, how long a step and a checkpoint
take, and what follows for the checkpoint frequency (`save_steps`) and the time-limit warning (`--signal`).

Two different warnings reach a job:
- the time-limit warning (`#SBATCH --signal=B:USR2@delay`): the trainer finishes its step, saves and exits, and
  the supervisor stops the server and requeues. `delay` must cover one step, one save and the supervisor's own
  stop; Slurm sends the warning up to 30 s early, never late (ogrpo.launch.slurm.sbatch.MIN_SIGNAL_DELAY_S).
- SIGTERM, on `scontrol requeue`, a preemption or a node drain: SIGKILL follows after the cluster's KillWait
  (`scontrol show config`) — after the partition's GraceTime plus KillWait for a preemption on a cluster that
  preempts. When that window is shorter than a step plus a save, the running step is lost whatever the trainer
  does, so the plan checkpoints every step: a requeue then loses at most the step that was running.

Step time, in this order: `ogrpo.step_time_s`; the median step of an earlier attempt of the same run directory
(`run/profile.jsonl`, written by the trainer's profiler); else a default meant to be on the long side
(DEFAULT_STEP_S). Checkpoint time is a rough figure from the model size (CHECKPOINT_BYTES_PER_PARAM at
WRITE_GBPS, plus SAVE_FIXED_S).

Pure functions, except `query` (runs scontrol) and `recorded_step_s` (reads a file).
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ogrpo.errors import ConfigError, OgrpoError
from ogrpo.launch.slurm.cli import conf_problem, configured, run_slurm, unanswered
from ogrpo.launch.slurm.parse import key_values, seconds
from ogrpo.planner.device_rules import rules_of
from ogrpo.planner.types import Change

# Unknown step time: long enough for a GRPO step of a <= 7B model with a server on one GPU node (10-60 s), and
# for the CPU recipes (0.5-3 s a step on two cores) with room for a loaded machine.
DEFAULT_STEP_S = {"gpu": 45.0, "cpu": 10.0}
# A step can run longer than the typical one (longer completions, a slow reward): the lead time allows for it.
STEP_MARGIN = 1.25
# Full checkpoint: weights (fp32 at most, 4 B) + Adam's two moments (8 B) + DeepSpeed's fp32 master copy (4 B).
CHECKPOINT_BYTES_PER_PARAM = 16
# Shared-filesystem write rate one node gets, GB/s: on the low side of what Lustre/GPFS/NFS give a job.
WRITE_GBPS = 1.0
# fsync, renames, RNG/scheduler/trainer state, the ranks' barriers (ogrpo.trainer.preemption.make_checkpoints_atomic)
SAVE_FIXED_S = 2.0
# After the trainer's exit on the time-limit warning: stopping the server (the supervisor's 10 s grace before
# SIGKILL) and `scontrol requeue`.
SUPERVISOR_S = 20
DEFAULT_SIGNAL_DELAY_S = 90
QUERY_TIMEOUT_S = 3


# ------------------------------------------------------------------------------------ cluster timing (scontrol)


def _seconds(value: str | None) -> int | None:
    """`5 sec`, `30`, `00:01:00`, `1-00:00:00` → seconds; None for NONE/UNLIMITED/empty (ogrpo.launch.slurm.parse)."""
    return seconds(value)


def parse_config(text: str) -> dict[str, str]:
    """`scontrol show config` (`Key = Value` lines) → {Key: Value}."""
    return key_values(text, lines=True)


def parse_partitions(text: str) -> list[dict[str, str]]:
    """`scontrol show partition -o` (one `Key=Value ...` line per partition) → one dict per partition."""
    return [words for words in map(key_values, text.splitlines()) if "PartitionName" in words]


@dataclass(frozen=True)
class Grace:
    """What the cluster gives a job between SIGTERM and SIGKILL."""

    kill_wait_s: int
    grace_time_s: int = 0  # the partition's preemption grace (GraceTime)
    preempt_type: str = "preempt/none"
    preempt_mode: str = "OFF"  # the partition's, else the cluster's
    partition: str | None = None

    @property
    def preempts(self) -> bool:
        return self.preempt_type != "preempt/none" and self.preempt_mode.upper().split(",")[0] not in ("OFF", "")

    @property
    def window_s(self) -> int:
        """SIGTERM → SIGKILL on the path that requeues this job: a preemption (GraceTime, then the usual
        SIGTERM-KillWait-SIGKILL) where the partition preempts, else `scontrol requeue`/a drain (KillWait)."""
        return self.kill_wait_s + (self.grace_time_s if self.preempts else 0)

    def describe(self) -> str:
        where = f"partition {self.partition}" if self.partition else "this cluster"
        text = f"KillWait {self.kill_wait_s} s"
        if self.preempts:
            text += f" + GraceTime {self.grace_time_s} s of {where} (PreemptMode {self.preempt_mode})"
        return text

    def to_dict(self) -> dict:
        return {**asdict(self), "window_s": self.window_s, "preempts": self.preempts}


def grace_from(config_text: str, partitions_text: str, partition: str | None = None) -> Grace | None:
    """Grace from `scontrol show config` and `scontrol show partition -o` output; `partition` None: the default
    partition. None when KillWait is missing (not scontrol's output)."""
    cfg = parse_config(config_text)
    kill_wait = _seconds(cfg.get("KillWait"))
    if kill_wait is None:
        return None
    parts = parse_partitions(partitions_text)
    part = next((p for p in parts if p["PartitionName"] == partition), None) if partition else \
        next((p for p in parts if p.get("Default") == "YES"), parts[0] if parts else None)
    mode = (part or {}).get("PreemptMode") or cfg.get("PreemptMode") or "OFF"
    return Grace(kill_wait_s=kill_wait, grace_time_s=_seconds((part or {}).get("GraceTime")) or 0,
                 preempt_type=cfg.get("PreemptType") or "preempt/none", preempt_mode=mode,
                 partition=(part or {}).get("PartitionName", partition))


# Why the last `query` of this process read no Grace from an installed Slurm (None: it did, or Slurm is not
# installed): `for_plan` says it beside the plan, since the plan then keeps the recipe's checkpoint frequency.
_unread: str | None = None


def query(partition: str | None = None) -> Grace | None:
    """The cluster's Grace from scontrol; None without Slurm or when the controller does not answer (quickly:
    ogrpo.launch.slurm.cli.run_slurm), with the reason kept for `unread_reason`."""
    global _unread
    _unread = None
    if shutil.which("scontrol") is None:
        return None

    try:
        cfg = run_slurm(["scontrol", "show", "config"], timeout=QUERY_TIMEOUT_S)
        unanswered(cfg)
        if cfg.returncode != 0:
            if configured():  # else Slurm's commands without a cluster (no slurm.conf): nothing was expected
                _unread = (cfg.stderr.strip().splitlines() or [f"`scontrol show config` exited {cfg.returncode}"])[-1]
            return None
        parts = run_slurm(["scontrol", "show", "partition", "-o"], timeout=QUERY_TIMEOUT_S)
    except OgrpoError as exc:
        # SLURM_CONF naming no file says "no cluster here" (slurm/examples/regen.sh and the unit tests render so):
        # nothing was expected to answer; `ogrpo doctor` names it
        _unread = None if conf_problem() else str(exc)
        return None
    found = grace_from(cfg.stdout, parts.stdout if parts.returncode == 0 else "", partition)
    if found is None:
        _unread = "`scontrol show config` printed no KillWait"
    return found


def unread_reason() -> str | None:
    """Why the last `query` found Slurm installed but read no KillWait from it; None otherwise."""
    return _unread


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


# ------------------------------------------------------------------------------------------ step and save time


def recorded_step_s(job_dir: str | Path | None) -> tuple[float, str] | None:
    """Median step time of an earlier attempt in this run directory (the first step, with its warm-up, left out)."""
    if not job_dir:
        return None
    path = Path(job_dir) / "run" / "profile.jsonl"
    try:
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return None
    steps = [float(r["step_s"]) for r in rows if isinstance(r, dict) and r.get("step_s")]
    steps = steps[1:] if len(steps) > 1 else steps
    if not steps:
        return None
    return statistics.median(steps), f"median of {len(steps)} recorded steps in {path}"


def step_estimate(plan, step_time_s: float | None = None, recorded: tuple[float, str] | None = None
                  ) -> tuple[float, str]:
    """(seconds per optimizer step, where the figure comes from)."""
    if step_time_s:
        return float(step_time_s), "ogrpo.step_time_s"
    if recorded:
        return recorded
    kind = rules_of(plan).kind
    return DEFAULT_STEP_S[kind], f"default for {kind.upper()} plans (set ogrpo.step_time_s)"


def save_estimate_s(plan) -> float:
    """Rough seconds to write one checkpoint of the plan's model."""
    params = float(plan.model.params or 0)
    return round(SAVE_FIXED_S + params * CHECKPOINT_BYTES_PER_PARAM / (WRITE_GBPS * 1e9), 1)


# ---------------------------------------------------------------------------------------------------- policy


@dataclass
class Policy:
    """What the job does about preemption: the time-limit warning's lead time, the checkpoint frequency, and why."""

    step_s: float
    step_source: str
    save_s: float
    signal_delay_s: int
    grace: Grace | None = None
    save_steps: int | None = None  # the plan's value when it changes the recipe's, else None
    warnings: list[str] = field(default_factory=list)
    changes: list = field(default_factory=list)  # list[Change] (ogrpo/planner/types.py)

    @property
    def need_s(self) -> float:
        """One step (with margin) and its checkpoint: what a signal must leave the trainer to lose nothing."""
        return self.step_s * STEP_MARGIN + self.save_s

    def to_dict(self) -> dict:
        return {"step_s": self.step_s, "step_source": self.step_source, "save_s": self.save_s,
                "need_s": round(self.need_s, 1), "signal_delay_s": self.signal_delay_s,
                "grace": self.grace.to_dict() if self.grace else None, "save_steps": self.save_steps}


def lead_time_s(step_s: float, save_s: float) -> int:
    """Seconds before the time limit the warning must come: one step and a save, then the supervisor's stop."""
    return math.ceil(step_s * STEP_MARGIN + save_s + SUPERVISOR_S)


def policy(plan, trl: dict, *, grace: Grace | None, step: tuple[float, str], signal_delay_s: int | None
           ) -> Policy:
    """The preemption policy for a Plan and the recipe's TRL args. `signal_delay_s`: the user's
    --signal-delay (None: chosen here, at least DEFAULT_SIGNAL_DELAY_S)."""
    step_s, source = step
    save_s = save_estimate_s(plan)
    lead = lead_time_s(step_s, save_s)
    pol = Policy(step_s=step_s, step_source=source, save_s=save_s, grace=grace,
                 signal_delay_s=int(signal_delay_s) if signal_delay_s is not None else max(DEFAULT_SIGNAL_DELAY_S,
                                                                                          lead))
    if signal_delay_s is not None and signal_delay_s < lead:
        pol.warnings.append(
            f"--signal-delay {signal_delay_s} s is shorter than one step + checkpoint + server stop (~{lead} s: "
            f"step {step_s:g} s from {source}, save ~{save_s:g} s): the trainer may be killed at the time limit "
            "before its checkpoint; leave --signal-delay out to have it chosen")
    if grace is None:
        return pol
    need = pol.need_s
    if grace.window_s >= need:
        return pol
    strategy = str(trl.get("save_strategy") or "steps")
    current = trl.get("save_steps")
    text = (f"{grace.describe()} between SIGTERM and SIGKILL is shorter than one step + checkpoint (~{need:.0f} s: "
            f"step {step_s:g} s from {source}, save ~{save_s:g} s): on a requeue or preemption the running step "
            "cannot be saved")
    if strategy != "steps":
        pol.warnings.append(f"{text}, and save_strategy {strategy!r} saves no step checkpoints: set "
                            "save_strategy: steps, save_steps: 1 to lose at most one step")
        return pol
    if current == 1:
        pol.warnings.append(f"{text}; save_steps is 1, so it loses at most that step")
        return pol
    pol.save_steps = 1
    overhead = save_s / step_s if step_s else 0.0
    cost = f" (checkpoints add ~{overhead:.0%} to each step)" if overhead >= 0.2 else ""
    pol.warnings.append(f"{text}; checkpointing every step so that it loses at most that step{cost}")

    pol.changes.append(Change("save_steps", current, 1, f"{grace.describe()} < one step + checkpoint "
                                                        f"(~{need:.0f} s): lose at most one step on a requeue"))
    return pol


def apply(pol: Policy, run_config, plan) -> None:
    """Put the policy into the run config (save_steps, which run.yaml carries to the trainer) and the plan's
    warnings and changes (shown by plan/render/submit, kept in manifest.json)."""
    if pol.save_steps is not None:
        run_config.trl["save_steps"] = pol.save_steps
    for w in pol.warnings:
        if w not in plan.warnings:
            plan.warnings.append(w)
    for c in pol.changes:
        if plan.change(c.key) is None:
            plan.changes.append(c)


def for_plan(run_config, plan, *, job_dir: str | None = None, partition: str | None = None,
             signal_delay_s: int | None = None, query_cluster: bool = True, strict: bool = False) -> Policy:
    """The edge used by plan, render and submit: ask the cluster (when there is one), read a recorded step time,
    compute the policy and apply it to the run config and plan. `strict` (--strict): a change is an error."""
    p = plan
    grace = query(partition or run_config.ogrpo.partition) if query_cluster else None
    step = step_estimate(p, getattr(run_config.ogrpo, "step_time_s", None), recorded_step_s(job_dir))
    pol = policy(p, run_config.trl, grace=grace, step=step, signal_delay_s=signal_delay_s)
    reason = unread_reason() if query_cluster and grace is None else None
    note = unread_warning(reason, run_config.trl, step, pol.save_s) if reason else None
    if note:
        pol.warnings.append(note)
    if strict and pol.changes:
        raise ConfigError([f"{c.key} would change from {c.old!r} to {c.new!r} ({c.reason})"
                           for c in pol.changes], f"{run_config.source} (--strict refuses every change from the recipe)")
    apply(pol, run_config, plan)
    return pol


# --------------------------------------------------------------------------------------------- in the trainer


def leave_now(*, elapsed_s: float, step_s: float | None, save_s: float, window_s: float | None,
              last_step_saved: bool) -> bool:
    """On SIGTERM: whether the trainer should exit at once instead of finishing the step and saving it.

    Only when waiting cannot put anything on disk that is not there already: the last finished step is
    checkpointed, and the running step cannot finish and be saved before SIGKILL. Saving mid-step is never
    right: the state in memory then is one the uninterrupted run never has (RNG advanced, the optimizer maybe
    half-stepped), and the save's collectives would meet ranks that are inside the step's."""
    if window_s is None or step_s is None or not last_step_saved:
        return False
    remaining = max(0.0, step_s - elapsed_s)
    return remaining + save_s > window_s
