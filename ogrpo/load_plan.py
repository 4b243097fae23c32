"""Run config + command-line options -> (RunConfig, Plan), with the plan-time input checks: the one path that
`plan`, `render`, `submit`, `sweep` and `selftest` take. Below the commands, so that a check (selftest) plans as
the CLI does without importing it; imports inside the function, so that `ogrpo --help` stays fast.

The plan is the planner's alone (ogrpo/plan.py): the input checks (which read reward files and datasets) and
the command's cluster facts (scontrol, for the preemption policy) come first and are handed to it; nothing here
adds to the finished plan."""

from __future__ import annotations

from collections.abc import Callable

from ogrpo.errors import ConfigError, OgrpoError


def load_and_plan(config: str, gpus, model, params, profile, vllm_gpus, extra: dict | None = None,
                  strict: bool = False, trl: dict | None = None, preemption: Callable | None = None):
    """Run config + command-line options → (RunConfig, Plan); shared by plan, render, submit and sweep. `strict`:
    every change from the recipe (plan.changes) is an error, all of them reported together. `trl`: keys set over
    the recipe's (flat TRL keys or `ogrpo.KEY`: one point of a sweep). `preemption`: the command's edge, run
    config → PreemptionFacts or None (ogrpo/launch/slurm/grace.py `gather`): it asks the cluster once the run
    config names the partition, and what it found enters the planner."""
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.config import OVERLAPS, STRATEGIES, load_run_config
    from ogrpo.hardware import parse_gpus
    from ogrpo.models import parse_params
    from ogrpo.plan import plan_from_config

    if not config:
        raise OgrpoError("--config is required: a TRL recipe YAML or a built-in recipe name (e.g. --config tiny)")

    # Options given on the command line are reported under their flag names, not as config problems.
    if gpus is not None:
        parse_gpus(gpus)
    if profile is not None and profile not in ("conservative", "balanced", "aggressive"):
        raise OgrpoError(f"--profile {profile!r}: choose one of conservative, balanced, aggressive")
    if vllm_gpus is not None and vllm_gpus < 0:
        raise OgrpoError(f"--vllm-gpus {vllm_gpus}: must be 0 (colocate) or more")
    strategy = (extra or {}).get("strategy")
    if strategy is not None:
        if strategy not in STRATEGIES:
            raise OgrpoError(f"--strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    overlap = (extra or {}).get("overlap")
    if overlap is not None:
        if overlap not in OVERLAPS:
            raise OgrpoError(f"--overlap {overlap!r}: choose one of {', '.join(OVERLAPS)}")
    if params is not None:
        parse_params(params)

    overrides = {**(trl or {}), "ogrpo": {"gpus": gpus, "profile": profile, "vllm_gpus": vllm_gpus, "params": params,
                           "model": model, **(extra or {})}}
    rc = load_run_config(config, overrides)
    # rewards and dataset columns: exit 2 before anything is written
    from ogrpo.trainer.inputs import check_inputs, command_line_changes

    # The checks read files, so they run here, before the planner; what they decide enters it as input (their
    # warnings through rc, the paths they made absolute as changes the planner lists).
    input_changes: list = []
    command_line_changes(rc, input_changes)
    rc.warnings.extend(check_inputs(rc, input_changes))
    plan = plan_from_config(rc, input_changes=input_changes, preemption=preemption(rc) if preemption else None)
    # what the command line itself set over the recipe is listed, not refused: --strict is about changes nobody asked
    # for (as a sweep's grid values are the user's own)
    asked = {f"ogrpo.{key}" for key, _, _ in rc.replaced} | ({"model_name_or_path"} if model is not None else set())
    refused = [c for c in plan.changes if c.key not in asked]
    if strict and refused:
        raise ConfigError([f"{c.key} would change from {c.old!r} to {c.new!r} ({c.reason})"
                           for c in refused], f"{rc.source} (--strict refuses every change from the recipe)")
    return rc, plan
