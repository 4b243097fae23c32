"""The run directory's timeline picture (plots/timeline.png): when each device set of the split placement was
busy during the first steps, one lane per set, from the `lanes` the stage profiler wrote into profile.jsonl
(ogrpo/profile/profiler.py). Where the two sets take turns the picture shows the gaps; with `ogrpo.overlap` it
shows them filled.

`lanes(rows)` is what is drawn (kept apart from matplotlib so a test can check the picture's content);
`write(run_dir, rows)` draws it. matplotlib is imported only when drawing.
"""

from __future__ import annotations

from pathlib import Path

FILE = "timeline.png"
# drawing order within a lane: a later stage is drawn over an earlier one (the trainer's training_step holds its
# scoring, rewards and waits)
ORDER = {"train": 0, "score": 1, "train_ahead": 1, "reward": 2, "push": 3, "wait": 4, "generate": 0, "weights": 1}
COLORS = {"generate": "tab:blue", "weights": "tab:purple", "train": "tab:orange", "score": "tab:green",
          "train_ahead": "tab:brown", "reward": "tab:olive", "push": "tab:red", "wait": "#dddddd"}


def lanes(rows: list[dict]) -> dict:
    """{"lanes": {set: [(start s, end s, stage), ...]}, "steps": [(step, start s, end s)]} on one time axis, from
    the rows that carry spans, each step placed where the one before it ended: what lies between two steps
    (logging, a checkpoint, a requeue's restart) is in no step's window; empty lanes when no row carries spans
    (no separate server, or a profile written before the spans were recorded)."""
    drawn = [r for r in rows if isinstance(r.get("lanes"), dict) and "step_span_s" in r]
    out: dict = {"lanes": {}, "steps": []}
    base = 0.0
    for r in drawn:
        out["steps"].append((r["step"], base, base + r["step_span_s"]))
        for lane, spans in r["lanes"].items():
            out["lanes"].setdefault(lane, []).extend((base + a, base + b, stage) for a, b, stage in spans)
        base += r["step_span_s"]
    for lane in out["lanes"]:
        out["lanes"][lane].sort(key=lambda s: (ORDER.get(s[2], 9), s[0]))
    return out


def write(run_dir: Path, rows: list[dict]) -> Path | None:
    """plots/timeline.png for the rows that carry spans; None when none does."""
    data = lanes(rows)
    if not data["lanes"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = sorted(data["lanes"], reverse=True)  # server above trainer
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.8 * len(names)))
    used = set()
    for y, lane in enumerate(names):
        for a, b, stage in data["lanes"][lane]:
            ax.broken_barh([(a, max(b - a, 1e-6))], (y - 0.35, 0.7), facecolors=COLORS.get(stage, "tab:gray"),
                           edgecolor="none")
            used.add(stage)
    for step, a, _ in data["steps"]:
        ax.axvline(a, color="k", lw=0.5, alpha=0.4)
        ax.text(a, len(names) - 0.45, f"step {step}", fontsize=7, va="bottom")
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(-0.6, len(names) - 0.1)
    ax.set_xlim(0, data["steps"][-1][2])
    ax.set_xlabel("seconds of step time (steps end to end)")
    ax.set_title("Device sets busy per step (grey: the trainer waits on the server; blank: idle)")
    ax.legend(handles=[Patch(facecolor=COLORS.get(s, "tab:gray"), edgecolor="k", label=s)
                       for s in sorted(used, key=lambda s: ORDER.get(s, 9))], fontsize=7, ncol=len(used),
              loc="upper right", bbox_to_anchor=(1, -0.25))
    fig.tight_layout()
    out = Path(run_dir) / "plots" / FILE
    out.parent.mkdir(exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
