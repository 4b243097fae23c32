"""Rewards: open-r1's set scored against hand-written completions, the recipe's parameters, TRL's names, user
functions by import and file path, and the plan-time check (no import, one error naming every bad entry)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap

import pytest

from error_checks import one_line_error
from ogrpo.errors import ConfigError, OgrpoError
from ogrpo.rewards.registry import REWARDS, check_rewards, required_columns, resolve_reward, resolve_rewards


def conv(text: str) -> list[dict]:
    """A conversational completion, as TRL passes it for chat prompts (open-r1 reads completion[0]["content"])."""
    return [{"role": "assistant", "content": text}]


def reward(name: str, completions, params: dict | None = None, **columns):
    return resolve_reward(name, params)(completions, **columns)


# --- accuracy: math-verify, open-r1's parse settings ---------------------------------------------------------

ACCURACY_CASES = [
    # (completion, gold, expected)
    (r"The answer is \boxed{\frac{1}{2}}", "0.5", 1.0),          # LaTeX fraction vs a plain decimal gold
    (r"so \boxed{0.5}", r"\frac{1}{2}", 1.0),                     # and the other way round
    (r"\boxed{\frac{2}{4}}", r"$\frac{1}{2}$", 1.0),             # unreduced fraction: equal value
    (r"\boxed{1+x}", r"$x+1$", 1.0),                               # equivalent expressions
    (r"\boxed{3}", r"\boxed{7}", 0.0),                             # wrong
    ("The answer is 0.5", "0.5", 0.0),                             # no \boxed{} or $...$: not extracted
    (r"\boxed{2} first, then \boxed{7}", "7", 0.0),                # first match (boxed) wins, as in open-r1
    (r"\boxed{7}", "the value is not written here", None),         # unparsable gold: skipped (None)
]


@pytest.mark.parametrize("completion, gold, expected", ACCURACY_CASES)
def test_accuracy_verifies_answers_with_math_verify(completion, gold, expected):
    assert reward("accuracy", [conv(completion)], solution=[gold]) == [expected]
    assert reward("accuracy", [completion], solution=[gold]) == [expected]  # plain-text completions too


def test_accuracy_agrees_with_trl_accuracy_reward():
    """TRL 1.16's accuracy_reward (math-verify as well, slightly different normalisation) on the same cases."""
    from trl.rewards import accuracy_reward as trl_accuracy

    completions = [conv(c) for c, _, _ in ACCURACY_CASES]
    golds = [g for _, g, _ in ACCURACY_CASES]
    assert reward("accuracy", completions, solution=golds) == trl_accuracy(completions, golds)
    assert reward("accuracy_reward", completions, solution=golds) == trl_accuracy(completions, golds)


# --- format family --------------------------------------------------------------------------------------------

GOOD = "<think>\nreasoning\n</think>\n<answer>\n42\n</answer>"


def test_format_soft_format_and_tag_count():
    squashed = "<think>reasoning</think> <answer>42</answer>"
    no_answer = "<think>\nreasoning\n</think>\n42"
    doubled = "<think>\na\n</think>\n<think>\nb\n</think>\n<answer>\n42\n</answer>"
    texts = [GOOD, squashed, no_answer, doubled]
    assert reward("format", [conv(t) for t in texts]) == [1.0, 0.0, 0.0, 1.0]  # lazy .*? lets doubled match
    assert reward("soft_format", texts) == [1.0, 1.0, 0.0, 1.0]
    # 0.25 per tag present exactly once: all 4; none with newlines; <think>\n and \n</think>\n only; answer
    # tags only (the think tags appear twice)
    assert reward("tag_count", texts) == [1.0, 0.0, 0.5, 0.5]


def test_reasoning_steps_counts_open_r1_markers():
    texts = ["Step 1: a\nStep 2: b\nStep 3: c\nStep 4: d",  # 4 markers -> capped at 1
             "First, add. Next, carry.",  # 2 -> 2/3
             "1. a\n2. b",  # ^ without MULTILINE: only the text's start counts (as in open-r1) -> 1/3
             "no structure"]
    assert reward("reasoning_steps", texts) == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])


