"""What a run directory says about its job, whatever ran it: attempts, requeues, the devices each role saw,
checkpoints, the last metrics line; and the manifest's status, which the trainer, the supervisor and `ogrpo
cancel` all write (the trainer's own run-directory writes are ogrpo.trainer.rundir)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ogrpo import atomic_file, layout
from ogrpo.layout import MANIFEST


def run_dir_state(job_dir: Path | None) -> dict:
    """Attempts, requeues, role device records, checkpoints and the last metrics line from the run dir."""
    if job_dir is None:
        return {}
    out: dict = {"job_dir": str(job_dir)}
    sl = job_dir / "slurm"
    out["attempts"] = len(list(sl.glob("attempt-*.json")))
    requeues = [json.loads(p.read_text()) for p in sorted(sl.glob("requeue-*.json"))]
    out["requeues"] = sum(1 for r in requeues if r.get("requeued"))
    if requeues:
        out["max_requeues"] = requeues[-1].get("max_requeues")
    if (sl / "result.json").exists():
        out["result"] = json.loads((sl / "result.json").read_text())
    run = layout.run_dir(job_dir)
    roles = {}
    # <role>.step.json: written inside each srun step, so it holds the devices Slurm gave that step
    for p in sorted(layout.roles_dir(job_dir).glob("*.step*.json")):
        try:
            rec = json.loads(p.read_text())
        except ValueError:
            continue
        role, task = p.name[: -len(".json")].split(".step")
        roles[role + (f".{task}" if task else "")] = rec.get("cuda_visible_devices")
    out["devices"] = roles
    ckpts = sorted((p for p in run.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()),
                   key=lambda p: int(p.name.split("-")[-1]))
    if ckpts:
        out["last_checkpoint"] = ckpts[-1].name
    if layout.preempted_file(job_dir).exists():
        out["preempted"] = json.loads(layout.preempted_file(job_dir).read_text())
    metrics = run / layout.METRICS
    if metrics.exists():
        lines = metrics.read_text().strip().splitlines()
        if lines:
            try:
                out["last_metrics"] = json.loads(lines[-1])
            except ValueError:
                pass
    return out


# manifest.json's "status": running → finished | preempted (checkpointed on a signal and exited, to be requeued
# or resubmitted) | cancelled | failed (with "error"). A requeued attempt writes running again.
OPEN_STATUSES = ("running", "preempted")


def _write_atomic(path: Path, data: dict) -> None:
    # the trainer, the supervisor and `ogrpo cancel` may all write it as a job ends: never a half-written file
    atomic_file.write_json(path, data, default=str)


def update_manifest(run_dir: Path, **fields) -> None:
    path = run_dir / MANIFEST
    data = json.loads(path.read_text())
    data.update(fields)
    _write_atomic(path, data)


def record_status(run_dir: str | os.PathLike, status: str, reason: str | None = None) -> bool:
    """Record how the run ended, unless it already says so (an ended status is never overwritten: the first
    to know, usually the trainer itself, is the most precise). False when there is no manifest yet."""
    path = Path(run_dir) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if data.get("status") not in OPEN_STATUSES:
        return False
    data["status"] = status
    if reason:
        data["error" if status == "failed" else "stop_reason"] = reason
    data["ended"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    _write_atomic(path, data)
    return True


def read_jsonl(path: Path) -> list[dict]:
    if not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
