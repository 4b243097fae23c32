"""`ogrpo bench overlap`: does `ogrpo.overlap: one-step` learn as well as `off`?

Trains `tiny-math` (ogrpo/recipes/tiny-math.yaml: a warm-started tiny model scored by open-r1's accuracy, format
and length rewards) on the split placement (`--gpus 2xcpu`, each run a real local job: `ogrpo serve` and the
trainer) with `off` and `one-step`, N seeds each, and prints the mean ± std over seeds of the reward at fixed
steps and at fixed wall-clock times (seconds of training, summed from the profiler's step times: server
start-up is not in them). Writes the curves as CSV (one row per mode, seed and step) and a reward-vs-time
plot, and says whether `one-step` is within 2 std of `off` at equal steps (the quality bar of issue 25: the
one-step-old sampler, corrected by importance sampling, must not cost reward per step).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

from ogrpo.bench.harness import environment_tags, save_figure
from ogrpo.bench.jobs import run_split_job
from ogrpo.errors import OgrpoError
from ogrpo.launch.run_state import read_jsonl
from ogrpo.tables import format_table

MODES = ("off", "one-step")
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny-math.yaml"
CSV_COLUMNS = ["mode", "seed", "step", "time_s", "reward"]


def recipe(steps: int, seed: int) -> dict:
    rec = yaml.safe_load(RECIPE.read_text())
    rec.update(max_steps=steps, seed=seed, save_strategy="no")
    return rec


def curve(run: Path) -> list[tuple[int, float, float]]:
    """(step, seconds of training at its end, reward) from a run directory's metrics and profile."""
    rewards = {m["step"]: m["reward"] for m in read_jsonl(run / "metrics.jsonl") if m.get("reward") is not None}
    out, t = [], 0.0
    for row in sorted(read_jsonl(run / "profile.jsonl"), key=lambda r: r["step"]):
        t += row["step_s"]
        if row["step"] in rewards:
            out.append((row["step"], t, rewards[row["step"]]))
    return out


def at_step(points: list[tuple[int, float, float]], step: int) -> float | None:
    return next((r for s, _, r in points if s == step), None)


def at_time(points: list[tuple[int, float, float]], t: float) -> float | None:
    """The reward of the last step finished by `t` seconds (None before the first)."""
    done = [r for _, end, r in points if end <= t + 1e-9]
    return done[-1] if done else None


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (NaN with one value: one seed says nothing about the spread)."""
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else float("nan")


def summarize(curves: dict[str, list[list[tuple[int, float, float]]]], steps: list[int],
              times: list[float]) -> dict:
    """{"steps": {mode: [(mean, std) per step]}, "times": {...}, "within": [bool | None per step]}."""
    out: dict = {"steps": {}, "times": {}}
    for mode, runs in curves.items():
        out["steps"][mode] = [mean_std([v for v in (at_step(c, s) for c in runs) if v is not None]) for s in steps]
        out["times"][mode] = [mean_std([v for v in (at_time(c, t) for c in runs) if v is not None]) for t in times]
    within = []
    for (m_off, sd_off), (m_one, sd_one) in zip(out["steps"]["off"], out["steps"]["one-step"]):
        spread = sd_off if not math.isnan(sd_off) else None
        within.append(None if spread is None else abs(m_one - m_off) <= 2 * spread)
    out["within"] = within
    return out


def _fmt(ms: tuple[float, float]) -> str:
    m, s = ms
    if math.isnan(m):
        return "-"  # no run had logged a reward by then
    return f"{m:.3f}" + ("" if math.isnan(s) else f" ± {s:.3f}")


def run_overlap_bench(*, seeds: int = 3, steps: int = 30, workdir: str | None = None,
                      csv_path: str = "bench/results/overlap.csv", png_path: str = "bench/results/overlap.png",
                      out=None) -> dict:
    out = out or sys.stdout
    if seeds < 1:
        raise OgrpoError(f"--seeds {seeds}: give at least 1")
    if steps < 2:
        raise OgrpoError(f"--steps {steps}: give at least 2")
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="ogrpo-bench-overlap-"))
    work.mkdir(parents=True, exist_ok=True)
    curves: dict[str, list] = {m: [] for m in MODES}
    rows = []
    for seed in range(seeds):
        for mode in MODES:  # alternating modes: load from other jobs falls on both alike
            out.write(f"running {mode}, seed {seed} ...\n")
            out.flush()
            points = curve(run_split_job(work, f"{mode}-seed{seed}", recipe(steps, seed), mode))
            if not points:
                raise OgrpoError(f"{mode}, seed {seed}: the run logged no reward; see {work}")
            curves[mode].append(points)
            rows += [{"mode": mode, "seed": seed, "step": s, "time_s": round(t, 4), "reward": r} for s, t, r in points]
    at_steps = sorted({max(1, round(steps * f)) for f in (0.25, 0.5, 0.75, 1.0)})
    horizon = min(c[-1][1] for runs in curves.values() for c in runs)  # every run has reached it
    at_times = [round(horizon * f, 2) for f in (0.25, 0.5, 0.75, 1.0)]
    summary = summarize(curves, at_steps, at_times)
    tags = environment_tags()
    out.write(f"\nreward of tiny-math on the split placement (2xcpu), {seeds} seed(s) per mode, mean ± std "
              f"({tags['device']}):\n")
    out.write(format_table(["at step", *MODES, "one-step within 2 std of off"],
                           [[str(s), *[_fmt(summary["steps"][m][i]) for m in MODES],
                             {True: "yes", False: "NO", None: "n/a (one seed)"}[summary["within"][i]]]
                            for i, s in enumerate(at_steps)]) + "\n\n")
    out.write(format_table(["at time s", *MODES],
                           [[f"{t:g}", *[_fmt(summary["times"][m][i]) for m in MODES]]
                            for i, t in enumerate(at_times)]) + "\n")
    verdict = [w for w in summary["within"] if w is not None]
    out.write("one-step within 2 std of off at every fixed step: "
              + ("n/a (needs 2+ seeds)" if not verdict else "yes" if all(verdict) else "no") + "\n")
    path = Path(csv_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    out.write(f"csv: {path}\npng: {_plot(curves, summary, at_times, Path(png_path))}\n")
    (work / "summary.json").write_text(json.dumps({"steps": at_steps, "times": at_times, **summary}, indent=1))
    return {"curves": curves, "at_steps": at_steps, "at_times": at_times, **summary}


def _plot(curves: dict, summary: dict, at_times: list[float], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for color, mode in zip(("tab:blue", "tab:orange"), MODES):
        for i, c in enumerate(curves[mode]):
            ax.plot([t for _, t, _ in c], [r for _, _, r in c], color=color, alpha=0.35, lw=1,
                    label=f"{mode} (each seed)" if i == 0 else None)
        means = summary["times"][mode]
        ax.errorbar(at_times, [m for m, _ in means], yerr=[0 if math.isnan(s) else s for _, s in means],
                    color=color, marker="o", capsize=3, lw=2, label=f"{mode}: mean ± std")
    ax.set_xlabel("seconds of training (sum of step times)")
    ax.set_ylabel("reward")
    return save_figure(fig, ax, "tiny-math, split placement (2xcpu): off vs one-step", path)
