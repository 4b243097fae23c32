"""open-r1's code rewards (`code`, `binary_code`, `code_format`), executed locally in ogrpo's sandbox.

Semantics follow open-r1's src/open_r1/rewards.py and its evaluation script, so a recipe scores the same here:
- the program is the last ```<language>\\n ... ``` block of the completion (`extract_code`);
- each test case of `verification_info["test_cases"]` ({"input", "output"}) runs the program with `input` on
  stdin; it passes when the program exits 0 and its stdout, stripped, has the expected output's lines, each
  equal once stripped (blank lines around either side do not count);
- `code` is the fraction of test cases passed; `binary_code` is 1.0 above 0.99, else 0.0;
- a timeout ends the evaluation of that completion with 0.0 (open-r1's `subprocess.run(timeout=5)` raises and
  the whole script fails); no code block, a compile error or no test cases also give 0.0.

Differences from open-r1: its script compares the lines over `zip(stdout_lines, expected_lines)`, which stops at the
shorter side, so a program that printed only the first lines of a multi-line answer (a count, a YES before the
construction) scored as if it had solved the problem; here every expected line must be there (a program that solves
it scores as in open-r1). The rest is additive: C and C++ (`language="c"` / `"cpp"`, compiled with the system
gcc/g++ -O2 inside the sandbox, under compile limits, then run per test case) stand in for E2B's other languages;
the language of a sample is `verification_info["language"]` when present, else a `language` dataset column, else the
`language` argument. Every function has TRL's signature `f(completions, **dataset_columns) -> list[float]`;
completions are strings or chat lists (the last message's content is scored).
"""

from __future__ import annotations

import json

from ogrpo.errors import OgrpoError
from ogrpo.rewards.formats import fenced_blocks, is_code_format
from ogrpo.sandbox.policy import default_sandbox
from ogrpo.sandbox.pool import CPU_LIMIT, OK, SANDBOX_ERROR, TIMEOUT, Job, JobResult, Limits, Sandbox

BINARY_THRESHOLD = 0.99  # open-r1's binary_code_reward
_ALIASES = {"python": "python", "python3": "python", "py": "python", "c": "c", "cpp": "cpp", "c++": "cpp",
            "cxx": "cpp"}

def _content(completion) -> str:
    if isinstance(completion, list):
        return str(completion[-1].get("content", "")) if completion and isinstance(completion[-1], dict) else ""
    return str(completion)


def canonical_language(name: str) -> str:
    lang = _ALIASES.get(str(name).strip().lower())
    if lang is None:
        raise OgrpoError(f"code language {name!r} is not supported; use python, c or cpp")
    return lang


def extract_code(completion: str, language: str = "python") -> str:
    """The last ```language fenced block (open-r1's extract_code), or "" when there is none; found by a linear
    scan with the regex's answer (open-r1's findall is quadratic in unclosed fences)."""
    blocks = fenced_blocks(completion, language)
    return blocks[-1] if blocks else ""


def lines_match(stdout: str, expected: str) -> bool:
    """The stripped lines of the stripped stdout against the expected output's, every one of them (open-r1's
    zip stopped at the shorter side: the first lines alone passed)."""
    return ([a.strip() for a in stdout.strip().split("\n")]
            == [b.strip() for b in expected.strip().split("\n")])


def _per_sample(value, n: int) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value] * n


def _info(raw) -> dict:
    if isinstance(raw, str):  # some datasets store verification_info as a JSON string
        try:
            raw = json.loads(raw)
        except ValueError:
            return {}
    return raw if isinstance(raw, dict) else {}


