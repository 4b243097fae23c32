"""Reward import paths checked at plan time the way Python imports them, lazy modules included, without running
any package: TRL's `trl.rewards` is a `_LazyModule` whose functions exist only on attribute access."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ogrpo.errors import ConfigError
from ogrpo.train.rewards import check_rewards


@pytest.mark.parametrize("spec", ["trl.rewards:accuracy_reward", "trl.rewards.think_format_reward",
                                  "trl.rewards:get_soft_overlong_punishment", "trl:GRPOConfig"])
def test_lazy_module_attributes_are_accepted(spec):
    assert check_rewards({"reward_funcs": [spec]}) == [spec]


@pytest.mark.parametrize("spec, words", [("trl.rewards:no_such_reward", "has no attribute 'no_such_reward'"),
                                         ("trl:accuracy_reward", "has no attribute 'accuracy_reward'"),
                                         ("trl.no_such_module:f", "cannot import module 'trl.no_such_module'")])
def test_missing_attributes_are_refused(spec, words):
    with pytest.raises(ConfigError, match=words):
        check_rewards({"reward_funcs": [spec]})


def test_the_check_imports_nothing_heavy():
    code = ("import sys; from ogrpo.train.rewards import check_rewards; "
            "check_rewards({'reward_funcs': ['trl.rewards:accuracy_reward']}); "
            "print([m for m in ('trl', 'trl.rewards', 'torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_trainer_resolves_what_the_plan_accepted():
    """The same spec through the trainer's import (importlib + getattr on the real lazy module)."""
    from ogrpo.train.rewards import resolve_reward

    func = resolve_reward("trl.rewards:think_format_reward")
    assert callable(func) and func(completions=[[{"content": "<think>\nx\n</think>\ny"}]]) == [1.0]
