"""A sweep on Slurm: ONE job array whose task i is point i's whole job.

Each task's batch step `exec`s the same supervisor a single `ogrpo submit` job runs (`python -m
ogrpo.launch.slurm supervise POINT_DIR`), pointed at points/$SLURM_ARRAY_TASK_ID. Slurm gives every array task
its own job id (SLURM_JOB_ID), so each point gets what a single job gets from it: its own port slot, its own
`scontrol requeue` (the supervisor requeues its own id: that task only) and its own restart count; its key and run
directory are the point's. The array's `#SBATCH` request is the single job's (ogrpo.launch.slurm.sbatch.directives)
for the point's plan, the same for every point by construction (one --gpus), with the largest memory any point
needs; `%a` (the task index) puts each task's log in its point's logs/.

The script is rendered by submitit (ogrpo.launch.slurm.submitit_adapter.render_sbatch, `array=(n, max_parallel)`),
and the tasks are followed and cancelled through submitit's SlurmJob (one sacct for the whole array per poll).
The summary (ogrpo.sweep.summary) is refreshed as each task starts, i.e. as earlier points end, and by a small
job after the array (`--dependency=afterany:ARRAY`) once every task has ended.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path

from ogrpo import __version__, layout
from ogrpo.errors import LaunchError, OgrpoError
from ogrpo.launch import ports, procs, secret, stopping
from ogrpo.launch.run_state import record_status
from ogrpo.launch.slurm.cli import run_slurm
from ogrpo.launch.slurm.parse import parsable_job_id
from ogrpo.launch.slurm.query import leftover_processes, remember
from ogrpo.launch.slurm.sbatch import directives, job_python, supervise_command
from ogrpo.launch.slurm.submitit_adapter import job, render_sbatch
from ogrpo.sweep import manifest

# What may differ between the points' single-job requests and still be one array request: memory (the largest
# is asked for every task) and the per-job paths and names the array replaces with its own.
_PER_POINT = ("mem", "chdir", "output", "job-name")


def array_params(specs: list, opts: list) -> dict:
    """The array's sbatch options: the single-job request of every point, which must agree but for memory."""
    first = dict(directives(specs[0], opts[0]))
    mem = []
    for i, (spec, o) in enumerate(zip(specs, opts)):
        d = dict(directives(spec, o))
        for key in set(first) | set(d):
            if key in _PER_POINT:
                continue
            if first.get(key) != d.get(key):
                raise OgrpoError(f"point {i} needs --{key}={d.get(key)} where point 0 needs {first.get(key)}: the "
                                 "tasks of one job array share one request; sweep this key in separate sweeps")
        if d.get("mem"):
            mem.append(d["mem"])
    params = {k: v for k, v in first.items() if k not in _PER_POINT}
    if mem:
        params["mem"] = max(mem, key=lambda m: int(str(m).rstrip("G")) if str(m).rstrip("G").isdigit() else 0)
    return params


_ABOUT = """\
# O-GRPO sweep {sweep_id}: {n} points, at most {parallel} running at once (ogrpo {version}).
# Written by `ogrpo sweep`; `sbatch sweep.sbatch` by hand submits the same array. Task i is point i's whole job
# (points/i: its job.sbatch runs that point alone): the batch step becomes O-GRPO's Slurm supervisor, exactly as
# in a single `ogrpo submit` job, with the task's own job id, ports, key and run directory; a requeue (the time
# limit's warning, a preemption, `scontrol requeue {{array}}_{{i}}`) requeues that task only.
# Points (sweep.json has them all):
{points}
#"""

_BODY = """\
set -euo pipefail
SWEEP_DIR={sweep_dir}
POINT_DIR="$SWEEP_DIR/points/${{SLURM_ARRAY_TASK_ID:?sweep.sbatch is a job array: submit it with sbatch}}"
cd "$POINT_DIR"
# The supervisor and `ogrpo logs POINT_DIR` find a job's log as logs/slurm-<its job id>.out; Slurm names an array
# task's log after the array (%A_%a): the same file under the task's own job id.
ln -sfn "slurm-${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}.out" "logs/slurm-${{SLURM_JOB_ID}}.out"
RENDERED_PYTHON={python}
# A task starts when an earlier one has ended (at most %P run): the summary then holds every point ended so far.
"${{OGRPO_PYTHON:-$RENDERED_PYTHON}}" -m ogrpo.sweep.summary "$SWEEP_DIR" >/dev/null 2>&1 || true
# exec: the supervisor replaces this shell, so the warning signal (B: the batch step only) reaches it."""


