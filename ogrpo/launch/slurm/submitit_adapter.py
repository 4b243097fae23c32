"""The one place O-GRPO uses submitit's private Slurm functions: render a batch script around any command (in
submitit's layout, checked against its renderer), and follow any job id.

submitit's `SlurmExecutor` pickles a Python function; O-GRPO's job is a shell command (the supervisor), so this
module writes what the renderer `SlurmExecutor` itself uses writes (`submitit.slurm.slurm._make_sbatch_string`,
with `use_srun=False`: the command runs in the batch step; `check()` holds the two to the same text, and render
does not import submitit) and wraps `submitit.SlurmJob` for state (one batched
`sacct` per poll for every watched job, submitit's `SlurmInfoWatcher`) and cancel. Both are private API, so
`check()` verifies their shape against the installed submitit; `ogrpo doctor` runs it with the patches' checks.

`params` uses sbatch option names (`-` or `_`): those `_make_sbatch_string` takes as arguments go there; the rest
become its `additional_parameters`, which submitit writes verbatim. What submitit would write differently, and why
O-GRPO overrides it (through `additional_parameters`, never by editing the text):
- `signal`: submitit asks for `USR2@delay` for every step; O-GRPO's warning must reach the batch step only
  (`B:USR2@delay`), whose supervisor checkpoints and requeues.
- `output`/`error`: submitit's `JobPaths` name logs `<folder>/%j_0_log.out` for its pickled tasks; O-GRPO's batch
  step writes `logs/slurm-%j.out` under the run directory (ogrpo.layout.slurm_output), with stderr merged unless
  `error` is given.
- `wckey`, `time`, `nodes`: submitit defaults them (`submitit`, 5 minutes, 1); O-GRPO leaves unset what the plan
  does not set, so the site's defaults apply.
"""

from __future__ import annotations

import time
from pathlib import Path

from ogrpo.errors import OgrpoError
from ogrpo.launch.slurm.cli import run_slurm
from ogrpo.patches.target import PatchTargetMoved, problems_of, version

NAME = "submitit_adapter"
LIBRARY = "submitit"
# _make_sbatch_string's arguments this module passes by name
_RENDER_ARGS = ("command", "folder", "job_name", "partition", "time", "nodes", "ntasks_per_node", "cpus_per_task",
                "qos", "setup", "mem", "mem_per_gpu", "mem_per_cpu", "account", "gres", "exclusive", "constraint",
                "exclude", "nodelist", "dependency", "comment", "mail_type", "mail_user", "gpus_per_node",
                "gpus_per_task", "cpus_per_gpu", "wckey", "map_count", "array_parallelism", "stderr_to_stdout",
                "additional_parameters", "use_srun")
# params always written through additional_parameters (see the module docstring for why)
_OVERRIDDEN = ("signal", "output", "error")
# sacct fields the watcher asks for: submitit's JobID,State,NodeList plus what `ogrpo status` shows
SACCT_FIELDS = "JobID,JobName,State,ExitCode,Elapsed,NodeList,WorkDir,Reason"


def _renderer():
    from submitit.slurm import slurm

    return slurm._make_sbatch_string


# _make_sbatch_string's arguments that are not sbatch options
_NONSLURM = ("map_count", "array_parallelism", "additional_parameters", "stderr_to_stdout", "use_srun")


