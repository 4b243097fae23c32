"""Local paths a recipe names (reward files, datasets), found where `plan` runs and written absolute for the job,
which runs in its job directory."""

from __future__ import annotations

from pathlib import Path

# Why a local dataset path of the recipe is written absolute into the job's run.yaml (a change the plan lists).
ABSOLUTE_REASON = "a local path, made absolute: the job runs in its job directory, not where it was planned"


def local_path(name: str, base_dirs: list[Path], found=Path.exists) -> Path | None:
    """The path a recipe's local file or directory name stands for: as written when absolute (`~` expanded), else
    the first of `base_dirs` (the submit directory, then the config's) where `found` holds; None when nowhere."""
    path = Path(name).expanduser()
    for candidate in [path] if path.is_absolute() else [d / path for d in base_dirs]:
        try:
            if found(candidate):
                return candidate
        except OSError:  # a directory on the way that this user may not search
            continue
    return None
