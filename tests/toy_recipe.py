"""The toy run that CLI-level tests share: O-GRPO's tiny model and task, a few short steps."""

from __future__ import annotations

import yaml


def toy_recipe(steps: int, *, save_steps: int | None = None, **ogrpo) -> str:
    """The recipe's YAML text; `save_steps` None saves nothing; keyword arguments are its `ogrpo:` section."""
    recipe = {"model_name_or_path": "ogrpo:tiny", "dataset_name": "ogrpo:tiny", "reward_funcs": ["tiny_letter"],
              "seed": 7, "learning_rate": 1.0e-3, "num_generations": 4, "per_device_train_batch_size": 8,
              "max_completion_length": 8, "max_steps": steps, "logging_steps": 1,
              **({"save_steps": save_steps} if save_steps else {"save_strategy": "no"}),
              "report_to": "none", "ogrpo": ogrpo}
    return yaml.safe_dump(recipe, sort_keys=False)
