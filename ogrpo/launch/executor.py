"""The one front door to launching (submitit's shape): an `Executor` takes a JobSpec whose files are written and
returns its `Job` (ogrpo.launch.handle); `dry_run` says what `submit` would do without doing it. `find` gets the
handle of any submitted job back from its run directory or Slurm job id.

- `LocalExecutor`: the job runs on this machine, detached (a LocalJob to follow) or in the foreground.
- `SlurmExecutor`: `sbatch job.sbatch` (the file `ogrpo render` writes; rendered by ogrpo.launch.slurm.sbatch for a
  JobSpec built in code), followed through submitit (a SlurmJob).
"""

from __future__ import annotations

import json
import os
import shlex
from abc import ABC, abstractmethod
from pathlib import Path

from ogrpo import layout
from ogrpo.errors import OgrpoError
from ogrpo.launch import local, slurm
from ogrpo.launch.handle import Job
from ogrpo.launch.local import JOBSPEC_FILE, LocalJob, run_local, start_detached
from ogrpo.launch.local import state as local_state
from ogrpo.launch.ports import slurm_ports
from ogrpo.launch.slurm import query as slurm_query
from ogrpo.launch.slurm.query import JobRef, SlurmJob
from ogrpo.launch.slurm.sbatch import SlurmOptions, render_script


class Executor(ABC):
    backend: str

    @abstractmethod
    def dry_run(self, spec, files: dict[str, str]) -> list[str]:
        """What `submit` would run for SPEC with these rendered files, as lines for the user; runs nothing."""

    @abstractmethod
    def submit(self, spec) -> Job:
        """Start the job in `spec.job_dir` (its files written) and return its handle."""


class LocalExecutor(Executor):
    """The job runs here: `detach` in the background (ogrpo status/logs/cancel RUN_DIR), else in the foreground,
    returning once it ended (the handle's `exit_code()` is the run's)."""

    backend = "local"

    def __init__(self, detach: bool = True):
        self.detach = detach

    def dry_run(self, spec, files: dict[str, str]) -> list[str]:
        return [f"would run locally in {spec.job_dir}:", *(f"  {s.role}: {' '.join(s.argv)}" for s in spec.steps)]

    def submit(self, spec) -> Job:
        job_dir = Path(spec.job_dir)
        job_dir.mkdir(parents=True, exist_ok=True)
        (job_dir / JOBSPEC_FILE).write_text(json.dumps(spec.to_dict(), indent=2) + "\n")
        if self.detach:
            return start_detached(job_dir)
        run_local(job_dir)
        return LocalJob(job_dir)


class SlurmExecutor(Executor):
    """`sbatch` with these SlurmOptions (ogrpo.launch.slurm.sbatch), already checked by ogrpo.launch.slurm.preflight."""

    backend = "slurm"

    def __init__(self, opts=None):
        self.opts = opts  # None: the defaults (ogrpo.launch.slurm.sbatch.SlurmOptions) for a JobSpec built in code

    def dry_run(self, spec, files: dict[str, str]) -> list[str]:
        lines = [f"==> {spec.job_dir}/{layout.SBATCH} (submitted with: sbatch {layout.SBATCH}) <==",
                 files[layout.SBATCH].rstrip(),
                 "==> steps (started by the supervisor in the batch step; ports and addresses are picked when the "
                 "job starts) <=="]
        hosts = [f"NODE{i}" for i in range(slurm.job_nodes(spec))]
        opts = self.opts or slurm.SlurmOptions(job_name=spec.name)
        sup = slurm.SlurmSupervisor(spec, max_requeues=opts.max_requeues, signal_delay_s=opts.signal_delay_s)
        cmds = sup.commands(hosts, slurm_ports(0), opts.cpus_per_task or 1, None)
        return lines + [f"{role}: {shlex.join(argv)}" for role, argv in cmds.items()]

    def submit(self, spec) -> Job:
        path = Path(spec.job_dir) / layout.SBATCH
        opts = self.opts or SlurmOptions(job_name=spec.name)
        sub = slurm.submit(spec, script=None if path.exists() else render_script(spec, opts))
        job = SlurmJob(JobRef(sub.job_id, Path(sub.job_dir)))
        job.submitted = sub
        return job


def executor(backend: str, **kwargs) -> Executor:
    if backend == "local":
        return LocalExecutor(**kwargs)
    if backend == "slurm":
        return SlurmExecutor(**kwargs)
    raise OgrpoError(f"backend {backend!r}: use local or slurm")


def submit(spec, backend: str = "local", slurm_options=None) -> Job:
    """Start a JobSpec and return its handle: `local` runs it detached on this machine, `slurm` runs sbatch with
    `slurm_options` (ogrpo.launch.slurm.sbatch.SlurmOptions)."""
    ex = executor(backend, **({"opts": slurm_options} if backend == "slurm" else {}))
    return ex.submit(spec)


def find(ref: str | os.PathLike) -> Job:
    """The handle of a job from its run directory (any backend) or a Slurm job id."""
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (local_state.has_state(path) or (path / layout.SLURM / "job_id").exists()) and path.name == layout.RUN:
            path = path.parent  # the trainer's output dir inside the job dir
        local_mark = local_state.state_path(path)
        slurm_mark = path / layout.SLURM / "job_id"
        if local_mark.exists() and slurm_mark.exists():  # the same directory ran both ways: the latest wins
            return (local.LocalJob(path) if local_mark.stat().st_mtime >= slurm_mark.stat().st_mtime
                    else slurm_query.SlurmJob.from_ref(str(path)))
        if local_mark.exists():
            return local.LocalJob(path)
        if slurm_mark.exists():
            return slurm_query.SlurmJob.from_ref(str(path))
        raise OgrpoError(f"{ref} is not the run directory of a submitted job (it has neither {local_state.STATE_FILE} "
                         "nor slurm/job_id): pass the directory `ogrpo submit` printed as `run dir`")
    return slurm_query.SlurmJob.from_ref(str(ref))
