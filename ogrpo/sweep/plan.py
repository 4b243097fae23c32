"""Plan every point of a sweep with the planner `ogrpo submit` uses, and write each point's job directory.

Every point is planned before anything is written: a sweep runs whole or not at all. A point whose values make
the config invalid stops the sweep with that point named (exit 2); points that do not fit are all listed, one
line each (exit 3), so the user sees at once which corner of the grid is too large.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ogrpo import layout
from ogrpo.errors import OgrpoError
from ogrpo.jobspec import build_jobspec
from ogrpo.load_plan import load_and_plan
from ogrpo.render import render_job, write_job
from ogrpo.sweep import manifest
from ogrpo.sweep.grid import Point


@dataclass
class PlannedPoint:
    point: Point
    rc: object  # ogrpo.config.RunConfig
    plan: object  # ogrpo.planner.types.Plan

    @property
    def index(self) -> int:
        return self.point.index


class PointsDoNotFit(OgrpoError):
    """Some points' plans do not fit: `lines` names each (exit 3, as for one plan that does not fit)."""

    exit_code = 3

    def __init__(self, lines: list[str], total: int):
        self.lines = lines
        super().__init__(f"{len(lines)} of {total} points do not fit: " + "; ".join(lines))


def plan_points(points: list[Point], config: str, gpus, *, model=None, params=None, profile=None, vllm_gpus=None,
                extra: dict | None = None, strict: bool = False, preemption=None) -> list[PlannedPoint]:
    """`preemption`: each point's cluster facts from its run config (load_and_plan's)."""
    planned, misfits = [], []
    for pt in points:
        try:
            rc, p = load_and_plan(config, gpus, model, params, profile, vllm_gpus, extra=extra, strict=strict,
                                  trl=pt.overrides(), preemption=preemption)
        except OgrpoError as exc:
            err = OgrpoError(f"point {pt.index} ({pt.label()}): {exc}")
            err.exit_code = exc.exit_code
            raise err from None
        if not p.fits:
            misfits.append(f"point {pt.index} ({pt.label()}) does not fit: " + "; ".join(p.reasons)
                           + (f"; try: {', '.join(p.fixes)}" if p.fixes else ""))
        planned.append(PlannedPoint(pt, rc, p))
    if misfits:
        raise PointsDoNotFit(misfits, len(points))
    return planned


def write_point(sweep_dir: Path, sweep_id: str, pp: PlannedPoint, slurm=None, local: bool = False):
    """Point `pp`'s job directory, as `ogrpo submit` writes a job's (its job.sbatch runs the point alone);
    returns its JobSpec."""
    job_dir = manifest.point_dir(sweep_dir, pp.index)
    spec = build_jobspec(pp.plan, pp.rc, str(job_dir))
    inputs = {"sweep": sweep_id, "sweep_dir": str(sweep_dir), "point": pp.index, "grid_values": pp.point.values,
              "seed": pp.point.seed}
    files = render_job(pp.plan, pp.rc, spec, inputs=inputs, slurm=slurm)
    write_job(files, job_dir)
    for sub in layout.JOB_SUBDIRS:
        (job_dir / sub).mkdir(parents=True, exist_ok=True)
    if local:  # what the local runner reads (ogrpo.launch.local.load_jobspec), as `ogrpo submit --backend local`
        (job_dir / layout.JOBSPEC).write_text(json.dumps(spec.to_dict(), indent=2) + "\n")
    return spec
