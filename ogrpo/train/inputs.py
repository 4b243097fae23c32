"""The plan-time check of what a run reads: its reward functions and its dataset (columns, splits).

Called by `plan`/`render`/`submit` (ogrpo/load_plan.py) so a typo in a reward name or a
missing column exits 2 before anything is written or queued. Imports nothing heavy: reward names are looked up
in a table, import paths found without executing them, local datasets read only for their schema.
"""

from __future__ import annotations

from pathlib import Path

from ogrpo.errors import ConfigError


def check_inputs(rc) -> list[str]:
    """Check rc's rewards and datasets; returns warnings, raises one ConfigError naming every problem.

    Reward file paths are made absolute in `rc.trl["reward_funcs"]`, so the job finds them from its own
    directory.
    """
    from ogrpo.train.data import prompt_settings
    from ogrpo.train.data_sources import check_data
    from ogrpo.train.rewards import check_rewards, required_columns

    problems: list[str] = []
    warnings: list[str] = []
    base_dirs = [Path.cwd()]
    if Path(str(rc.source)).is_file() and Path(str(rc.source)).resolve().parent != Path.cwd().resolve():
        base_dirs.append(Path(str(rc.source)).resolve().parent)
    weights = rc.ogrpo.reward_weights if rc.ogrpo.reward_weights is not None else rc.trl.get("reward_weights")
    try:
        specs = check_rewards(rc.trl, weights, base_dirs)
        if rc.trl.get("reward_funcs") is None:
            warnings.append(f"reward_funcs not set: using open-r1's default {specs}")
        rc.trl["reward_funcs"] = specs  # written into the job's run.yaml: the trainer runs what was checked
    except ConfigError as exc:
        problems += exc.problems
    column, _, _ = prompt_settings(rc.trl, rc.ogrpo.prompt_column, rc.ogrpo.system_prompt)
    try:
        warnings += check_data(rc.trl, column, required_columns(rc.trl.get("reward_funcs")))
    except ConfigError as exc:
        problems += exc.problems
    if problems:
        raise ConfigError(problems, str(rc.source))
    return warnings
