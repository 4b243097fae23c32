"""Wall time of `ogrpo --help`, `ogrpo plan` and `ogrpo render --dry-run` beside `python -c pass` and
`trl --help` (the CLI a user of TRL already waits for; README's latency table compares with it).

    python -m ogrpo.bench.cli_timing [--runs 9] [--limit 0.3] [--csv FILE]

Each command runs as a fresh process (what a user on a login node waits for), the commands interleaved round by
round so that a load that comes and goes reaches every row alike; the median of --runs runs is reported with its
ratio to `python -c pass` and to `trl --help` (when TRL is installed). Exit 1 when a command's median exceeds
--limit seconds.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "slurm" / "examples" / "recipes" / "qwen2.5-1.5b-math.yaml"


def _ogrpo() -> list[str]:
    exe = Path(sys.executable).with_name("ogrpo")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("ogrpo")
    return [found] if found else [sys.executable, "-m", "ogrpo"]


def _trl() -> list[str] | None:
    exe = Path(sys.executable).with_name("trl")
    found = str(exe) if exe.exists() else shutil.which("trl")
    return [found] if found else None


def commands(recipe: Path = RECIPE) -> list[tuple[str, list[str], set[int]]]:
    og = _ogrpo()
    trl = _trl()
    return [
        ("python -c pass", [sys.executable, "-c", "pass"], {0}),
        *([("trl --help", trl + ["--help"], {0})] if trl else []),
        ("ogrpo --help", og + ["--help"], {0}),
        ("ogrpo plan", og + ["plan", "--gpus", "3xA40", "--config", str(recipe)], {0}),
        ("ogrpo plan --json", og + ["plan", "--gpus", "3xA40", "--config", str(recipe), "--json"], {0}),
        ("ogrpo render --dry-run", og + ["render", "--gpus", "3xA40", "--config", str(recipe), "--dry-run"], {0}),
    ]


def time_command(argv: list[str], runs: int, ok_codes: set[int]) -> list[float]:
    env = dict(os.environ, COLUMNS="120")
    out: list[float] = []
    for _ in range(runs):
        t0 = time.perf_counter()
        proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        out.append(time.perf_counter() - t0)
        if proc.returncode not in ok_codes:
            raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.decode()[-500:]}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--limit", type=float, default=0.3, help="seconds a command's median may take")
    ap.add_argument("--csv", type=Path, help="append rows (name, median_s, ratio, runs, host, python) here")
    args = ap.parse_args(argv)

    # One untimed round warms the page cache and .pyc files, as a user's second invocation would be.
    for _, cmd, ok in commands():
        time_command(cmd, 1, ok)
    times: dict[str, list[float]] = {name: [] for name, _, _ in commands()}
    for _ in range(args.runs):
        for name, cmd, ok in commands():
            times[name] += time_command(cmd, 1, ok)
    rows = [(name, statistics.median(ts), min(ts), max(ts)) for name, ts in times.items()]
    base = rows[0][1]
    trl = times.get("trl --help")
    trl_med = statistics.median(trl) if trl else None
    print(f"CLI wall time, median of {args.runs} interleaved runs ({platform.node()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()})")
    print(f"{'command':<26}{'median s':>10}{'min s':>9}{'max s':>9}{'x python':>10}{'x trl':>8}  verdict")
    failed = False
    for name, med, lo, hi in rows:
        baseline = name.startswith("python") or name.startswith("trl")
        verdict = "baseline" if baseline else ("ok" if med <= args.limit else f"OVER {args.limit:.2f} s")
        failed |= verdict.startswith("OVER")
        vs_trl = f"{med / trl_med:>8.2f}" if trl_med else f"{'-':>8}"
        print(f"{name:<26}{med:>10.3f}{lo:>9.3f}{hi:>9.3f}{med / base:>10.2f}{vs_trl}  {verdict}")
    if args.csv:
        new = not args.csv.exists()
        with args.csv.open("a") as fh:
            if new:
                fh.write("name,median_s,ratio,runs,host,python\n")
            for name, med, _, _ in rows:
                fh.write(f"{name},{med:.4f},{med / base:.3f},{args.runs},{platform.node()},"
                         f"{platform.python_version()}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