def split_counts(n_tests: list[int], workers: int) -> list[int]:
    """How many jobs each program's test cases are split into: the pool's idle workers shared out, at most one
    job per test case. A batch that fills the pool keeps one job per program, whose cases run in turn and stop
    at the first timeout, so a looping program costs one wall limit of a worker, not one per case; a smaller
    batch spreads its cases over the idle workers, so 4 cases of 4.5 s take ~4.5 s instead of 18 s. Each job
    of a C/C++ program compiles it again: the price of running its cases in parallel, paid only when workers
    would otherwise idle."""
    import heapq

    counts = [1] * len(n_tests)
    # Each idle worker goes to the program with the longest chain of cases per job (ties: the earlier one).
    heap = [(-t, i) for i, t in enumerate(n_tests) if t > 1]
    heapq.heapify(heap)
    for _ in range(max(0, workers - len(n_tests))):
        if not heap:
            break
        _, i = heapq.heappop(heap)
        counts[i] += 1
        if counts[i] < n_tests[i]:
            chain = -(-n_tests[i] // counts[i])  # ceil: the most cases one of its jobs runs in turn
            heapq.heappush(heap, (-chain, i))
    return counts


def _run_programs(sandbox: Sandbox, programs: list[tuple[str, str, list[str]]], limits: Limits | None):
    """Each program's runs over its test inputs, in order, with its cases split over idle workers."""
    counts = split_counts([len(inputs) for _, _, inputs in programs], int(getattr(sandbox, "max_workers", 1)))
    jobs, owner = [], []
    for p, ((code, lang, inputs), k) in enumerate(zip(programs, counts)):
        size, extra = divmod(len(inputs), k)
        start = 0
        for c in range(k):  # contiguous parts, so the runs come back in the test cases' order
            end = start + size + (c < extra)
            jobs.append(Job(code, lang, inputs[start:end], stop_on=(TIMEOUT, CPU_LIMIT)))
            owner.append(p)
            start = end
    merged = [JobResult(None, []) for _ in programs]
    for p, res in zip(owner, sandbox.run_jobs(jobs, limits=limits)):
        out = merged[p]
        if res.compile is not None and (out.compile is None or (out.compile.ok and not res.compile.ok)):
            out.compile = res.compile  # a part that failed to compile decides
        out.runs.extend(res.runs)
    return merged


def code_reward(completions, verification_info=None, *, language="python", num_parallel: int | None = None,
                enforce_same_language: bool = False, sandbox: Sandbox | None = None, limits: Limits | None = None,
                log_metric=None, **kwargs) -> list[float]:
    """Fraction of `verification_info["test_cases"]` each completion's program passes (see module docstring).

    `num_parallel` (open-r1's parallel_code_exec_per_proc, the concurrency of its remote executor) is accepted
    and not used: the local pool is sized to this process's CPU cores, and a completion's test cases run in
    parallel on the workers the batch leaves idle (`split_counts`). `enforce_same_language` raises, as in
    open-r1, when the batch mixes languages.
    """

    n = len(completions)
    if verification_info is None:
        raise OgrpoError("code reward: the dataset has no verification_info column (open-r1's layout: "
                         '{"language": ..., "test_cases": [{"input": ..., "output": ...}]})')
    infos = [_info(v) for v in verification_info]
    if enforce_same_language and len({info.get("language") for info in infos}) > 1:
        raise OgrpoError("code reward: enforce_same_language is set but verification_info mixes languages "
                         f"{sorted({str(info.get('language')) for info in infos})}")
    langs = [_ALIASES.get(str(info.get("language") or lang).strip().lower())
             for info, lang in zip(infos, _per_sample(language, n))]
    programs, index = [], []  # index[i]: completion i's position in programs, or None when it scores 0 unrun
    for completion, info, lang in zip(completions, infos, langs):
        code = extract_code(_content(completion), lang) if lang else ""  # an unsupported language scores 0
        tests = info.get("test_cases") or []
        if not code.strip() or not tests:
            index.append(None)
            continue
        index.append(len(programs))
        programs.append((code, lang, [str(t.get("input", "")) for t in tests]))
    results = _run_programs(sandbox or default_sandbox(), programs, limits) if programs else []

    # A sandbox that cannot start programs would read as a model scoring 0: its rate is logged separately.
    rewards, failures = [], {"compile_error": 0, "timeout": 0, "sandbox_error": 0}
    for info, j in zip(infos, index):
        if j is None:
            rewards.append(0.0)
            continue
        res, tests = results[j], info["test_cases"]
        if any(r.status == SANDBOX_ERROR for r in [res.compile, *res.runs] if r is not None):
            failures["sandbox_error"] += 1
            rewards.append(0.0)
            continue
        if res.compile is not None and not res.compile.ok:
            failures["compile_error"] += 1
            rewards.append(0.0)
            continue
        if any(r.status in (TIMEOUT, CPU_LIMIT) for r in res.runs):
            failures["timeout"] += 1
            rewards.append(0.0)
            continue
        passed = sum(r.status == OK and lines_match(r.stdout, str(t.get("output", "")))
                     for r, t in zip(res.runs, tests))
        rewards.append(passed / len(tests))
    if callable(log_metric) and n:  # TRL passes log_metric: failure rates next to rewards/<name>/mean
        for name, count in failures.items():
            log_metric(f"code/{name}_frac", count / n)
    return rewards


def binary_code_reward(completions, verification_info=None, *, language="python", num_parallel: int | None = None,
                       enforce_same_language: bool = False, **kwargs) -> list[float]:
    """1.0 when the pass rate is above 0.99 (open-r1's BINARY_THRESHOLD), else 0.0."""
    rates = code_reward(completions, verification_info, language=language, num_parallel=num_parallel,
                        enforce_same_language=enforce_same_language, **kwargs)
    return [1.0 if r > BINARY_THRESHOLD else 0.0 for r in rates]


def code_format_reward(completions, *, language="python", **kwargs) -> list[float]:
    """open-r1's get_code_format_reward: `<think>\\n…\\n</think>\\n<answer>\\n…```lang…```…\\n</answer>`, by a
    linear scan with the regex's answer (its backtracking took 63 s on one 8 KiB completion)."""
    langs = _per_sample(language, len(completions))
    return [1.0 if is_code_format(_content(c), str(lang)) else 0.0 for c, lang in zip(completions, langs)]
