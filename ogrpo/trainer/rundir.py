"""The run directory: manifest.json, metrics.jsonl (every TRL log line), plots/*.png.

TRL writes its checkpoints here too (`checkpoint-N/`), and the profiler writes `profile.jsonl`.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from ogrpo.launch.run_state import read_jsonl
from ogrpo.layout import MANIFEST, METRICS, PROFILE  # noqa: F401  (the run dir's file names, one home)
from ogrpo.sandbox import policy as sandbox_policy
from ogrpo import __version__
from ogrpo.profile.profiler import STAGES

PLOTS = "plots"


def _version(dist: str) -> str | None:
    from importlib import metadata

    for name in (dist, f"{dist}-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def git_sha() -> str | None:
    here = Path(__file__).resolve().parent
    for cwd in (here, Path.cwd()):
        try:
            out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    return None


def hardware() -> dict:
    import torch

    hw = {"platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(),
          "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available()}
    try:
        import psutil

        hw["memory_gib"] = round(psutil.virtual_memory().total / 1024**3, 1)
    except ImportError:
        pass
    if torch.cuda.is_available():
        hw["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        hw["cuda_version"] = torch.version.cuda
    return hw


def versions() -> dict:
    out = {"python": platform.python_version(), "ogrpo": __version__}
    for dist in ("torch", "transformers", "trl", "vllm", "accelerate", "datasets"):
        out[dist] = _version(dist)
    return out


def write_manifest(run_dir: Path, *, config: dict, plan: dict, seed, model_path: str, extra: dict | None = None
                   ) -> Path:
    data = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv, "seed": seed,
            "model_path": model_path, "config": config, "plan": plan, "versions": versions(),
            "git_sha": git_sha(), "hardware": hardware(), **(extra or {})}
    if sandbox_policy.summary() is not None:  # the isolation code rewards run under (absent: none ran)
        data["sandbox"] = sandbox_policy.summary()
    path = run_dir / MANIFEST
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def recorded(run_dir: Path, key: str):
    """`key` of the manifest a run directory already holds (an earlier start of the same run), else None."""
    try:
        return json.loads((run_dir / MANIFEST).read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def metrics_callback(run_dir: Path):
    from transformers import TrainerCallback

    path = run_dir / METRICS

    class MetricsCallback(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs:
                return
            row = {"step": state.global_step, **{k: _plain(v) for k, v in logs.items()}}
            with path.open("a") as f:
                f.write(json.dumps(row) + "\n")

    return MetricsCallback()


def _plain(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and v != v:
        return None
    return v


def rewind_logs(run_dir: Path, step: int) -> int:
    """Before resuming from the checkpoint of `step`: take the rows of later steps out of metrics.jsonl and
    profile.jsonl, since the resumed run logs those steps again (a hard kill between checkpoints leaves
    them behind). They move to `<name>.superseded.jsonl` rather than being deleted. Returns how many moved."""
    moved = 0
    for name in (METRICS, PROFILE):
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        keep, later = [], []
        for line in path.read_text().splitlines():
            if line.strip():
                (later if json.loads(line).get("step", 0) > step else keep).append(line)
        if not later:
            continue
        with path.with_suffix(".superseded.jsonl").open("a") as f:
            f.write("\n".join(later) + "\n")
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)  # a kill here leaves the old file whole, never a half-written one
        moved += len(later)
    return moved


def checkpoint_step(checkpoint: str | Path) -> int:
    """The global step a checkpoint was saved at (from trainer_state.json, else its checkpoint-N name)."""
    state = Path(checkpoint) / "trainer_state.json"
    if state.is_file():
        return int(json.loads(state.read_text()).get("global_step", 0))
    return int(Path(checkpoint).name.rsplit("-", 1)[-1])


def reward_series(metrics: list[dict]) -> tuple[list[int], list[float]]:
    pts = [(m["step"], m["reward"]) for m in metrics if m.get("reward") is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def write_plots(run_dir: Path) -> list[Path]:
    """plots/reward.png (reward curve) and plots/profile.png (stage seconds per step + reward)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = run_dir / PLOTS
    out_dir.mkdir(exist_ok=True)
    metrics = read_jsonl(run_dir / METRICS)
    prof = read_jsonl(run_dir / PROFILE)
    steps, rewards = reward_series(metrics)
    written = []

    def reward_axes(ax, **style):
        ax.plot(steps, rewards, marker="o", ms=3, **style)
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward")
        ax.grid(alpha=0.3)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    reward_axes(ax)
    ax.set_title("Reward")
    fig.tight_layout()
    fig.savefig(out_dir / "reward.png", dpi=100)
    plt.close(fig)
    written.append(out_dir / "reward.png")

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    x = [r["step"] for r in prof]
    bottom = [0.0] * len(prof)
    for stage in (*STAGES, "other"):
        vals = [r.get(f"{stage}_s", 0.0) for r in prof]
        ax1.bar(x, vals, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.set_ylabel("seconds")
    ax1.set_title("Time per step by stage")
    ax1.legend(fontsize=8, ncol=5)
    reward_axes(ax2, color="tab:green")
    fig.tight_layout()
    fig.savefig(out_dir / "profile.png", dpi=100)
    plt.close(fig)
    written.append(out_dir / "profile.png")
    return written
