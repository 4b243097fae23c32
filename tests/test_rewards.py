"""Rewards: open-r1's set scored against hand-written completions, the recipe's parameters, TRL's names, user
functions by import and file path, and the plan-time check (no import, one error naming every bad entry)."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest

from ogrpo.errors import ConfigError, OgrpoError
from ogrpo.train.rewards import REWARDS, check_rewards, required_columns, resolve_reward, resolve_rewards


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
    with pytest.raises(OgrpoError) as info:
        resolve_reward(spec)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_plan_time_check_names_every_problem_at_once():
    with pytest.raises(ConfigError) as info:
        check_rewards({"reward_funcs": ["acuracy", "ioi_code", "ogrpo.tiny:nope", "format"],
                       "repetition_max_penalty": "high"}, weights=[1.0])
    text = str(info.value)
    for needle in ("unknown reward 'acuracy': did you mean 'accuracy'", "'ioi_code' (IOI problems",
                   "module 'ogrpo.tiny' has no attribute 'nope'", "reward_weights has 1 entries for 4"):
        assert needle in text, needle
    # repetition_* is only checked when repetition_penalty is used
    assert "repetition_max_penalty" not in text
    with pytest.raises(ConfigError, match="repetition_max_penalty: expected float"):
        check_rewards({"reward_funcs": ["repetition_penalty"], "repetition_max_penalty": "high"})
    with pytest.raises(ConfigError, match="set reward_funcs"):
        check_rewards({"reward_funcs": []})


def test_plan_time_check_imports_no_implementation():
    code = ("import sys\nfrom ogrpo.train.rewards import check_rewards, REWARDS\n"
            "check_rewards({'reward_funcs': list(REWARDS) + ['ogrpo.train.math_rewards:accuracy_reward']})\n"
            "print(sorted(m for m in ('torch', 'trl', 'math_verify', 'datasets', 'ogrpo.train.math_rewards',"
            " 'ogrpo.train.code_rewards') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_registry_entry_points_at_a_real_function():
    import importlib

    for name, entry in REWARDS.items():
        module, _, attr = entry.target.partition(":")
        if module == "ogrpo.train.code_rewards" and importlib.util.find_spec(module) is None:
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