def render_array(sweep_dir: Path, sweep_id: str, entries: list[dict], specs: list, opts: list,
                 max_parallel: int) -> str:
    params = array_params(specs, opts)
    params["chdir"] = str(sweep_dir)
    params["output"] = f"{sweep_dir}/{manifest.POINTS}/%a/{layout.LOGS}/slurm-%j.out"  # %j -> %A_%a (array)
    shown = [f"#   {e['index']}: {e['label']}" for e in entries[:20]]
    if len(entries) > 20:
        shown.append(f"#   ... and {len(entries) - 20} more")
    about = _ABOUT.format(sweep_id=sweep_id, n=len(entries), parallel=min(max_parallel, len(entries)),
                          version=__version__, points="\n".join(shown))
    body = _BODY.format(sweep_dir=shlex.quote(str(sweep_dir)), python=shlex.quote(job_python()))
    command = supervise_command("$POINT_DIR", opts[0])
    return render_sbatch(command, sweep_dir, job_name=f"{opts[0].job_name}-sweep", params=params,
                         setup=[*about.splitlines(), "", *body.splitlines()],
                         array=(len(entries), min(max_parallel, len(entries))))


def _sbatch(args: list[str], cwd: Path) -> str:
    # OGRPO_PYTHON: this Python runs the supervisors (sbatch exports it to the tasks), as for `ogrpo submit`
    env = {**os.environ, "OGRPO_PYTHON": sys.executable}
    out = run_slurm(["sbatch", "--parsable", *args], timeout=120, cwd=cwd, env=env)
    if out.returncode != 0:
        last = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
        raise OgrpoError(f"sbatch refused {' '.join(args[-1:])}: {last[-1] if last else out.returncode}")
    job_id = parsable_job_id(out.stdout)
    if job_id is None:
        raise LaunchError(f"sbatch printed no job id: {out.stdout.strip()!r}")
    return job_id


def submit(sweep_dir: Path, opts0) -> dict:
    """sbatch the array (and the summary job after it); records the ids in sweep.json and each point's
    slurm/job_id (`<array>_<i>` until the task starts and writes its own)."""
    data = manifest.read(sweep_dir)
    for entry in data["points"]:  # each point's key before the task exists (its supervisor hands it to the steps)
        secret.ensure(manifest.point_dir(sweep_dir, entry["index"]))
    array = _sbatch([str(sweep_dir / manifest.SBATCH)], sweep_dir)
    for entry in data["points"]:
        pdir = manifest.point_dir(sweep_dir, entry["index"])
        task = f"{array}_{entry['index']}"
        (pdir / layout.SLURM / "job_id").write_text(f"{task}\n")
        remember(task, pdir)
    summary = None
    try:
        summary = _sbatch(summary_job_args(sweep_dir, array, opts0), sweep_dir)
    except OgrpoError as exc:  # the sweep runs without it; `ogrpo status` writes the summary too
        print(f"warning: the summary job was not submitted ({exc}); `ogrpo status {sweep_dir}` writes the "
              "summary", file=sys.stderr)
    data = manifest.update(sweep_dir, slurm={"array_job_id": array, "summary_job_id": summary,
                                             "submitted": time.time()})
    manifest.remember(data["id"], sweep_dir, array)
    return data