def _arguments(job_name: str, params: dict, array: tuple[int, int] | None) -> tuple[dict, dict]:
    """(keyword arguments of _make_sbatch_string, its additional_parameters) for render_sbatch's inputs."""
    kwargs: dict = {"job_name": job_name, "time": None, "nodes": None, "wckey": None}
    extra: dict = {}
    for key, value in params.items():
        if value is None or value is False:
            continue
        name = key.replace("-", "_")
        if name in _RENDER_ARGS and key not in _OVERRIDDEN and name not in ("command", "folder", "setup",
                                                                             *_NONSLURM):
            kwargs[name] = value
        else:
            extra[key.replace("_", "-")] = value
    kwargs["stderr_to_stdout"] = "error" not in extra
    if array is not None:
        n, parallel = array
        if n < 1 or parallel < 1:
            raise OgrpoError(f"a job array needs at least one task and one running at a time, not {array}")
        kwargs.update(map_count=int(n), array_parallelism=int(parallel))
        # submitit rewrites %j to %A_%a only in its own log paths; ours get the same rule
        extra = {k: (v.replace("%j", "%A_%a") if k in ("output", "error") and isinstance(v, str) else v)
                 for k, v in extra.items()}
    return kwargs, extra


def render_sbatch(command: str, folder: Path | str, *, job_name: str, params: dict,
                  setup: list[str] | None = None, array: tuple[int, int] | None = None) -> str:
    """A batch script whose body runs `command` in the batch step (no srun, no pickle): the `#SBATCH` lines from
    `params` (None/False values are left out, True is a bare flag), then `setup` lines, then the command.
    `array=(n, max_parallel)` makes it a job array `0-{n-1}%{max_parallel}`; each task's `%j` in the log paths
    becomes `%A_%a`.

    The text is what submitit's `_make_sbatch_string(command, folder, setup=..., additional_parameters=...,
    use_srun=False, ...)` writes for these arguments (`submitit_sbatch`; `check()` compares the two on probes),
    written here without importing submitit: its import is ~70 ms of every `ogrpo render`, and render needs none
    of it. submitit is imported where a job is followed or cancelled."""
    import os
    import shlex

    kwargs, extra = _arguments(job_name, params, array)
    # submitit's rendering, step by step: the non-None sbatch arguments, its own signal/log/open-mode defaults,
    # the additional parameters over them, sorted; then setup and the command
    out = {k: v for k, v in kwargs.items() if v is not None and k not in _NONSLURM}
    out["signal"] = "USR2@90"  # submitit's default delay; render's callers always give their own
    base = os.path.join(os.path.abspath(os.path.expanduser(str(folder))), "%j_%t_log")
    stdout, stderr = f"{base}.out", f"{base}.err"
    if kwargs.get("map_count") is not None:
        n = kwargs["map_count"]
        out["array"] = f"0-{n - 1}%{min(n, kwargs['array_parallelism'])}"
        stdout, stderr = stdout.replace("%j", "%A_%a"), stderr.replace("%j", "%A_%a")
    out["output"] = stdout.replace("%t", "0")
    if not kwargs["stderr_to_stdout"]:
        out["error"] = stderr.replace("%t", "0")
    out["open-mode"] = "append"
    out.update(extra)
    lines = ["#!/bin/bash", "", "# Parameters"]
    for key in sorted(out):
        flag, value = key.replace("_", "-"), out[key]
        lines.append(f"#SBATCH --{flag}" if value is True else f"#SBATCH --{flag}={shlex.quote(str(value))}")
    if setup:
        lines += ["", "# setup", *setup]
    lines += ["", "# command", "export SUBMITIT_EXECUTOR=slurm", command, ""]
    return "\n".join(lines)


def submitit_sbatch(command: str, folder: Path | str, *, job_name: str, params: dict,
                    setup: list[str] | None = None, array: tuple[int, int] | None = None) -> str:
    """render_sbatch's script as submitit's own renderer writes it (imports submitit): the reference check()
    holds render_sbatch to."""
    kwargs, extra = _arguments(job_name, params, array)
    return _renderer()(command, str(folder), setup=list(setup) if setup else None, additional_parameters=extra,
                       use_srun=False, **kwargs)


PROBE = {"job-name": "probe", "nodes": 2, "ntasks-per-node": 1, "gres": "gpu:a40:3", "signal": "B:USR2@90",
         "requeue": True, "output": "/j/logs/slurm-%j.out", "time": "01:00:00"}
