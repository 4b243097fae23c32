"""What the plan-time input checks changed in the recipe (ogrpo/trainer/inputs.py: local dataset paths made
absolute, since the job runs in its job directory), recorded in the plan as changes. The checks read files, so
they run before the planner (a plan is a pure function of its inputs) and hand it their decisions as one of them."""

from __future__ import annotations

from collections.abc import Iterable

from ogrpo.planner.draft import Draft
from ogrpo.planner.types import Change


def record_input_changes(d: Draft, changes: Iterable[Change]) -> None:
    for c in changes:
        d.changes.add(c.key, c.old, c.new, c.reason)
