"""A sweep on this machine: the points run one after another, each through the local launch path of `ogrpo
submit --backend local` (ogrpo.launch.local.run_local: its own ports, key, run directory and local record).

The runner records itself like a local run (SWEEP_DIR/local/state.json), so `ogrpo status SWEEP` can tell a
sweep that is still going from one whose runner died, and `ogrpo cancel SWEEP` finds what to stop: the point
that runs (its record's pid is the runner, whose supervisor stops the steps) and, with it, the runner, which
starts no further point.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from ogrpo import layout
from ogrpo.errors import LaunchError, OgrpoError
from ogrpo.launch.local import LocalJob, run_local
from ogrpo.launch.local import state as ls
from ogrpo.launch.procs import describe
from ogrpo.launch.run_state import record_status
from ogrpo.launch.teardown import exit_on_signals
from ogrpo.sweep import manifest, summary


def point_state(pdir: Path) -> str:
    """RUNNING, COMPLETED, FAILED, CANCELLED, LOST (ogrpo.launch.local.LocalJob), or PENDING before it ran."""
    if not ls.has_state(pdir):
        return "PENDING"

    return LocalJob(pdir).state()


def states(sweep_dir: Path, data: dict) -> dict[int, str]:
    out = {e["index"]: point_state(manifest.point_dir(sweep_dir, e["index"])) for e in data["points"]}
    runner = ls.read_state(sweep_dir)
    if runner and (runner.get("state") != "RUNNING" or not ls.record_alive(runner)):
        # the runner ended: a point it never started will not run
        gone = "CANCELLED" if runner.get("state") == "CANCELLED" else "NOT RUN"
        out = {i: gone if s == "PENDING" else s for i, s in out.items()}
    return out


def run(sweep_dir: Path, out=None) -> int:
    """Run every point in order; 0 when all completed, else the first failing point's code. A point that fails
    does not stop the sweep (its neighbours are independent runs); a cancel or Ctrl-C does."""
    out = out or sys.stdout
    data = manifest.read(sweep_dir)
    record = ls.running_record()
    ls.write_state(sweep_dir, record)
    codes: dict[int, int] = {}
    rc_all = 1
    try:
        with exit_on_signals():
            for entry in data["points"]:
                i = entry["index"]
                print(f"== point {i} of {len(data['points'])}: {entry['label']}", file=out, flush=True)
                rc = codes[i] = run_local(manifest.point_dir(sweep_dir, i), follow=None)
                print(f"== point {i}: {ls.final_state(rc)}" + (f" (exit {rc})" if rc else ""), file=out, flush=True)
                summary.refresh(sweep_dir, states(sweep_dir, data))
                if rc in ls.CANCEL_CODES:  # the run was stopped by a user: so is the sweep
                    break
        rc_all = next((rc for rc in codes.values() if rc != 0), 0)
        return rc_all
    except SystemExit as exc:
        rc_all = exc.code if isinstance(exc.code, int) else 1
        raise
    except KeyboardInterrupt:
        rc_all = 128 + signal.SIGINT
        raise
    finally:
        done = sum(1 for c in codes.values() if c == 0)
        ls.write_state(sweep_dir, ls.ended_record(record, rc_all, f"{done} of {len(data['points'])} points completed"))
        summary.refresh(sweep_dir, states(sweep_dir, data))


def cancel(sweep_dir: Path, data: dict, wait_s: float = 60) -> list[int]:
    """Stop the running point and the runner; return once neither is left (LaunchError naming survivors)."""
    runner = ls.read_state(sweep_dir)
    if not runner or runner.get("state") != "RUNNING" or not ls.record_alive(runner):
        raise OgrpoError(f"sweep {data['id']} is not running here; nothing to cancel")
    if not ls.on_this_host(runner):
        raise OgrpoError(f"sweep {data['id']} runs on {runner.get('host')}: run `ogrpo cancel` there")
    stopped = []
    for entry in data["points"]:
        pdir = manifest.point_dir(sweep_dir, entry["index"])
        if point_state(pdir) == "RUNNING":
            LocalJob(pdir).cancel(wait_s)  # SIGTERM to the runner: its supervisor stops the steps, then it exits
            stopped.append(entry["index"])
    if ls.record_alive(runner):  # between two points
        os.kill(int(runner["pid"]), signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while ls.record_alive(runner) and time.monotonic() < deadline:
        time.sleep(0.2)
    if ls.record_alive(runner):
        raise LaunchError(f"sweep {data['id']}: its runner is still alive after cancel: "
                          f"{describe([int(runner['pid'])])}")
    if (ls.read_state(sweep_dir) or {}).get("state") == "RUNNING":
        ls.write_state(sweep_dir, ls.ended_record(runner, 128 + signal.SIGTERM, "cancelled by ogrpo cancel"))
    for entry in data["points"]:
        record_status(layout.run_dir(manifest.point_dir(sweep_dir, entry["index"])), "cancelled",
                      "cancelled by ogrpo cancel (sweep)")
    return stopped
