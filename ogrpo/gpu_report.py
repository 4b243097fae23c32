"""`make test-gpu`: everything that needs a GPU, in one command, into one report (JSON + table).

    python -m ogrpo.gpu_report [--out DIR] [--timeout S]

On a CUDA machine it runs, each as its own process with a time limit, in this order: every `gpu`-marked test
(pytest -m gpu), `ogrpo selftest --gpu`, and `ogrpo bench kernels` (CPU build) and its CUDA side
(`python -m ogrpo.bench.kernels_cuda`), `bench step`, `bench rollout`; each part's
command, exit code, seconds, outcome and a short summary (test counts, the self-test's checks, the device each
benchmark row was measured on) go to DIR/gpu-report.json and DIR/gpu-report.txt, and the table is printed. So the
first GPU machine that comes along measures everything in minutes.

Without CUDA nothing is run: the report says "no GPU" (with what torch saw) and the command exits 0, so that it
can run anywhere. Exit 1 when a part failed or timed out.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from ogrpo.tables import format_table

# (name, argv after the interpreter, files it writes under the report dir)
PARTS = (
    ("gpu tests", ["-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--junitxml={out}/gpu-tests.xml",
                   "tests"]),
    ("selftest --gpu", ["-m", "ogrpo", "selftest", "--gpu", "--out", "{out}/selftest.json"]),
    ("bench kernels", ["-m", "ogrpo", "bench", "kernels", "--csv", "{out}/kernels.csv"]),
    ("bench kernels cuda", ["-m", "ogrpo.bench.kernels_cuda", "--csv", "{out}/kernels-cuda.csv"]),
    ("bench step", ["-m", "ogrpo", "bench", "step", "--csv", "{out}/step.csv", "--png", "{out}/step.png"]),
    ("bench rollout", ["-m", "ogrpo", "bench", "rollout", "--csv", "{out}/rollout.csv"]),
)


def cuda_facts() -> dict:
    """What torch sees: {"cuda": bool, "devices": [names], "torch": version, "reason": why not}."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - no torch is a finding, not a crash
        return {"cuda": False, "devices": [], "torch": None, "reason": f"torch does not import: {exc}"}
    ok = bool(torch.cuda.is_available())
    facts = {"cuda": ok, "torch": torch.__version__, "cuda_version": torch.version.cuda,
             "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if ok else []}
    if not ok:
        facts["reason"] = ("torch.cuda.is_available() is False (CPU build)" if torch.version.cuda is None
                           else "torch.cuda.is_available() is False (no device or driver)")
    return facts


def junit_summary(path: Path) -> str:
    if not path.is_file():
        return "no junit report"
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return f"{passed} passed, {total['failures'] + total['errors']} failed, {total['skipped']} skipped"


def selftest_summary(path: Path) -> str:
    if not path.is_file():
        return "no self-test report"
    report = json.loads(path.read_text())
    checks = report.get("checks") or {}
    by = {}
    for name, res in checks.items():
        by.setdefault(res.get("status", "?"), []).append(name)
    return "; ".join(f"{status}: {', '.join(sorted(names))}" for status, names in sorted(by.items())) or "no checks"


def bench_summary(path: Path) -> str:
    if not path.is_file():
        return "no CSV written"
    with path.open() as f:
        rows = list(csv.DictReader(f))
    devices = sorted({r.get("device", "?") for r in rows})
    ratios = [f"{r['case']}/{r['path']} {r['metric']} {float(r['value']):.3g}" for r in rows
              if "ratio" in (r.get("metric") or "")][:4]
    return f"{len(rows)} rows on {', '.join(devices) or '?'}" + (f"; {'; '.join(ratios)}" if ratios else "")


SUMMARIES = {"gpu tests": lambda out: junit_summary(out / "gpu-tests.xml"),
             "selftest --gpu": lambda out: selftest_summary(out / "selftest.json"),
             "bench kernels": lambda out: bench_summary(out / "kernels.csv"),
             "bench kernels cuda": lambda out: bench_summary(out / "kernels-cuda.csv"),
             "bench step": lambda out: bench_summary(out / "step.csv"),
             "bench rollout": lambda out: bench_summary(out / "rollout.csv")}


def run_part(name: str, argv: list[str], out: Path, timeout_s: float, summary=None, env=None) -> dict:
    """`summary`: what the part's files say (default: SUMMARIES by name); `env`: the part's environment."""
    cmd = [sys.executable, *[a.format(out=out) for a in argv]]
    log = out / (name.replace(" ", "-").replace("--", "") + ".log")
    start = time.monotonic()
    with log.open("w") as f:
        # its own process group: a part past its limit is stopped with everything it started (servers, workers)
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            rc = proc.wait(timeout=timeout_s)
            outcome = "pass" if rc == 0 else "fail"
        except subprocess.TimeoutExpired:
            rc, outcome = None, "timeout"
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
    seconds = round(time.monotonic() - start, 1)
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
    return {"part": name, "command": " ".join(cmd), "rc": rc, "outcome": outcome, "seconds": seconds,
            "summary": summary() if summary else SUMMARIES.get(name, lambda _out: "")(out), "log": str(log),
            "last_line": tail[0][:300]}


def table(report: dict) -> str:
    lines = [f"O-GRPO GPU report  {report['time']}  host {report['host']}",
             f"CUDA: {'yes' if report['cuda']['cuda'] else 'no'}  devices: "
             f"{', '.join(report['cuda'].get('devices') or []) or '-'}  torch {report['cuda'].get('torch')}"]
    if not report["cuda"]["cuda"]:
        lines.append(f"no GPU: nothing run ({report['cuda'].get('reason')})")
        # a lease run (ogrpo/gpu_lease.py) says what it would have run there, with each part's budget
        lines += [f"would run: {p['part']} ({p['budget_s']:g} s): {p['command']}" for p in report.get("would_run", [])]
        return "\n".join(lines) + "\n"

    rows = [(p["part"], p["outcome"], str(p["rc"]), f"{p['seconds']:.1f}", p["summary"]) for p in report["parts"]]
    lines.append(format_table(["part", "outcome", "rc", "seconds", "summary"], rows, right=(2, 3)))
    lines.append(f"overall: {report['status']}")
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    js, txt = out / "gpu-report.json", out / "gpu-report.txt"
    js.write_text(json.dumps(report, indent=1) + "\n")
    txt.write_text(table(report))
    return js, txt


def build_report(out: Path, timeout_s: float, parts=PARTS, facts: dict | None = None) -> dict:
    facts = cuda_facts() if facts is None else facts
    report = {"ogrpo_gpu_report": 1, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": os.uname().nodename,
              "cuda": facts, "parts": [], "status": "no GPU"}
    if facts["cuda"]:
        out.mkdir(parents=True, exist_ok=True)
        for name, argv in parts:
            report["parts"].append(run_part(name, argv, out, timeout_s))
        report["status"] = "pass" if all(p["outcome"] == "pass" for p in report["parts"]) else "fail"
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ogrpo.gpu_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-report", help="report directory (default: ./gpu-report)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds each part may take (default 1800)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    report = build_report(out, args.timeout)
    js, txt = write(report, out)
    sys.stdout.write(txt.read_text())
    print(f"report: {js} (table: {txt})")
    return 1 if report["status"] == "fail" else 0


if __name__ == "__main__":
    raise SystemExit(main())
