"""`ogrpo bench rewards`: the reward stage's pathological cases (issue 21), before and after, in one run.

    case                   old (before)                                      new
    code_format 4/8 KiB    open-r1's regex, re.match                         ogrpo's code_format reward
    format 128 KiB         open-r1's regex, re.match                         ogrpo's format reward
    deep \\frac 10,000     math-verify in a worker thread (its alarm off)    accuracy through the worker pool
    4 cases x 4.5 s        one sandbox job running the cases in turn         the code reward (cases split)
    math, 64 completions   math-verify in-process (main thread)              accuracy through the worker pool

The inputs have the shapes that make the regexes backtrack: for code_format every block of text offers another
place for each of its four lazy gaps to end. An old case runs in a child process killed after --old-cap seconds
(printed as "> cap", its ratio as a lower bound), so a hung baseline cannot hang the benchmark. The new path is
timed in this process, warm (math workers started, sandbox probed), as the trainer runs it after step one.
The test-case programs sleep rather than spin, so the case measures scheduling, not this node's core count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

from ogrpo.bench.harness import append_rows, environment_tags, make_row
from ogrpo.errors import OgrpoError
from ogrpo.sandbox.pool import Job, Limits, Sandbox
from ogrpo.tables import format_table

OPEN_R1_FORMAT = r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$"
OPEN_R1_CODE_FORMAT = r"^<think>\n.*?\n</think>\n<answer>\n.*?```python.*?```.*?\n</answer>$"
CASE_SECONDS, CASES = 4.5, 4
# Cases of milliseconds are timed as the median of 3 runs after a warm-up; those of seconds once.
REPEATS = {"math_batch": 3, "math 64 completions": 3, "code_format 4 KiB": 3, "code_format 8 KiB": 3,
           "format 128 KiB": 3}
SLEEPER = f"```python\nimport time\ntime.sleep({CASE_SECONDS})\nprint(input())\n```"


def code_format_text(size: int) -> str:
    unit = "\n</think>\n<answer>\n```python```"
    text = "<think>\n" + unit * ((size - 8) // len(unit))
    return text + "x" * (size - len(text))


def format_text(size: int) -> str:
    unit = "\n</think>\n<answer>\n"
    text = "<think>\n" + unit * ((size - 8) // len(unit))
    return text + "x" * (size - len(text))


def deep_frac(depth: int = 10_000) -> str:
    return "\\boxed{" + "\\frac{1}{" * depth + "2" + "}" * depth + "}"


def math_batch(n: int = 64) -> tuple[list[str], list[str]]:
    texts = [f"The sum is \\boxed{{\\frac{{{i}}}{{{i + 1}}}}}" for i in range(n)]
    return texts, [f"{i}/{i + 1}" if i % 2 else str(i + 1) for i in range(n)]


# --- old paths: run in a child (`python -m ogrpo.bench.rewards --old CASE`) ------------------------------------


def _old_math(texts, golds, thread: bool) -> None:
    """The reward before: math-verify in the calling thread, its signal timeout off outside the main thread."""
    from math_verify import parse, verify

    # heavy: rewards.math (math_verify's worker pool, the sandbox)
    from ogrpo.rewards.math import _configs

    gold_cfg, answer_cfg = _configs()
    timeouts = (None, None) if thread else (10, 5)
    for text, gold in zip(texts, golds):
        g = parse(gold, extraction_config=gold_cfg, extraction_mode="first_match", parsing_timeout=timeouts[0])
        a = parse(text, extraction_config=answer_cfg, extraction_mode="first_match", parsing_timeout=timeouts[0])
        try:
            verify(g, a, timeout_seconds=timeouts[1])
        except Exception:
            pass


def _old_child(case: str) -> None:
    import logging
    import re

    logging.disable(logging.CRITICAL)  # math-verify logs whole completions on a timeout
    if case.startswith("code_format"):
        text, pattern = code_format_text(int(case.split(":")[1])), OPEN_R1_CODE_FORMAT
        run = lambda: re.match(pattern, text, re.DOTALL | re.MULTILINE)  # noqa: E731
    elif case.startswith("format"):
        text, pattern = format_text(int(case.split(":")[1])), OPEN_R1_FORMAT
        run = lambda: re.match(pattern, text, re.DOTALL | re.MULTILINE)  # noqa: E731
    elif case == "deep_frac":
        import math_verify  # noqa: F401 - imported before the clock starts

        _old_math([r"\boxed{1}"], ["1"], thread=False)  # warm-up: sympy's first-use costs
        run = lambda: _in_thread(lambda: _old_math([deep_frac()], ["1/2"], thread=True))  # noqa: E731
    elif case == "math_batch":
        texts, golds = math_batch()
        _old_math(texts, golds, thread=False)
        run = lambda: _old_math(texts, golds, thread=False)  # noqa: E731
    else:
        raise SystemExit(f"unknown case {case}")
    print("start", flush=True)
    print(json.dumps({"seconds": _timed(run, REPEATS.get(case, 1))}), flush=True)


def _in_thread(fn) -> None:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join()


def run_old(case: str, cap_s: float) -> float | None:
    """Seconds the old path took, or None when it was still running after cap_s (the child is killed)."""
    proc = subprocess.Popen([sys.executable, "-m", "ogrpo.bench.rewards", "--old", case], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()  # "start": imports and warm-up done
        if line.strip() != "start":
            raise RuntimeError(f"old {case}: the child failed before timing")
        done: dict = {}
        reader = threading.Thread(target=lambda: done.update(json.loads(proc.stdout.readline() or "{}")),
                                  daemon=True)
        reader.start()
        reader.join(cap_s)
        return done.get("seconds")
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()


# --- new paths (this process) ----------------------------------------------------------------------------------


def _timed(fn, repeats: int = 1) -> float:
    """The median of `repeats` runs (one run for the cases that take seconds)."""
    import statistics

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _new_paths(tmp: str):
    from concurrent.futures import ThreadPoolExecutor

    # heavy: rewards.code (math_verify's worker pool, the sandbox)
    from ogrpo.rewards.code import code_format_reward, code_reward
    from ogrpo.rewards.math import accuracy_reward
    from ogrpo.rewards.text import format_reward

    limits = Limits(cpu_s=10, wall_s=CASE_SECONDS + 5)
    info = {"test_cases": [{"input": f"{i}\n", "output": f"{i}\n"} for i in range(CASES)]}
    box = Sandbox(max_workers=CASES, tmp_root=tmp)

    def cases_old():
        code = SLEEPER.split("\n", 1)[1].rsplit("```", 1)[0]
        res = box.run_jobs([Job(code, "python", [c["input"] for c in info["test_cases"]])], limits=limits)
        assert len(res[0].runs) == CASES and all(r.ok for r in res[0].runs), res

    def cases_new():
        assert code_reward([SLEEPER], [info], sandbox=box, limits=limits) == [1.0]

    def in_thread(fn):
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(fn).result()

    texts, golds = math_batch()
    accuracy_reward(texts, golds)  # starts the math workers (once per trainer) and warms sympy in them
    return box, {
        "code_format 4 KiB": lambda: code_format_reward([code_format_text(4096)]),
        "code_format 8 KiB": lambda: code_format_reward([code_format_text(8192)]),
        "format 128 KiB": lambda: format_reward([format_text(128 * 1024)]),
        "deep \\frac 10,000": lambda: in_thread(lambda: accuracy_reward([deep_frac()], ["1/2"])),
        f"{CASES} cases x {CASE_SECONDS} s": cases_new,
        "math 64 completions": lambda: accuracy_reward(texts, golds),
    }, cases_old


OLD_CHILD = {"code_format 4 KiB": "code_format:4096", "code_format 8 KiB": "code_format:8192",
             "format 128 KiB": "format:131072", "deep \\frac 10,000": "deep_frac", "math 64 completions": "math_batch"}


HEADER = ["case", "old", "new", "old/new"]


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def run_rewards_bench(old_cap_s: float = 150.0, csv_path: str | None = "bench/results/rewards.csv",
                      cases: tuple[str, ...] | None = None) -> list[list[str]]:
    import tempfile

    # heavy: rewards.math (math_verify's worker pool, the sandbox)
    from ogrpo.rewards.math import MATH_TIMEOUT_S

    tags = environment_tags()
    rows, csv_rows = [], []
    with tempfile.TemporaryDirectory(prefix="ogrpo-bench-rewards-") as tmp:
        box, new, cases_old = _new_paths(tmp)
        if cases and not any(c in name for name in new for c in cases):
            box.close()
            raise OgrpoError(f"--cases {','.join(cases)}: no case has these in its name (the cases: "
                             f"{'; '.join(new)})")
        try:
            for name, fn in new.items():
                if cases and not any(c in name for c in cases):
                    continue
                new_s = _timed(fn, REPEATS.get(name, 1))
                old_s = _timed(cases_old) if name.endswith(" s") else run_old(OLD_CHILD[name], old_cap_s)
                old_text = f"> {old_cap_s:.0f} s" if old_s is None else _seconds(old_s)
                ratio = (old_cap_s if old_s is None else old_s) / max(new_s, 1e-9)
                ratio_text = ("> " if old_s is None else "") + (f"{ratio:,.0f}x" if ratio >= 10 else f"{ratio:.2f}x")
                rows.append([name, old_text, _seconds(new_s), ratio_text])
                print(format_table(HEADER, rows[-1:]).splitlines()[-1], flush=True)
                for path, value in (("old", old_s if old_s is not None else old_cap_s), ("new", new_s)):
                    csv_rows.append(make_row("rewards", name, path, "seconds", value, "s",
                                             f"old_capped={old_s is None}", tags))
        finally:
            box.close()
    print()
    print(format_table(HEADER, rows))
    print(f"\n{tags['device']}, {len(os.sched_getaffinity(0))} cores; math hard limit {MATH_TIMEOUT_S:.0f} s per "
          f"completion; old cases capped at {old_cap_s:.0f} s")
    if csv_path:
        print(f"rows appended to {append_rows(csv_path, csv_rows)}")
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--old":
        _old_child(sys.argv[2])
    else:
        run_rewards_bench()