def test_code_format_uses_code_language_and_the_language_column():
    block = "<think>\nplan\n</think>\n<answer>\n```python\nprint(1)\n```\n</answer>"
    assert reward("code_format", [conv(block), conv(GOOD)]) == [1.0, 0.0]
    assert reward("code_format", [block], {"code_language": "cpp"}) == [0.0]
    assert reward("code_format", [block], {"code_language": "cpp"}, language=["python"]) == [1.0]


# --- length-shaped rewards ------------------------------------------------------------------------------------


def test_length_reward_is_kimi_lambda_over_the_group():
    right_short = r"\boxed{2}"  # 9 chars, correct
    wrong_mid = r"\boxed{3}" + "x" * 11  # 20 chars, wrong
    right_long = "x" * 31 + r"\boxed{2}"  # 40 chars, correct
    # min 9, max 40: lambda = 0.5 - (len - 9) / 31 -> 0.5, 0.145, -0.5; the wrong one gets min(0, 0.145) = 0
    got = reward("length", [right_short, wrong_mid, right_long], solution=["2"] * 3)
    assert got == pytest.approx([0.5, 0.0, -0.5])
    assert reward("len", [right_short, r"\boxed{3}"], solution=["2", "2"]) == [0.0, 0.0]  # equal lengths


def test_cosine_scaled_reward_with_recipe_parameters():
    params = {"cosine_max_len": 18}  # 9-char completions are half way: cos(pi/2) = 0
    got = reward("cosine", [r"\boxed{2}", r"\boxed{3}", r"\boxed{2}"], params, solution=["2", "2", "no answer"])
    # correct: 0.5 + 0.5 * (1.0 - 0.5) * (1 + 0) = 0.75; wrong (open-r1 defaults min 0.0, max -0.5):
    # -0.5 + 0.5 * (0.0 + 0.5) * 1 = -0.25; unparsable gold: 1.0
    assert got == pytest.approx([0.75, -0.25, 1.0])
    long_right = reward("cosine", ["x" * 991 + r"\boxed{2}"], solution=["2"])  # len 1000 = cosine_max_len
    assert long_right == pytest.approx([0.5])  # cos(pi) = -1: the minimum for a correct answer


def test_repetition_penalty_with_recipe_parameters():
    texts = ["a b c a b c", "a b", "", "one two three four"]
    # 3-grams of "a b c a b c": abc, bca, cab, abc -> 3 unique of 4 -> (1 - 3/4) * -1 = -0.25
    assert reward("repetition_penalty", texts) == [-0.25, 0.0, 0.0, 0.0]
    assert reward("repetition_penalty", texts[:1], {"repetition_max_penalty": -2.0}) == [-0.5]
    # 2-grams: ab, bc, ca, ab, bc -> 3 unique of 5 -> -0.4
    assert reward("repetition_penalty", texts[:1], {"repetition_n_grams": 2}) == pytest.approx([-0.4])
    with pytest.raises(OgrpoError, match="should not be positive"):
        resolve_reward("repetition_penalty", {"repetition_max_penalty": 1.0})


def test_soft_overlong_punishment_on_token_counts():
    f = resolve_reward("soft_overlong_punishment", {"max_completion_len": 10, "soft_punish_cache": 4})
    # called with keywords, as TRL does; <= 6 tokens: 0; 8 tokens: (10 - 4 - 8) / 4 = -0.5; 10: -1; beyond: -1
    assert f(completions=["x"] * 4, completion_ids=[[0] * 6, [0] * 8, [0] * 10, [0] * 11]) == [0.0, -0.5, -1.0, -1.0]


# --- names, TRL, user functions ----------------------------------------------------------------------------


def test_trl_reward_names_resolve_to_trl_functions():
    import trl.rewards

    assert resolve_reward("think_format_reward") is trl.rewards.think_format_reward
    overlong = resolve_reward("get_soft_overlong_punishment")  # TRL's script: max 1280, cache 256
    assert overlong(completion_ids=[[0] * 1024, [0] * 1152]) == [0.0, -0.5]


