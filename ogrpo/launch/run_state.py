"""What a run directory says about its job, whatever ran it: attempts, requeues, the devices each role saw,
checkpoints, the last metrics line."""

from __future__ import annotations

import json
from pathlib import Path

from ogrpo import layout


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