PROBE_LINES = ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gres=gpu:a40:3",
               "#SBATCH --signal=B:USR2@90", "#SBATCH --requeue", "#SBATCH --output=/j/logs/slurm-%A_%a.out",
               "#SBATCH --time=01:00:00", "#SBATCH --array=0-3%2", "#SBATCH --job-name=probe",
               "#SBATCH --open-mode=append", "echo probe")


# (args, kwargs) of render_sbatch that must give submitit's text exactly: our options, submitit's own log and
# signal defaults, quoting, arrays, stderr apart
_SAME_PROBES = [
    (("echo probe", "/j"), {"job_name": "probe", "params": PROBE, "array": (4, 2)}),
    (("exec python -m x \"$JOB_DIR\"", "/j/k"), {"job_name": "a b", "params": {**PROBE, "mail-type": "END,FAIL",
                                                                                 "exclusive": True, "qos": None},
                                                  "setup": ["# about", "set -euo pipefail"]}),
    (("true", "rel/dir"), {"job_name": "x", "params": {"cpus_per_task": 4, "error": "/j/e-%j", "mem": "8G"},
                           "array": (3, 8)}),
    (("true", "/j"), {"job_name": "x", "params": {}}),
]


def check() -> None:
    """Raise OgrpoError naming what moved when the installed submitit no longer has the private shape used here."""
    problems = problems_of({"submitit.slurm.slurm:_make_sbatch_string": _RENDER_ARGS,
                            "submitit.slurm.slurm:SlurmInfoWatcher._make_command": None,
                            "submitit.slurm.slurm:SlurmInfoWatcher.read_info": ("string",),
                            "submitit.core.core:InfoWatcher.get_info": ("job_id", "mode"),
                            "submitit:SlurmJob": ("folder", "job_id")})
    if not problems:
        try:
            text = submitit_sbatch("echo probe", "/j", job_name="probe", params=PROBE, array=(4, 2))
            same = [(submitit_sbatch(*probe, **kw), render_sbatch(*probe, **kw)) for probe, kw in _SAME_PROBES]
        except Exception as exc:  # noqa: BLE001 - any failure of the private renderer is the finding
            problems.append(f"_make_sbatch_string failed on a probe ({type(exc).__name__}: {exc})")
        else:
            lines = text.splitlines()
            problems += [f"the probe's script lacks `{want}`" for want in PROBE_LINES if want not in lines]
            problems += [f"the probe's script has `{bad}`" for bad in ("srun", "--wckey", "--error")
                         if any(bad in ln for ln in lines)]
            for theirs, ours in same:
                if theirs != ours:
                    diff = next((f"line {i + 1}: submitit {a!r}, render_sbatch {b!r}" for i, (a, b) in
                                 enumerate(zip(theirs.splitlines(), ours.splitlines())) if a != b),
                                f"{len(theirs.splitlines())} lines vs {len(ours.splitlines())}")
                    problems.append(f"render_sbatch no longer writes what _make_sbatch_string writes ({diff})")
                    break
        probe = _watcher_cls()()
        probe.register_job("1")
        cmd = probe._make_command()
        if cmd is None or "-o" not in cmd:
            problems.append(f"SlurmInfoWatcher._make_command no longer asks sacct with -o ({cmd})")
        # the state Watcher.update keeps up to date as submitit's own update does
        problems += [f"SlurmInfoWatcher lost its `{a}` attribute" for a in _WATCHER_STATE if not hasattr(probe, a)]
    if problems:
        raise PatchTargetMoved(f"patch {NAME} cannot apply to {LIBRARY} {version(LIBRARY)}: " + "; ".join(problems)
                               + " (update ogrpo/launch/slurm/submitit_adapter.py)")


_WATCHER_CLS = None
_WATCHER_STATE = ("_num_calls", "_output", "_info_dict", "_last_status_check", "_registered", "_finished")


