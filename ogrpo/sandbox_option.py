"""The recipe's side of the code sandbox: its `ogrpo.sandbox` option and whether its rewards run model-written
programs. Pure, and below both of its readers: the planner, which lists an opt-out as a change
(ogrpo/planner/sandbox_opt_out.py), and the sandbox, which enforces the option at plan time and at job start
(ogrpo/sandbox/policy.py)."""

from __future__ import annotations

RUNS_PROGRAMS = ("code", "binary_code")  # code_format only reads the completion


def runs_programs(trl: dict) -> bool:
    """Whether the recipe's rewards (names as written in reward_funcs) run model-written programs."""
    specs = trl.get("reward_funcs")
    specs = [specs] if isinstance(specs, str) else (specs or [])
    return any(str(s).strip() in RUNS_PROGRAMS for s in specs)


def option_of(rc) -> str:
    """The run's `ogrpo.sandbox`: auto unless the recipe says none."""
    return getattr(rc.ogrpo, "sandbox", None) or "auto"
