"""Preemption timing at the edge: how long the cluster gives a job between Slurm's SIGTERM and its SIGKILL
(`query`: scontrol's KillWait, the partition's GraceTime), and the step time of an earlier attempt
(`recorded_step_s`), gathered by plan, render, submit and sweep before planning (`gather`): the policy they lead
to (save_steps, the time-limit warning's lead time) is the planner's (ogrpo/planner/preemption.py). The trainer
asks the same window at run time (`query`) and decides on SIGTERM with `leave_now`.

Pure functions, except `query` (runs scontrol), `recorded_step_s` (reads a file) and `gather` (both).
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

from ogrpo.errors import OgrpoError
from ogrpo.launch.slurm.cli import conf_problem, configured, run_slurm, unanswered
from ogrpo.launch.slurm.parse import key_values, seconds
from ogrpo.planner.preemption import SAVE_FIXED_S, PreemptionFacts
from ogrpo.planner.types import Grace

__all__ = ["QUERY_TIMEOUT_S", "SAVE_FIXED_S", "Grace", "gather", "grace_from", "leave_now", "parse_config",
           "parse_partitions", "query", "recorded_step_s", "unread_reason"]

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
# installed): `gather` hands it to the planner, which says it beside the plan, since the plan then keeps the
# recipe's checkpoint frequency.
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


# ---------------------------------------------------------------------------------------------- for the planner


def gather(run_config, *, job_dir: str | None = None, partition: str | None = None,
           signal_delay_s: int | None = None) -> PreemptionFacts:
    """What the planner's preemption policy needs from outside the recipe: the cluster's Grace (`partition`, else
    the run config's; None without an answering Slurm, with the reason when one is installed), the step time an
    earlier attempt in `job_dir` recorded, and the user's --signal-delay."""
    grace = query(partition or run_config.ogrpo.partition)
    return PreemptionFacts(grace=grace, unread=unread_reason() if grace is None else None,
                           recorded_step=recorded_step_s(job_dir), signal_delay_s=signal_delay_s)


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