def test_builtin_and_import_paths_resolve_to_the_same_function(tmp_path, monkeypatch):
    mod = tmp_path / "my_rewards.py"
    mod.write_text("def score(completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    colon = resolve_reward("my_rewards:score")
    dotted = resolve_reward("my_rewards.score")  # TRL's own script uses dotted paths
    assert colon is dotted
    assert colon(["ab", "abcd"]) == [2.0, 4.0]


def test_file_path_rewards_are_checked_made_absolute_and_loaded(tmp_path, monkeypatch):
    (tmp_path / "helper.py").write_text("BONUS = 0.5\n")
    (tmp_path / "judge.py").write_text(textwrap.dedent("""
        from helper import BONUS  # a neighbour of the file imports

        def score(completions, **kw):
            return [BONUS + len(c) for c in completions]
    """))
    monkeypatch.chdir(tmp_path)
    specs = check_rewards({"reward_funcs": ["judge.py:score", "accuracy"]})
    assert specs == [f"{tmp_path.resolve() / 'judge.py'}:score", "accuracy"]
    funcs, _ = resolve_rewards(specs)
    assert funcs[0].__name__ == "score" and funcs[0](["ab"]) == [2.5]
    with pytest.raises(ConfigError, match=r"file judge.py has no attribute 'scor'"):
        check_rewards({"reward_funcs": ["judge.py:scor"]})


def test_resolved_rewards_are_named_for_trl_metrics_and_weights_checked():
    funcs, weights = resolve_rewards(["tiny_letter", "ogrpo.tiny:letter_reward", "len"], [1, 0.5, 1])
    assert [f.__name__ for f in funcs] == ["tiny_letter", "letter_reward", "len"]
    assert weights == [1.0, 0.5, 1.0]
    # the wrapper passes TRL's keyword arguments through: 'aaaaaaaa' is all 'a' -> 1.0
    assert funcs[0](["aaaaaaaa", "bbbb"], letter=["a", "a"]) == [1.0, 0.0]
    with pytest.raises(OgrpoError, match="one weight per entry"):
        resolve_rewards(["tiny_letter", "format"], [1.0])


def test_async_reward_stays_async(tmp_path, monkeypatch):
    import inspect

    (tmp_path / "async_rewards.py").write_text(textwrap.dedent("""
        async def judge(completions, **kw):
            return [1.0 for _ in completions]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    funcs, _ = resolve_rewards(["async_rewards:judge"])
    assert inspect.iscoroutinefunction(funcs[0])


@pytest.mark.parametrize("spec, needle", [
    ("accuracyy", "did you mean 'accuracy'"),
    ("no_such_pkg.mod:f", "cannot import module 'no_such_pkg.mod'"),
    ("ogrpo.tiny:not_there", "has no attribute 'not_there'"),
    ("", "is not a reward name"),
])
def test_bad_reward_specs_give_one_line_errors(spec, needle):
    assert needle in str(one_line_error(resolve_reward, spec))


def test_plan_time_check_names_every_problem_at_once():
    with pytest.raises(ConfigError) as info:
        check_rewards({"reward_funcs": ["acuracy", "ioi_code", "ogrpo.tiny:nope", "format"],
                       "repetition_max_penalty": "high"}, weights=[1.0])
    text = str(info.value)
    for needle in ("unknown reward 'acuracy': did you mean 'accuracy'", "'ioi_code' needs a remote judge (IOI problems",
                   "module 'ogrpo.tiny' has no attribute 'nope'", "reward_weights has 1 entries for 4"):
        assert needle in text, needle
    # repetition_* is only checked when repetition_penalty is used
    assert "repetition_max_penalty" not in text
    with pytest.raises(ConfigError, match="repetition_max_penalty: expected float"):
        check_rewards({"reward_funcs": ["repetition_penalty"], "repetition_max_penalty": "high"})
    with pytest.raises(ConfigError, match="set reward_funcs"):
        check_rewards({"reward_funcs": []})


def _printed_by_python(code: str, timeout: float) -> str:
    """The stdout of CODE run in a fresh interpreter (nothing imported by this test process), which exits 0."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_plan_time_check_imports_no_implementation():
    code = ("import sys\nfrom ogrpo.rewards.registry import check_rewards, REWARDS\n"
            "check_rewards({'reward_funcs': list(REWARDS) + ['ogrpo.rewards.math:accuracy_reward']})\n"
            "print(sorted(m for m in ('torch', 'trl', 'math_verify', 'datasets', 'ogrpo.rewards.math',"
            " 'ogrpo.rewards.code') if m in sys.modules))")
    assert _printed_by_python(code, timeout=60).strip() == "[]"


def test_every_registry_entry_points_at_a_real_function():
    import importlib

    for name, entry in REWARDS.items():
        module, _, attr = entry.target.partition(":")
        if module == "ogrpo.rewards.code" and importlib.util.find_spec(module) is None:
            continue  # written by the sandbox work; checked once it is there
        assert callable(getattr(importlib.import_module(module), attr)), name
    assert required_columns(["accuracy", "len", "code", "format", "x.y:z"]) == {
        "solution": ["accuracy", "len"], "verification_info": ["code"]}


def test_unset_reward_funcs_take_open_r1_default_and_an_empty_list_is_an_error():
    funcs, _ = resolve_rewards(None)  # open-r1's GRPOScriptArguments default
    assert [f.__name__ for f in funcs] == ["accuracy", "format", "tag_count"]
    assert check_rewards({}) == ["accuracy", "format", "tag_count"]
    with pytest.raises(OgrpoError, match="set reward_funcs"):
        resolve_rewards([])


def test_math_rewards_run_off_the_main_thread():
    """TRL may call reward functions from a worker thread, where math_verify's signal timeout cannot be used."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        got = pool.submit(reward, "accuracy", [r"\boxed{\frac{1}{2}}"], solution=["0.5"]).result()
    assert got == [1.0] and not math.isnan(got[0])


# --- bounded time: linear layout scanners, math-verify in killable workers -------------------------------------

# open-r1's patterns, verbatim from huggingface/open-r1 src/open_r1/rewards.py (format and code_format unchanged
# from 7835979 to HEAD c1e1192; code_format pastes the language in unescaped), with the flags it uses. soft_format
# is the GRPO demo's pattern this project ported (matched on the stripped text); extract_code open-r1's findall.
OPEN_R1_FORMAT = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.MULTILINE)
OPEN_R1_SOFT = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)


def open_r1_code_format(language: str):
    return re.compile(rf"^<think>\n.*?\n</think>\n<answer>\n.*?```{language}.*?```.*?\n</answer>$",
                      re.DOTALL | re.MULTILINE)


def open_r1_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.DOTALL)


# Pieces the patterns care about (and near misses), glued at random into completions short enough for the
# backtracking regexes to finish.
_PIECES = ["<think>", "</think>", "<answer>", "</answer>", "\n", "\n", " ", "\t", "\r", "\u00a0", "\u2028", "\x1c",
           "```", "```python", "```cpp", "```c", "python", "x", "<", ">", "/", "answer", "think", "`", "1",
           "<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>", "\n</think>\n<answer>\n", "```python\n"]
_VALID = ["<think>\nplan\n</think>\n<answer>\n42\n</answer>",
          "<think>\nplan\n</think>\n<answer>\nso:\n```python\nprint(1)\n```\n</answer>",
          "<think>\nx\n</think>\n<answer>\n```cpp\nint main(){}\n```\n</answer>\ntrailing",
          "<think>a</think>  \n<answer>b</answer>"]


def _corpus(n: int = 4000, seed: int = 0) -> list[str]:
    import random

    rng = random.Random(seed)
    texts = ["", *_VALID]
    for _ in range(n):
        texts.append("".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 14))))
    for good in _VALID:  # every one-character deletion, and insertions of the characters that matter
        for i in range(len(good) + 1):
            texts.append(good[:i] + good[i + 1:])
            for ch in ("\n", " ", "`", "<"):
                texts.append(good[:i] + ch + good[i:])
    return texts


def test_layout_scanners_give_open_r1_regex_answers_on_a_generated_corpus():
    from ogrpo.rewards.formats import fenced_blocks, is_code_format, is_format, is_soft_format

    code_patterns = {lang: open_r1_code_format(lang) for lang in ("python", "cpp", "c")}
    counts = {"format": 0, "code_format": 0, "soft": 0}
    for text in _corpus():
        assert is_format(text) == bool(OPEN_R1_FORMAT.match(text)), repr(text)
        assert is_soft_format(text.strip()) == bool(OPEN_R1_SOFT.match(text.strip())), repr(text)
        for lang, pattern in code_patterns.items():
            assert is_code_format(text, lang) == bool(pattern.match(text)), (lang, repr(text))
            assert fenced_blocks(text, lang) == open_r1_blocks(text, lang), (lang, repr(text))
        counts["format"] += is_format(text)
        counts["code_format"] += is_code_format(text, "python")
        counts["soft"] += is_soft_format(text.strip())
    assert min(counts.values()) > 50, counts  # the corpus has matches of each kind, not only misses


def test_regex_whitespace_is_str_isspace():
    # soft_format's `\s*` is scanned with str.isspace, think_format's `[\s\n]*` with str.lstrip: the same set of
    # code points as re's `\s`.
    import sys

    every = "".join(map(chr, range(sys.maxunicode + 1)))
    assert re.findall(r"\s", every) == [ch for ch in every if ch.isspace()]
    assert re.findall(r"[\s\n]", every) == [ch for ch in every if (ch + "x").lstrip() == "x"]


def test_layout_rewards_are_linear_on_pathological_completions(monkeypatch):
    """The issue's cases: open-r1's code_format took 63 s on 8 KiB of this shape, format 3.3 s on 128 KiB. Here
    64x longer inputs, with the regex engine switched off (so no backtracking can be involved), in well under
    a second each (a 20x margin over the measured milliseconds)."""
    import time

    code = "<think>\n" + "\n</think>\n<answer>\n```python```" * (512 * 1024 // 30)
    fmt = "<think>\n" + "\n</think>\n<answer>\n" * (8 * 1024 * 1024 // 19)
    soft = "<think>" + "</think> <answer>" * (512 * 1024 // 17)
    fence = "```python\n" * (512 * 1024 // 10)
    think = "\u2028" * (4 * 1024 * 1024) + "<think>" + "<think</think" * (512 * 1024 // 13) + "</think>"

    from ogrpo.rewards.code import extract_code

    funcs = {name: resolve_reward(name) for name in ("code_format", "format", "soft_format", "think_format")}

    def no_regex(*args, **kwargs):
        raise AssertionError("a layout reward used the regex engine")

    monkeypatch.setattr(re, "_compile", no_regex)
    try:
        t0 = time.perf_counter()
        got = [funcs["code_format"]([code]), funcs["format"]([fmt]), funcs["soft_format"]([soft]),
               extract_code(fence), funcs["think_format"]([think])]
        elapsed = time.perf_counter() - t0
    finally:
        monkeypatch.undo()  # pytest itself needs `re` to report a failure
    assert got == [[0.0], [0.0], [0.0], "", [1.0]]
    assert elapsed < 5.0


def _gone(pids) -> bool:
    import psutil

    return not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _eventually_gone(pids, seconds: float = 15.0) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while not _gone(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _gone(pids)


DEEP_FRAC = "\\boxed{" + "\\frac{1}{" * 10_000 + "2" + "}" * 10_000 + "}"


@pytest.mark.slow
def test_deep_frac_in_a_worker_thread_is_stopped_and_its_worker_replaced(monkeypatch):
    """math-verify's alarm is off outside the main thread: a `\\frac` nested 10,000 deep ran for minutes there.
    Through the reward, called from a worker thread as TRL may, it scores 0 once the hard limit (1.5 s here)
    kills its worker; the next completion of the batch is still scored, by a fresh worker."""
    import threading

    from ogrpo.rewards import math as math_rewards
    from ogrpo.rewards.bounded import BoundedPool

    pool = BoundedPool("ogrpo.rewards.math:check_one", workers=1, timeout_s=1.5,
                       init="ogrpo.rewards.math:warm_worker")
    monkeypatch.setattr(math_rewards, "_pool", pool)
    try:
        assert reward("accuracy", [r"\boxed{2}"], solution=["2"]) == [1.0]  # starts the worker
        first = pool.pids()
        metrics, out = {}, []
        caller = threading.Thread(target=lambda: out.append(reward(
            "accuracy", [DEEP_FRAC, r"\boxed{2}"], solution=["1/2", "2"], log_metric=metrics.__setitem__)),
            daemon=True)
        caller.start()
        # ~3 s here, 25 s with the machine loaded (two worker start-ups); before, still running after 150 s.
        caller.join(120)
        assert not caller.is_alive(), "the reward did not return"
        assert out == [[0.0, 1.0]]
        assert metrics == {"math/timeout_frac": 0.5}
        assert pool.timeouts == 1
        assert _gone(first) and len(pool.pids()) == 1 and pool.pids() != first  # killed, reaped, replaced
        alive = pool.pids()
    finally:
        pool.close()
    assert _gone(alive)


@pytest.mark.slow
def test_bounded_pool_timeouts_crashes_reuse_and_start_errors():
    """The pool on standard-library functions: an item past its limit, one that raises, one that kills its
    worker; the others still scored, workers reused across calls, and none left after close."""
    from ogrpo.rewards.bounded import FAILED, TIMED_OUT, BoundedPool

    seen = set()
    with BoundedPool("time:sleep", workers=2, timeout_s=3.0) as pool:  # generous: a loaded 2-core machine
        assert pool.map([0, 60, 0, 0.05]) == [None, TIMED_OUT, None, None]
        seen.update(pool.pids())
        before = pool.pids()
        assert pool.map([0] * 8) == [None] * 8 and pool.pids() == before  # persistent: no start-up per call
        cmdline = " ".join(open(f"/proc/{before[0]}/cmdline").read().split("\0"))
        assert "-m ogrpo.rewards.bounded time:sleep" in cmdline  # a fresh interpreter, not a fork of this one
        assert pool.map(["x"], on_error="bad") == ["bad"]  # TypeError inside the worker; it survives
        assert pool.pids() == before
    assert _gone(seen)
    with BoundedPool("os:_exit", workers=1, timeout_s=5.0) as pool:
        assert pool.map([3, 4]) == [FAILED, FAILED]  # each kills its worker; the second runs on a replacement
        seen.update(pool.pids())
    assert _gone(seen)
    with pytest.raises(OgrpoError, match="no_such_module") as info:
        BoundedPool("no_such_module:f").map([1])
    assert "\n" not in str(info.value)


def test_bounded_pool_workers_die_with_their_trainer():
    """A trainer that dies without cleanup (no atexit) while its workers are busy leaves none behind."""
    import json

    code = ("import json, os, threading, time\nfrom ogrpo.rewards.bounded import BoundedPool\n"
            "p = BoundedPool('time:sleep', workers=2, timeout_s=300)\np.map([0, 0])\n"
            "threading.Thread(target=p.map, args=([300, 300],), daemon=True).start()\ntime.sleep(0.5)\n"
            "print(json.dumps(p.pids()), flush=True)\nos._exit(0)\n")
    pids = json.loads(_printed_by_python(code, timeout=120))
    assert len(pids) == 2
    assert _eventually_gone(pids)


# --- open-r1's zero-math-code branch: think_format, think_accuracy ---------------------------------------------

# Faithful references of open-r1's functions at 296aa66 (branch zero-math-code, the commit of
# tests/data/recipes/openr1_r1-zero-qwen-math-7b-math_config_v00.00.yaml; unchanged at the branch's head but for
# whitespace): its start pattern and flags verbatim, its tag counts, its parse/verify settings, run in-process.
OPEN_R1_THINK_START = re.compile(r"^[\s\n]*<think>", re.DOTALL | re.MULTILINE)


def open_r1_think_format(completions) -> list[float]:
    out = []
    for completion in completions:
        text = completion[0]["content"]
        ok = OPEN_R1_THINK_START.match(text) and text.count("<think>") == 1 and text.count("</think>") == 1
        out.append(1.0 if ok else 0.0)
    return out


def open_r1_think_accuracy(completions, solution) -> list[float | None]:
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    out = []
    for completion, sol in zip(completions, solution):
        text = completion[0]["content"]
        last = text.rfind("</think>")
        answer = text[last + len("</think>"):].strip() if last != -1 else ""
        gold = parse(sol, extraction_mode="first_match")
        if not gold:
            out.append(None)
            continue
        parsed = parse(answer, extraction_config=[LatexExtractionConfig(
            normalization_config=NormalizationConfig(nits=False, malformed_operators=False, basic_latex=True,
                                                     equations=True, boxed="all", units=True),
            boxed_match_priority=0, try_extract_without_anchor=False)], extraction_mode="first_match")
        try:
            out.append(float(verify(gold, parsed)))
        except Exception:
            out.append(None)
    return out


# Whitespace of every kind `\s` knows (and look-alikes it does not: zero-width space, BOM), the tags and their
# near misses.
_THINK_PIECES = ["<think>", "</think>", "<think", "think>", "</think", "</ think>", "<THINK>", "<", ">", "/", "x",
                 " ", "\n", "\t", "\r", "\x0b", "\x0c", "\x1c", "\x1f", "\x85", "\u00a0", "\u2028", "\u3000",
                 "\u200b", "\ufeff", "<answer>", r"\boxed{2}"]
_THINK_VALID = ["<think>\nplan\n</think>\nanswer", "  \n \n<think>a</think>", "\u2028\t\x85<think></think>b",
                "<think>\nplan\n</think>\n<answer>\n42\n</answer>"]


def _think_corpus(n: int = 4000, seed: int = 1) -> list[str]:
    import random

    rng = random.Random(seed)
    texts = ["", " ", *_THINK_VALID]
    for _ in range(n):
        texts.append("".join(rng.choice(_THINK_PIECES) for _ in range(rng.randint(1, 12))))
    for good in _THINK_VALID:
        for i in range(len(good) + 1):
            texts.append(good[:i] + good[i + 1:])
            for piece in ("<think>", "</think>", "\u200b", "\u00a0", "y"):
                texts.append(good[:i] + piece + good[i:])
    return texts


def test_think_format_gives_open_r1_answers_on_a_generated_corpus():
    from ogrpo.rewards.formats import is_think_format

    texts = _think_corpus()
    want = open_r1_think_format([conv(t) for t in texts])
    assert [1.0 if is_think_format(t) else 0.0 for t in texts] == want
    assert reward("think_format", [conv(t) for t in texts]) == want
    assert reward("think_format", texts) == want  # plain-text completions too
    assert 50 < sum(want) < len(texts) - 50  # matches and misses both


def test_think_format_on_open_r1_examples_and_near_misses():
    texts = ["<think>\nThis is my reasoning.\n</think>\nThis is my answer.",  # open-r1's docstring examples
             "\n<think>\nThis is my reasoning.\n</think>\nThis is my answer.",
             "  \n \n<think>\nThis is my reasoning.\n</think>\nThis is my answer.",
             "Some text <think>\nThis is my reasoning.\n</think>\nThis is my answer.",
             "<think>\nThis is my reasoning.\n</think> Extra </think>\nThis is my answer.",
             "\u00a0\u2028<think>r</think>",  # Unicode whitespace is `\s`
             "\u200b<think>r</think>",  # a zero-width space is not
             "<think>r",  # no closing tag
             "<think>r</think><think>",  # two opening tags
             "</think><think>r",  # the closing tag may come first: open-r1 only counts them
             "<think></think>"]
    want = [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert open_r1_think_format([conv(t) for t in texts]) == want
    assert reward("think_format", [conv(t) for t in texts]) == want


THINK_ACCURACY_CASES = [
    # (completion, gold, expected)
    ("<think>\nreason: \\boxed{3}?\n</think>\nThe answer is \\boxed{2}", "2", 1.0),  # only after </think> counts
    ("<think>\\boxed{2}</think> so \\boxed{3}", "2", 0.0),  # right inside the reasoning, wrong after
    ("<think>\\boxed{2}</think>", "2", 0.0),  # nothing after </think>
    ("\\boxed{2}", "2", 0.0),  # no </think>: nothing to check, even if right
    ("<THINK>x</THINK>\\boxed{2}", "2", 0.0),  # tags are case-sensitive
    ("<think>a</think>\n\\boxed{3}\n</think>\n\\boxed{2}", "2", 1.0),  # the last </think>
    ("<think>a</think>\\boxed{2}</think >", "2", 1.0),  # `</think >` is not a tag
    ("</think>\u2028\u00a0\\boxed{\\frac{1}{2}}\n", "0.5", 1.0),  # stripped of Unicode whitespace; LaTeX vs decimal
    ("</think> The final answer is $\\frac{1}{2}$", "0.5", 1.0),  # $...$ after an answer phrase
    ("</think> $\\frac{1}{2}$", "0.5", 0.0),  # a bare $...$ is not extracted with these settings
    ("<think>x</think>\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("<think>x</think>The answer is 2", "2", 0.0),  # not in LaTeX: not extracted
    ("<think>x</think>\\boxed{7}", "the value is not written here", None),  # unparsable gold: skipped
    ("</think>" * 20_000 + "\\boxed{2}", "2", 1.0),  # many closing tags
]


def test_think_accuracy_agrees_with_open_r1_on_normal_and_adversarial_completions():
    completions = [conv(c) for c, _, _ in THINK_ACCURACY_CASES]
    golds = [g for _, g, _ in THINK_ACCURACY_CASES]
    want = [e for _, _, e in THINK_ACCURACY_CASES]
    assert open_r1_think_accuracy(completions, golds) == want
    assert reward("think_accuracy", completions, solution=golds) == want
    assert reward("think_accuracy", [c for c, _, _ in THINK_ACCURACY_CASES], solution=golds) == want


def test_think_accuracy_skips_a_pathological_reasoning_block():
    """A `\\frac` nested 10,000 deep inside <think> never reaches math-verify (open-r1 cuts it off too): the answer
    after </think> is scored in the usual time. The reference would take minutes on DEEP_FRAC itself."""
    text = "<think>" + DEEP_FRAC + "</think>\n\\boxed{2}"
    assert open_r1_think_accuracy([conv(text)], ["2"]) == [1.0]
    assert reward("think_accuracy", [conv(text)], solution=["2"]) == [1.0]


def test_think_rewards_are_registered_with_their_columns():
    assert check_rewards({"reward_funcs": ["think_format", "think_accuracy"]}) == ["think_format", "think_accuracy"]
    assert required_columns(["think_format", "think_accuracy"]) == {"solution": ["think_accuracy"]}
    funcs, _ = resolve_rewards(["think_format", "think_accuracy"], [1.0, 1.0])
    assert [f.__name__ for f in funcs] == ["think_format", "think_accuracy"]


@pytest.mark.parametrize("name, why", [
    ("ioi_code", ("IOI problems", "C++", "ioi-test-cases", "Piston or Morph", "PISTON_ENDPOINTS", "MORPH_API_KEY")),
    ("cf_code", ("Codeforces problems", "official_tests", "CF_TESTS_FOLDER", "Piston", "PISTON_ENDPOINTS")),
])
def test_remote_judges_are_refused_saying_why_and_what_to_use_instead(name, why):
    for call in (lambda: check_rewards({"reward_funcs": [name]}), lambda: resolve_reward(name)):
        with pytest.raises(OgrpoError) as info:
            call()
        text = str(info.value)
        assert f"reward {name!r} needs a remote judge" in text and "\n" not in text
        for needle in (*why, "neither runs nor calls", "`code`", "`binary_code`", "verification_info",
                       "`package.module:function`"):
            assert needle in text, needle
