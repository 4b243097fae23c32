"""The recipe's opt-out of the code sandbox (`ogrpo.sandbox: none` with rewards that run model-written programs),
listed in the plan as a change from the default and a warning: the job then runs those programs without
namespaces. Without code rewards the option changes nothing, so nothing is listed."""

from __future__ import annotations

from ogrpo.planner.draft import Draft
from ogrpo.sandbox_option import option_of, runs_programs

REASON = ("the recipe opts out of isolation: model-written programs run without namespaces, as the trainer's user "
          "(or a slot uid when root), contained only by rlimits, seccomp, Landlock where the node's kernel has it "
          "and a Python audit hook")
WARNING = ("ogrpo.sandbox: none: code rewards run model-written programs without isolation; they can read what the "
           "trainer's user can (and write it where the kernel lacks Landlock)")


def note_sandbox_opt_out(d: Draft) -> None:
    if option_of(d.run_config) != "none" or not runs_programs(d.trl):
        return
    d.changes.add("ogrpo.sandbox", "auto", "none", REASON)
    d.warnings.append(WARNING)
