"""The plan-time check of what a run reads: its reward functions, its dataset (columns, splits) and its system
prompt (against the prompt budget).

Called by `plan`/`render`/`submit` (ogrpo/load_plan.py) so a typo in a reward name or a
missing column exits 2 before anything is written or queued. Imports nothing heavy: reward names are looked up
in a table, import paths found without executing them, local datasets read only for their schema.
"""

from __future__ import annotations

from pathlib import Path

from ogrpo.errors import ConfigError, OgrpoError
from ogrpo.lengths import min_tokens, prompt_length
from ogrpo.local_paths import ABSOLUTE_REASON
from ogrpo.models import resolve_model
from ogrpo.planner.types import Change
from ogrpo.rewards.registry import check_rewards, required_columns
from ogrpo.trainer.data import prompt_settings
from ogrpo.trainer.data_sources import absolute_sources, check_data


def command_line_changes(rc, changes: list) -> None:
    """What the command line changed from the recipe, appended to `changes` (listed; --strict lets what the command
    line asked for through): an option that replaced the recipe's value, and --model (ogrpo.model) beside the
    recipe's model_name_or_path. The run trains the model its plan is made for: where the recipe's model is known
    here too, --model replaces it; where it is not (a fine-tune on the compute nodes' disk), --model only lends its
    shapes to the plan, and a warning says so."""
    for key, old, new in rc.replaced:
        changes.append(Change(f"ogrpo.{key}", old, new, f"--{key.replace('_', '-')} on the command line"))
    stand_in, trains = rc.ogrpo.model, rc.model_name_or_path
    if not stand_in or not trains or str(stand_in) == str(trains):
        return
    try:
        resolve_model(trains)
    except OgrpoError:
        rc.warnings.append(f"planned with the shapes of {stand_in} (--model / ogrpo.model): model_name_or_path "
                           f"{trains} is not known here; the job trains {trains}")
        return
    changes.append(Change("model_name_or_path", trains, stand_in, "--model / ogrpo.model: the run trains the model "
                                                                  "it is planned for"))
    rc.trl["model_name_or_path"] = stand_in


def check_inputs(rc, changes: list | None = None) -> list[str]:
    """Check rc's rewards, datasets and system prompt; returns warnings, raises one ConfigError naming every
    problem.

    Reward file paths and local dataset paths are made absolute in `rc.trl`, so the job finds them from its own
    directory; each dataset path rewritten is appended to `changes` as a Change, which the caller hands to the
    planner (plan_from_config's `input_changes`): the plan lists them, this module never touches a plan.
    """

    problems: list[str] = []
    warnings: list[str] = []
    base_dirs = [Path.cwd()]
    if Path(str(rc.source)).is_file() and Path(str(rc.source)).resolve().parent != Path.cwd().resolve():
        base_dirs.append(Path(str(rc.source)).resolve().parent)
    column, system, _ = prompt_settings(rc.trl, rc.ogrpo.prompt_column, rc.ogrpo.system_prompt)
    too_long = _system_prompt_problem(rc, system)
    if too_long:  # first and alone: a huge prompt is refused before anything else reads or copies it
        raise ConfigError([too_long], str(rc.source))
    weights = rc.ogrpo.reward_weights if rc.ogrpo.reward_weights is not None else rc.trl.get("reward_weights")
    defaulted = None  # open-r1's default rewards, where the recipe names none: a problem they cause says so
    try:
        specs = check_rewards(rc.trl, weights, base_dirs)
        if rc.trl.get("reward_funcs") is None:
            defaulted = specs
            warnings.append(f"reward_funcs not set: using open-r1's default {specs}")
        rc.trl["reward_funcs"] = specs  # written into the job's run.yaml: the trainer runs what was checked
    except ConfigError as exc:
        problems += exc.problems
    try:
        for key, old, new in absolute_sources(rc.trl, base_dirs):
            if changes is not None:
                changes.append(Change(key, old, new, ABSOLUTE_REASON))
        warnings += check_data(rc.trl, column, required_columns(rc.trl.get("reward_funcs")))
    except ConfigError as exc:
        problems += exc.problems
    if problems:
        if defaulted:
            problems = [f"{p} (reward_funcs is not set: open-r1's default {defaulted})" if "needed by reward" in p
                        else p for p in problems]
        raise ConfigError(problems, str(rc.source))
    return warnings


def _system_prompt_problem(rc, system) -> str | None:
    """The system prompt is part of every prompt (TRL 1.16 truncates none): alone over the prompt budget, no
    prompt fits. Counted with a lower bound (ogrpo/lengths.py), so only a prompt that surely does not fit is
    refused."""
    if not isinstance(system, str) or not system:
        return None

    budget = prompt_length(rc.trl, rc.ogrpo.max_prompt_length)
    n = min_tokens(system, stop=budget)
    if n <= budget:
        return None
    return (f"system prompt: at least {n} tokens ({len(system)} characters, counted without a tokenizer), more than "
            f"the prompt budget of {budget} (max_prompt_length) before any question is added, and TRL does not "
            "truncate prompts; shorten it or raise ogrpo.max_prompt_length")
