"""The sweep directory and its manifest, and finding a sweep again from its directory or its id.

    SWEEP_DIR/
      sweep.json        the manifest: the recipe, the grid and seeds, the options, one entry per point, and
                        (Slurm) the job array's id
      sweep.sbatch      the job array (Slurm): task i runs the supervisor of points/i
      points/<i>/       point i's job directory, as `ogrpo submit` writes one (job.sbatch, run.yaml,
                        manifest.json, accelerate.yaml; run/ once it runs)
      logs/             the summary job's output
      summary.csv, rewards.png   the sweep's summary (ogrpo.sweep.summary)

Point directories are named by the array task index (`$SLURM_ARRAY_TASK_ID`, `%a` in Slurm's file names), so a
task finds its point without reading anything.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ogrpo import atomic_file
from ogrpo.errors import OgrpoError

MANIFEST = "sweep.json"
SBATCH = "sweep.sbatch"
POINTS = "points"
KIND = "ogrpo-sweep"


def point_dir(sweep_dir: str | os.PathLike, index: int) -> Path:
    return Path(sweep_dir) / POINTS / str(int(index))


def manifest_path(sweep_dir: str | os.PathLike) -> Path:
    return Path(sweep_dir) / MANIFEST


def is_sweep_dir(path: str | os.PathLike) -> bool:
    return manifest_path(path).is_file()


def read(sweep_dir: str | os.PathLike) -> dict:
    path = manifest_path(sweep_dir)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise OgrpoError(f"{sweep_dir} is not a sweep directory (no {MANIFEST})") from None
    except ValueError as exc:
        raise OgrpoError(f"{path}: not valid JSON ({exc}); the sweep's manifest is damaged") from None
    if data.get("kind") != KIND:
        raise OgrpoError(f"{path}: not a sweep manifest (kind {data.get('kind')!r})")
    return data


def write(sweep_dir: str | os.PathLike, data: dict) -> None:
    """Atomically: `ogrpo status` may read it while `ogrpo sweep` records the array's id."""
    atomic_file.write_json(manifest_path(sweep_dir), data, default=str)


def update(sweep_dir: str | os.PathLike, **fields) -> dict:
    data = read(sweep_dir)
    data.update(fields)
    write(sweep_dir, data)
    return data


def new_id(name: str) -> str:
    return f"{name}-sweep-{time.strftime('%Y%m%d-%H%M%S')}"


# ----------------------------------------------------------------------------------- the index of sweeps


def _index_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ogrpo" / "sweeps.jsonl"


def remember(sweep_id: str, sweep_dir: str | os.PathLike, array_job_id: str | None = None) -> None:
    path = _index_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps({"id": sweep_id, "dir": str(Path(sweep_dir).resolve()), "array_job_id": array_job_id})
                + "\n")


def find(ref: str | os.PathLike) -> Path | None:
    """The sweep directory `ref` names (the directory itself, the sweep's id, or its job array's id); None when
    it names no sweep (then it is a single job's directory or id)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path.resolve() if is_sweep_dir(path) else None
    index = _index_path()
    if not index.is_file():
        return None
    found = None
    for line in index.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if str(ref) in (rec.get("id"), rec.get("array_job_id")) and is_sweep_dir(rec.get("dir", "")):
            found = Path(rec["dir"])
    return found