def _watcher_cls():
    """submitit's SlurmInfoWatcher asking sacct for more fields (its header-driven `read_info` keeps them all),
    built on first use so that importing this module does not import submitit."""
    global _WATCHER_CLS
    if _WATCHER_CLS is None:
        from submitit.slurm.slurm import SlurmInfoWatcher

        class Watcher(SlurmInfoWatcher):
            def update(self) -> None:
                """submitit's update with sacct run through ogrpo.launch.slurm.cli.run_slurm: a cluster that
                cannot answer is one line within seconds (submitit's own call retries for a minute, printing
                sacct's errors). A sacct that fails (a site without accounting) leaves the info as it was, as
                submitit does; the controller then answers for the job (ogrpo.launch.slurm.query)."""
                command = self._make_command()
                if command is None:
                    return
                self._num_calls += 1
                out = run_slurm(command)
                if out.returncode == 0:
                    self._output = out.stdout
                    self._info_dict.update(self.read_info(out.stdout))
                self._last_status_check = time.time()
                self._finished |= {j for j in self._registered - self._finished if self.is_done(j, mode="cache")}

            def _make_command(self):
                cmd = super()._make_command()
                if cmd and "-o" in cmd:
                    cmd[cmd.index("-o") + 1] = SACCT_FIELDS
                return cmd

            def steps(self, job_id: str) -> list[dict]:
                """The job's steps from the last sacct answer (`read_info` keeps jobs only)."""
                out = self._output.decode() if isinstance(self._output, bytes) else self._output
                lines = out.splitlines()
                names = lines[0].split("|") if lines else []
                rows = [dict(zip(names, ln.split("|"))) for ln in lines[1:]]
                return [{"id": r["JobID"], "name": r.get("JobName", ""), "state": r.get("State", "").split(" ")[0],
                         "exit_code": r.get("ExitCode", "")} for r in rows
                        if r.get("JobID", "").startswith(f"{job_id}.")]

        _WATCHER_CLS = Watcher
    return _WATCHER_CLS


_JOB_CLS = None


def _job_cls():
    """submitit.SlurmJob with the watcher above (one per process, shared by every handle: one sacct per poll)."""
    global _JOB_CLS
    if _JOB_CLS is None:
        import submitit

        _JOB_CLS = type("OgrpoSlurmJob", (submitit.SlurmJob,), {"watcher": _watcher_cls()(delay_s=60)})
    return _JOB_CLS


class SubmititJob:
    """A Slurm job followed through submitit: `state`, `info`, `steps`, `cancel`."""

    def __init__(self, folder: Path | str, job_id: str):
        self.job = _job_cls()(folder=Path(folder), job_id=str(job_id))
        self.job_id = str(job_id)

    def info(self, fresh: bool = True) -> dict:
        """sacct's row for the job (JobID, JobName, State, ExitCode, Elapsed, NodeList, WorkDir,
        Reason); {} when the
        accounting database does not have it (yet)."""
        return self.job.watcher.get_info(self.job_id, mode="force" if fresh else "cache")

    def state(self, fresh: bool = True) -> str:
        """Slurm's state word (`CANCELLED by 0` -> CANCELLED); UNKNOWN when sacct has no row."""
        return (self.info(fresh).get("State") or "UNKNOWN").split(" ")[0]

    def steps(self) -> list[dict]:
        return self.job.watcher.steps(self.job_id)

    def cancel(self) -> None:
        """scancel the job (submitit's `Job.cancel`); OgrpoError when scancel refuses."""
        import subprocess

        try:
            self.job.cancel(check=True)
        except (subprocess.CalledProcessError, OSError) as exc:
            raise OgrpoError(f"scancel {self.job_id} failed: {exc}") from None


def job(folder: Path | str, job_id: str) -> SubmititJob:
    """The handle of Slurm job `job_id` whose files are under `folder` (the run directory)."""
    return SubmititJob(folder, job_id)
