"""The run's sandbox policy (`ogrpo.sandbox`): code rewards run model-written programs only under an isolating
level, unless the recipe opts out in so many words.

- `auto` (the default): the strongest level that works on the node ("root", then "userns"); when neither does,
  code rewards refuse to run: exit 2 at plan time where the plan is for this machine (`submit --backend local`),
  else a one-line error when the job starts on a node without one (a login node cannot tell what the compute
  nodes allow: their kernel, container runtime or seccomp profile may differ).
- `none`: the "none" level (rlimits, the slot uid when root, the seccomp filter, Landlock where the kernel has
  it and Python's audit hook; no namespaces): the planner lists it in the plan's changes with a warning
  (ogrpo/planner/sandbox_opt_out.py).
The level chosen is logged once per run and recorded in the run's manifest (`sandbox`). Which option a run has
and whether its rewards run programs is one pure rule, ogrpo/sandbox_option.py, that this module and the
planner share.
"""

from __future__ import annotations

import os
import sys
import threading

from ogrpo.sandbox_option import option_of, runs_programs

_option = "auto"
_summary: dict | None = None
_lock = threading.Lock()
_default = None  # the trainer process's Sandbox
_default_lock = threading.Lock()


def check_here(rc) -> None:
    """Plan time, when the job runs on this machine: raise SandboxUnavailable (exit 2) if nothing isolates."""
    if option_of(rc) == "auto" and runs_programs(rc.trl):
        from ogrpo.sandbox.pool import Sandbox  # lazily: `ogrpo plan` imports this module; the pool costs ~0.1 s

        Sandbox(max_workers=1).close()


def configure(rc) -> dict | None:
    """Job start: set the run's option and, with code rewards, make the sandbox now (fail closed here, before
    any model is loaded, not at the first reward)."""
    global _option
    _option = option_of(rc)
    if not runs_programs(rc.trl):
        return None
    default_sandbox()
    return _summary


def default_sandbox():
    """One pool per trainer process, sized to its CPU affinity, created on the first code reward (or at job
    start by `configure`); refuses (SandboxUnavailable) when nothing isolates under `auto`."""
    global _default
    with _default_lock:
        if _default is None:
            _default = new_sandbox()
        return _default


def new_sandbox():
    """The trainer's pool under the run's option; logs the level once (rank 0) and keeps it for the manifest."""
    global _summary
    from ogrpo.sandbox.pool import Sandbox  # not at the top: see check_here

    box = Sandbox(isolation="none" if _option == "none" else "auto")
    with _lock:
        first = _summary is None
        _summary = box.describe()
    if first and os.environ.get("RANK", "0") == "0":
        print(f"sandbox: {_summary['isolation']} ({_summary['detail']}); memory limit: {_summary['memory']}",
              file=sys.stderr, flush=True)
    return box


def summary() -> dict | None:
    """What the manifest records (None when no code reward made a sandbox)."""
    return dict(_summary) if _summary else None
