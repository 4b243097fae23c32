"""Built-in tiny tasks beside the letters toy (ogrpo/tiny.py): generated here, deterministically, so the real
rewards (math-verify answers, sandboxed code) run end to end on a CPU with no dataset hub.

A recipe names one as `dataset_name: ogrpo:tiny-math` (or `ogrpo:tiny-code`); rows are plain dicts so the planner
reads their columns without importing `datasets`.
"""

from __future__ import annotations

from ogrpo.errors import OgrpoError

TASKS = {"ogrpo:tiny-math": "ogrpo.tasks.tiny_math", "ogrpo:tiny-code": "ogrpo.tasks.tiny_code"}


def _module(name: str):
    import importlib

    key = name.strip().lower()
    if key not in TASKS:
        raise OgrpoError(f"unknown built-in dataset {name!r}; use one of ogrpo:tiny, {', '.join(TASKS)}")
    return importlib.import_module(TASKS[key])


def task_rows(name: str, n: int | None = None) -> list[dict]:
    mod = _module(name)
    return mod.rows() if n is None else mod.rows(n)


def task_dataset(name: str):
    from datasets import Dataset

    return Dataset.from_list(task_rows(name))
