"""Reward resolution: built-in names, TRL's names, import paths, weights, and the one-line errors."""

from __future__ import annotations

import sys
import textwrap

import pytest

from ogrpo.errors import OgrpoError
from ogrpo.train.rewards import (accuracy_reward, format_reward, length_reward, resolve_reward, resolve_rewards)


def test_builtin_and_import_paths_resolve_to_the_same_function(tmp_path, monkeypatch):
    mod = tmp_path / "my_rewards.py"
    mod.write_text("def score(completions, **kw):\n    return [float(len(c)) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    colon = resolve_reward("my_rewards:score")
    dotted = resolve_reward("my_rewards.score")  # TRL's own script uses dotted paths
    assert colon is dotted
    assert colon(["ab", "abcd"]) == [2.0, 4.0]


def test_trl_reward_names_resolve_to_trl_functions():
    import trl.rewards

    assert resolve_reward("think_format_reward") is trl.rewards.think_format_reward


def test_resolved_rewards_are_named_for_trl_metrics_and_weights_checked():
    funcs, weights = resolve_rewards(["tiny_letter", "ogrpo.tiny:letter_reward"], [1, 0.5])
    assert [f.__name__ for f in funcs] == ["tiny_letter", "letter_reward"]
    assert weights == [1.0, 0.5]
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


def test_no_reward_funcs_is_an_error():
    with pytest.raises(OgrpoError, match="set reward_funcs"):
        resolve_rewards(None)


def test_builtin_reward_semantics():
    assert format_reward(["<think>x</think><answer>4</answer>", "4"]) == [1.0, 0.0]
    # \boxed{} answer against a solution column; whitespace and case do not matter; no reference -> None
    assert accuracy_reward(["so \\boxed{ 4 }", "<answer>five</answer>"], solution=["4", "Five"]) == [1.0, 1.0]
    assert accuracy_reward(["x"]) == [None]
    # 1 at the target length, 0.5 at half of it, 0 at twice it
    assert length_reward(["a" * 10, "a" * 5, "a" * 20], target_length=10) == [1.0, 0.5, 0.0]
