"""The sweep's summary: one row per point (its grid values, seed, state, step, last reward, requeues) from the
points' run directories, written as SWEEP_DIR/summary.csv and a plot of every point's reward curve
(SWEEP_DIR/rewards.png).

Rows come from the files each point's job writes (run/metrics.jsonl, slurm/attempt-N.json), so the summary is
the same whoever writes it: `ogrpo status SWEEP`, the local runner after each point, or the sweep's summary job
once the array has ended (`python -m ogrpo.sweep.summary SWEEP_DIR`). The state column is the caller's (Slurm's
or the local runner's), else the run manifest's.
"""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

from ogrpo import layout
from ogrpo.sweep import manifest
from ogrpo.sweep.grid import format_value

CSV = "summary.csv"
PLOT = "rewards.png"
# the run manifest's status (ogrpo.launch.run_state) in Slurm's words, for a point no scheduler answers for
RUN_STATES = {"running": "RUNNING", "preempted": "REQUEUED", "finished": "COMPLETED", "failed": "FAILED",
              "cancelled": "CANCELLED"}


def _metrics(point_dir: Path) -> list[dict]:
    path = layout.run_dir(point_dir) / layout.METRICS
    rows = []
    try:
        text = path.read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return rows


def reward_curve(point_dir: Path) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r["reward"]) for r in _metrics(point_dir)
           if isinstance(r.get("step"), int) and isinstance(r.get("reward"), (int, float))]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def requeues(point_dir: Path) -> int:
    """Requeues of the point's job: the highest SLURM_RESTART_COUNT an attempt of it started with."""
    counts = [0]
    for path in (Path(point_dir) / layout.SLURM).glob("attempt-*.json"):
        try:
            counts.append(int(json.loads(path.read_text()).get("restart_count") or 0))
        except (OSError, ValueError):
            continue
    return max(counts)


def run_state(point_dir: Path) -> str | None:
    try:
        status = json.loads(layout.run_manifest(point_dir).read_text()).get("status")
    except (OSError, ValueError):
        return None
    return RUN_STATES.get(status)


def row(sweep_dir: Path, entry: dict, state: str | None = None) -> dict:
    pdir = manifest.point_dir(sweep_dir, entry["index"])
    steps = [r["step"] for r in _metrics(pdir) if isinstance(r.get("step"), int) and "loss" in r]
    _, rewards = reward_curve(pdir)
    return {"index": entry["index"], "values": dict(entry.get("values") or {}), "seed": entry.get("seed"),
            "state": state or run_state(pdir) or "PENDING", "step": max(steps) if steps else 0,
            "reward": rewards[-1] if rewards else None, "requeues": requeues(pdir), "run_dir": str(pdir)}


def rows(sweep_dir: Path, data: dict, states: dict[int, str] | None = None) -> list[dict]:
    states = states or {}
    return [row(sweep_dir, entry, states.get(entry["index"])) for entry in data["points"]]


def write_csv(sweep_dir: Path, table: list[dict], keys: list[str]) -> Path:
    path = Path(sweep_dir) / CSV
    tmp = path.with_name(f".{CSV}.{os.getpid()}.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["point", *keys, "seed", "state", "step", "last_reward", "requeues", "run_dir"])
        for r in table:
            w.writerow([r["index"], *(format_value(r["values"].get(k)) for k in keys),
                        "" if r["seed"] is None else r["seed"], r["state"], r["step"],
                        "" if r["reward"] is None else f"{r['reward']:.6g}", r["requeues"], r["run_dir"]])
    os.replace(tmp, path)
    return path


def write_plot(sweep_dir: Path, data: dict) -> Path | None:
    """rewards.png: the reward curve of every point that has logged one; None when none has, or matplotlib is not
    installed (the CSV still is written)."""
    curves = []
    for entry in data["points"]:
        steps, rewards = reward_curve(manifest.point_dir(sweep_dir, entry["index"]))
        if steps:
            label = ", ".join(f"{k}={format_value(v)}" for k, v in (entry.get("values") or {}).items())
            if entry.get("seed") is not None:
                label += f"{', ' if label else ''}seed={entry['seed']}"
            curves.append((f"{entry['index']}: {label}" if label else str(entry["index"]), steps, rewards))
    if not curves:
        return None
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # no display on a login node or in a batch job
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, steps, rewards in curves:
        ax.plot(steps, rewards, marker="o", ms=2, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(f"Reward per point: {data.get('id', Path(sweep_dir).name)}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = Path(sweep_dir) / PLOT
    tmp = path.with_name(f".{PLOT}.{os.getpid()}.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def refresh(sweep_dir: str | os.PathLike, states: dict[int, str] | None = None) -> tuple[list[dict], Path,
                                                                                           Path | None]:
    """Rows, summary.csv and rewards.png of the sweep now."""
    sweep_dir = Path(sweep_dir)
    data = manifest.read(sweep_dir)
    table = rows(sweep_dir, data, states)
    return table, write_csv(sweep_dir, table, list(data.get("grid") or {})), write_plot(sweep_dir, data)


if __name__ == "__main__":  # the sweep's summary job (ogrpo.sweep.slurm), once every task has ended
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m ogrpo.sweep.summary SWEEP_DIR")
    _, csv_path, plot = refresh(sys.argv[1])
    print(f"wrote {csv_path}" + (f" and {plot}" if plot else ""), flush=True)