def summary_job_args(sweep_dir: Path, array: str, opts0) -> list[str]:
    """A one-CPU job that writes the summary once every task has ended (afterany: also after failures/cancel)."""
    args = [f"--dependency=afterany:{array}", "--kill-on-invalid-dep=yes", f"--job-name={opts0.job_name}-summary",
            "--nodes=1", "--ntasks=1", "--cpus-per-task=1", "--mem=512M", "--time=00:10:00",
            f"--chdir={sweep_dir}", f"--output={sweep_dir}/{layout.LOGS}/summary-%j.out"]
    for key in ("partition", "account", "qos"):
        if getattr(opts0, key):
            args.append(f"--{key}={getattr(opts0, key)}")
    (sweep_dir / layout.LOGS).mkdir(parents=True, exist_ok=True)
    py = shlex.quote(sys.executable)
    return [*args, "--wrap", f"exec {py} -m ogrpo.sweep.summary {shlex.quote(str(sweep_dir))}"]


# ------------------------------------------------------------------------------------------ state, cancel


def task_ids(data: dict) -> dict[int, str]:
    array = (data.get("slurm") or {}).get("array_job_id")
    return {e["index"]: f"{array}_{e['index']}" for e in data["points"]} if array else {}


def states(sweep_dir: Path, data: dict) -> dict[int, str]:
    """Each task's Slurm state, from one sacct call for the whole array (submitit's watcher). A task sacct does
    not know (yet: slurmdbd records a new array with a delay) is left out: the summary then takes the run's own
    record, else PENDING."""
    ids = task_ids(data)
    handles = {i: job(manifest.point_dir(sweep_dir, i), tid) for i, tid in ids.items()}  # all watched at once
    out, fresh = {}, True
    for i, h in handles.items():
        state = h.state(fresh=fresh)
        fresh = False
        if state != "UNKNOWN":
            out[i] = state
    return out


def _queued(array: str) -> list[str]:
    """The array's tasks the controller still has (pending, running, or still being killed)."""
    out = run_slurm(["squeue", "-h", "-r", "-j", array, "-o", "%i %T"], timeout=30)
    if out.returncode != 0:
        return []
    return [ln.split()[0] for ln in out.stdout.splitlines() if ln.split() and ln.split()[-1] not in
            ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
             "BOOT_FAIL", "DEADLINE")]


def cancel(sweep_dir: Path, data: dict, wait_s: float = 120) -> list[int]:
    """scancel every task of the array (and the summary job); return once Slurm has ended them and no process of
    any point is left on this machine (LaunchError naming survivors). Returns the points that were stopped."""
    sl = data.get("slurm") or {}
    array = sl.get("array_job_id")
    if not array:
        raise OgrpoError(f"sweep {data['id']} was not submitted (--dry-run): nothing to cancel")
    live = _queued(array)
    if not live:
        raise OgrpoError(f"sweep {data['id']} (job array {array}) already ended; nothing to cancel")
    for entry in data["points"]:  # before the signals: a trainer then stops at once, not as for a requeue
        stopping.request_cancel(layout.run_dir(manifest.point_dir(sweep_dir, entry["index"])))
    job(sweep_dir, array).cancel()
    if sl.get("summary_job_id"):
        try:
            job(sweep_dir, sl["summary_job_id"]).cancel()
        except OgrpoError:
            pass  # it already ran (or is ending): `ogrpo cancel` writes the summary itself
    deadline = time.monotonic() + wait_s
    while _queued(array):
        if time.monotonic() > deadline:
            raise LaunchError(f"job array {array} is still ending {wait_s:.0f} s after scancel (squeue -r -j {array})")
        time.sleep(0.5)
    stopped = []
    settle = time.monotonic() + 15
    for entry in data["points"]:
        pdir = manifest.point_dir(sweep_dir, entry["index"])
        try:
            own = (pdir / layout.SLURM / "job_id").read_text().strip()
        except OSError:
            continue
        if "_" in own:  # the task never started: nothing of it ran
            continue
        left = leftover_processes(own, pdir)
        while left and time.monotonic() < settle:  # SIGKILLed processes take a moment to be gone
            time.sleep(0.2)
            left = leftover_processes(own, pdir)
        if left:
            raise LaunchError(f"point {entry['index']} (job {own}) ended in Slurm, but processes of it are still "
                              f"alive on this machine: {procs.describe(left)}")
        if record_status(layout.run_dir(pdir), "cancelled", "cancelled by ogrpo cancel (sweep)"):
            stopped.append(entry["index"])
    ports.release_stale()
    manifest.update(sweep_dir, cancelled=time.time())
    return stopped
