"""open-r1's code rewards on hand-written completions with known scores, run in the real sandbox and gcc/g++."""

from __future__ import annotations

import shutil
import time

import pytest

from ogrpo.errors import OgrpoError
from ogrpo.rewards.code import (
    binary_code_reward,
    canonical_language,
    code_format_reward,
    code_reward,
    extract_code,
    lines_match,
)
from ogrpo.sandbox.pool import Limits, Sandbox

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None or shutil.which("gcc") is None,
                               reason="needs the system gcc/g++")

# a + b, two test cases: a program right on one of them scores 0.5.
ADD = {"language": "python", "test_cases": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10"}]}
CORRECT = "Sum them.\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
HALF = "```python\ninput()\nprint(3)\n```"  # right for "1 2" only
WRONG = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"  # 2 and 25
NO_BLOCK = "print(sum(map(int, input().split())))"
SYNTAX = "```python\ndef f(:\n```"
CPP_OK = "```cpp\n#include <iostream>\nint main(){long a,b; std::cin>>a>>b; std::cout<<a+b<<std::endl;}\n```"
C_OK = "```c\n#include <stdio.h>\nint main(void){long a,b; scanf(\"%ld %ld\",&a,&b); printf(\"%ld\\n\",a+b);}\n```"
CPP_BROKEN = "```cpp\nint main( {\n```"


@pytest.fixture(scope="module")
def sb(tmp_path_factory):
    with Sandbox(max_workers=2, tmp_root=str(tmp_path_factory.mktemp("sbx"))) as box:
        yield box


def test_python_scores(sb):
    comps = [CORRECT, HALF, WRONG, NO_BLOCK, SYNTAX]
    assert code_reward(comps, [ADD] * 5, sandbox=sb) == [1.0, 0.5, 0.0, 0.0, 0.0]


def test_chat_completions_and_json_verification_info(sb):
    import json

    chat = [[{"role": "assistant", "content": CORRECT}], [{"role": "assistant", "content": HALF}]]
    assert code_reward(chat, [json.dumps(ADD)] * 2, sandbox=sb) == [1.0, 0.5]


def test_last_code_block_is_the_program(sb):
    # open-r1 takes the last ```python block: a wrong draft followed by the fix scores 1, the reverse 0.
    assert code_reward([WRONG + "\n" + CORRECT, CORRECT + "\n" + WRONG], [ADD] * 2, sandbox=sb) == [1.0, 0.0]


def test_timeout_and_crash_score_zero_without_stopping_the_batch(sb):
    loop = "```python\nwhile True:\n    pass\n```"
    crash = "```python\nraise SystemExit(3)\n```"
    t0 = time.perf_counter()
    out = code_reward([loop, crash, CORRECT], [ADD] * 3, sandbox=sb, limits=Limits(cpu_s=1, wall_s=1.5))
    assert out == [0.0, 0.0, 1.0]
    assert time.perf_counter() - t0 < 2 * 1.5 + 6  # the loop was killed on time (and only its first case ran)


def test_reward_stage_runs_programs_in_parallel(tmp_path):
    # 8 completions whose program waits 1 s: one after another 8 s, through an 8-worker pool about 1 s.
    sleeper = "```python\nimport time\ntime.sleep(1)\nprint(3)\n```"
    one_case = {"test_cases": [{"input": "", "output": "3"}]}
    with Sandbox(max_workers=8, tmp_root=str(tmp_path)) as box:
        t0 = time.perf_counter()
        out = code_reward([sleeper] * 8, [one_case] * 8, sandbox=box)
        elapsed = time.perf_counter() - t0
    assert out == [1.0] * 8
    assert elapsed < 5.0, f"8 x 1 s programs took {elapsed:.1f} s"


def test_line_comparison_wants_every_expected_line():
    assert lines_match("3\n", "3\n") and lines_match("3", "3\n")  # blank lines around either side do not count
    assert lines_match("  1 \n2", "1\n 2 ")     # each line stripped
    assert lines_match("\n1\n2\n\n", "1\n2")
    assert not lines_match("1\n3", "1\n2")
    # open-r1's zip stopped at the shorter side: the first line alone passed a two-line answer
    assert not lines_match("1", "1\n2") and not lines_match("YES", "YES\n1 2 3")
    assert not lines_match("1\n2\n3", "1\n2")  # nor is more than the answer the answer
    assert not lines_match("", "1") and lines_match("", "")


def test_a_program_that_prints_only_the_first_line_of_the_answer_scores_nothing(tmp_path):
    """The reward hack open-r1's zip comparison pays: print what is easy (the count, the YES) and stop. It scores
    nothing here; the program that prints the whole answer scores 1."""
    info = {"test_cases": [{"input": "3\n", "output": "3\n1 2 3\n"}, {"input": "5\n", "output": "5\n1 2 3 4 5"}]}
    first = "```python\nprint(int(input()))\n```"
    whole = "```python\nn = int(input())\nprint(n)\nprint(*range(1, n + 1))\n```"
    with Sandbox(max_workers=2, tmp_root=str(tmp_path)) as box:
        assert code_reward([first, whole], [info, info], sandbox=box) == [0.0, 1.0]


def test_extract_code():
    assert extract_code(CORRECT) == "a, b = map(int, input().split())\nprint(a + b)\n"
    assert extract_code(NO_BLOCK) == ""
    assert extract_code(CPP_OK, "c") == ""      # ```c must not match ```cpp
    assert extract_code(CPP_OK, "cpp").startswith("#include <iostream>")


@needs_gxx
def test_cpp_and_c(sb):
    cpp = {**ADD, "language": None}  # no per-sample language: the argument decides
    out = code_reward([CPP_OK, CPP_BROKEN, CORRECT], [cpp] * 3, language="cpp", sandbox=sb)
    assert out == [1.0, 0.0, 0.0]  # a compile error and a python block in a C++ task score 0
    assert code_reward([C_OK], [{**ADD, "language": "c"}], sandbox=sb) == [1.0]


@needs_gxx
def test_per_sample_language_wins(sb):
    # verification_info["language"] (open-r1's layout) takes precedence over the recipe-wide argument.
    infos = [{**ADD, "language": "python"}, {**ADD, "language": "c++"}]
    assert code_reward([CORRECT, CPP_OK], infos, language="c", sandbox=sb) == [1.0, 1.0]


def test_unsupported_language_scores_zero(sb):
    assert code_reward([CORRECT], [{**ADD, "language": "java"}], sandbox=sb) == [0.0]
    with pytest.raises(OgrpoError, match="java"):
        canonical_language("java")


def test_open_r1_recipe_keywords(sb):
    # The registry binds open-r1's parallel_code_exec_per_proc and enforce_same_language as these keywords.
    assert code_reward([CORRECT], [ADD], num_parallel=2, enforce_same_language=True, sandbox=sb) == [1.0]
    with pytest.raises(OgrpoError, match="mixes languages"):
        code_reward([CORRECT, CPP_OK], [ADD, {**ADD, "language": "cpp"}], enforce_same_language=True, sandbox=sb)


def test_missing_verification_info_is_a_one_line_error(sb):
    with pytest.raises(OgrpoError, match="verification_info"):
        code_reward([CORRECT], sandbox=sb)


def test_binary_code_thresholds(sb):
    three = {"test_cases": [{"input": "", "output": "a"}, {"input": "", "output": "a"}, {"input": "", "output": "b"}]}
    prints_a = "```python\nprint('a')\n```"
    assert code_reward([prints_a], [three], sandbox=sb) == [pytest.approx(2 / 3)]
    assert binary_code_reward([prints_a, CORRECT, HALF], [three, ADD, ADD], sandbox=sb) == [0.0, 1.0, 0.0]


def test_trl_keyword_columns_are_accepted(sb):
    # TRL passes prompts, completion_ids, trainer_state, log_extra, log_metric and every dataset column.
    metrics = {}
    out = code_reward(completions=[CORRECT, CPP_BROKEN], verification_info=[ADD, {**ADD, "language": "cpp"}],
                      prompts=["p", "p"], completion_ids=[[1], [2]], trainer_state=None, log_extra=None,
                      log_metric=metrics.__setitem__, sandbox=sb)
    assert out == [1.0, 0.0]
    assert metrics == {"code/compile_error_frac": 0.5, "code/timeout_frac": 0.0, "code/sandbox_error_frac": 0.0}


def test_a_broken_sandbox_is_logged_not_raised(tmp_path):
    # An interpreter gone after the pool started (one missing from the start is refused then: test_sandbox.py):
    # every run is a sandbox error, scored 0 and reported as such.
    metrics = {}
    with Sandbox(max_workers=1, tmp_root=str(tmp_path)) as box:
        box.python = "/nonexistent/python3"
        out = code_reward([CORRECT], [ADD], sandbox=box, log_metric=metrics.__setitem__)
    assert out == [0.0] and metrics["code/sandbox_error_frac"] == 1.0


GOOD_FORMAT = "<think>\nadd\n</think>\n<answer>\nHere:\n```python\nprint(1)\n```\n</answer>"


def test_code_format_reward():
    bad = [
        "```python\nprint(1)\n```",                                         # no tags
        "<think>add</think><answer>```python\nprint(1)\n```</answer>",      # open-r1 needs the newlines
        "<think>\nadd\n</think>\n<answer>\nno code\n</answer>",             # no fenced block
        GOOD_FORMAT.replace("```python", "```cpp"),                          # wrong language
    ]
    assert code_format_reward([GOOD_FORMAT, *bad]) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert code_format_reward([[{"role": "assistant", "content": GOOD_FORMAT}]]) == [1.0]
    # A dataset `language` column arrives in the same keyword and applies per sample.
    cpp = GOOD_FORMAT.replace("```python", "```cpp")
    assert code_format_reward([GOOD_FORMAT, cpp], language=["python", "cpp"]) == [1.0, 1.0]
    assert code_format_reward([cpp], language="cpp") == [1.0]


# --- one completion's test cases in parallel (issue 21: 4 cases of 4.5 s took 18 s) ----------------------------


def _launchers_under(root) -> list[int]:
    """Sandbox launchers (and their reapers) still running for work dirs under `root`: the launcher's command
    line carries its spec, which holds the work dir's path."""
    import psutil

    needle = str(root).encode().hex()
    out = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(needle in a for a in proc.info["cmdline"] or []):
            out.append(proc.pid)
    return out


def test_split_counts_share_idle_workers():
    from ogrpo.rewards.code import split_counts

    assert split_counts([4], 8) == [4]              # one completion: a job per test case
    assert split_counts([4] * 8, 8) == [1] * 8      # a full pool: cases in turn, stopping at a timeout
    assert split_counts([4, 1, 10], 8) == [2, 1, 5]  # spare workers to the longest chains
    assert split_counts([3, 3], 1) == [1, 1] and split_counts([], 4) == []


def test_one_completions_test_cases_run_in_parallel(tmp_path):
    # Each run reports when it started and ended; with 4 workers the 4 cases of one completion overlap (they
    # ran one after another before). Sleeping programs, so the check holds on a 2-core machine too.
    program = ("```python\nimport sys, time\nt = time.time()\ntime.sleep(1.5)\nprint(input())\n"
               "print(t, time.time(), file=sys.stderr)\n```")
    info = {"test_cases": [{"input": f"{i}\n", "output": f"{i}\n"} for i in range(4)]}
    with Sandbox(max_workers=4, tmp_root=str(tmp_path)) as box:
        submitted, results = [], []
        run_jobs = box.run_jobs

        def spy(jobs, limits=None):
            submitted.append(len(jobs))
            results.extend(run_jobs(jobs, limits=limits))
            return results[-len(jobs):]

        box.run_jobs = spy
        assert code_reward([program], [info], sandbox=box, limits=Limits(cpu_s=5, wall_s=10.0)) == [1.0]
    assert submitted == [4]
    spans = [tuple(map(float, run.stderr.split())) for res in results for run in res.runs]
    assert len(spans) == 4
    assert max(start for start, _ in spans) < min(end for _, end in spans), spans  # all four ran at once
    assert _launchers_under(tmp_path) == []


@needs_gxx
def test_split_c_programs_compile_in_each_part(tmp_path):
    # Two workers, one C++ completion with two cases: two jobs, each compiling; the scores and the compile-error
    # metric are those of a single job.
    metrics = {}
    with Sandbox(max_workers=2, tmp_root=str(tmp_path)) as box:
        cpp = {**ADD, "language": "cpp"}
        assert code_reward([CPP_OK], [cpp], sandbox=box) == [1.0]
        assert code_reward([CPP_BROKEN], [cpp], sandbox=box, log_metric=metrics.__setitem__) == [0.0]
    assert metrics["code/compile_error_frac"] == 1.0
    assert _launchers_under(tmp_path) == []


_SHARED_FILES = ('import fcntl, os, time\n'
                 'names = sorted(os.listdir("/usr/bin"))\n'
                 'fds = []\n'
                 'for name in names:\n'
                 '    path = os.path.join("/usr/bin", name)\n'
                 '    if len(fds) < 33 and os.path.isfile(path) and not os.path.islink(path):\n'
                 '        fds.append(os.open(path, os.O_RDONLY))\n')
# A group's completions run side by side on the same tests: the solver holds a shared lock on system file i for
# each set bit of its answer, then on file 32 ("ready"); the copier reads the bits as the locks it cannot take.
SOLVER = ("```python\n" + _SHARED_FILES + 'n = int(input()) * 2\n'
          'try:\n'
          '    for i in range(32):\n'
          '        if n >> i & 1:\n'
          '            fcntl.flock(fds[i], fcntl.LOCK_SH)\n'
          '    fcntl.flock(fds[32], fcntl.LOCK_SH)\n'
          '    time.sleep(2)\n'
          'except OSError:\n'
          '    pass\n'
          'print(n)\n```')
COPIER = ("```python\n" + _SHARED_FILES + 'input()\n'
          'def held(fd):\n'
          '    try:\n'
          '        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n'
          '    except BlockingIOError:\n'
          '        return True\n'
          '    fcntl.flock(fd, fcntl.LOCK_UN)\n'
          '    return False\n'
          'deadline = time.time() + 4\n'
          'while not held(fds[32]) and time.time() < deadline:\n'
          '    time.sleep(0.01)\n'
          'print(sum(1 << i for i in range(32) if held(fds[i])))\n```')


@pytest.mark.parametrize("where", ["under-tmp", "outside-tmp"])
def test_a_program_cannot_copy_its_siblings_answer_through_the_shared_files(tmp_path, where):
    """Two completions of one prompt run at once: the copier never computes, it reads the answer the solver
    signals through locks on the read-only system files both see. Locks are refused in the sandbox, so the
    solver still scores and the copier scores nothing (it scored 1.0 before), with the runs' TMPDIR under /tmp
    and outside it (a site's scratch: here under the checkout, as tests/test_sandbox_attacks.py does)."""
    import tempfile
    from pathlib import Path

    if where == "outside-tmp":
        base = Path(__file__).resolve().parents[1] / ".scratch"
        base.mkdir(exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="ogrpo-siblings-", dir=base))
    else:
        root = tmp_path
    info = {"test_cases": [{"input": "123456\n", "output": "246912\n"}]}
    try:
        with Sandbox(max_workers=2, tmp_root=str(root)) as box:
            assert code_reward([SOLVER, COPIER], [info, info], sandbox=box) == [1.0, 0.0]
        assert list(root.iterdir()) == []  # nothing of either run is left
    finally:
        shutil.rmtree(root, ignore_errors=True)
