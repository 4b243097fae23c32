"""Reward import paths checked at plan time the way Python imports them, lazy modules included, without running
any package: TRL's `trl.rewards` is a `_LazyModule` whose functions exist only on attribute access."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ogrpo.errors import ConfigError
from ogrpo.rewards.registry import check_rewards


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
    code = ("import sys; from ogrpo.rewards.registry import check_rewards; "
            "check_rewards({'reward_funcs': ['trl.rewards:accuracy_reward']}); "
            "print([m for m in ('trl', 'trl.rewards', 'torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_trainer_resolves_what_the_plan_accepted():
    """The same spec through the trainer's import (importlib + getattr on the real lazy module)."""
    from ogrpo.rewards.registry import resolve_reward

    func = resolve_reward("trl.rewards:think_format_reward")
    assert callable(func) and func(completions=[[{"content": "<think>\nx\n</think>\ny"}]]) == [1.0]


@pytest.mark.parametrize("spec, new", [("ogrpo.train.math_rewards:accuracy_reward", "ogrpo.rewards.math"),
                                       ("ogrpo.train.text_rewards.format_reward", "ogrpo.rewards.text"),
                                       ("ogrpo.train.code_rewards:code_format_reward", "ogrpo.rewards.code")])
def test_a_reward_modules_old_path_still_names_its_function(spec, new):
    """Recipes written when the reward modules lived in ogrpo/train/ keep working, checked and resolved."""
    import importlib

    from ogrpo.rewards.registry import resolve_reward

    assert check_rewards({"reward_funcs": [spec]}) == [spec]
    attr = spec.replace(":", ".").rpartition(".")[2]
    assert resolve_reward(spec) is getattr(importlib.import_module(new), attr)
    with pytest.raises(ConfigError, match="has no attribute 'no_such_reward'"):
        check_rewards({"reward_funcs": ["ogrpo.train.math_rewards:no_such_reward"]})


@pytest.mark.parametrize("spec, words", [
    ("os.path:nonexistent_function", "has no attribute 'nonexistent_function'"),
    ("os.path.nonexistent_function", "has no attribute 'nonexistent_function'"),  # TRL's dotted form
    ("os:sep", "'sep' of module 'os' is not callable"),
    ("os.path:sep", "is not callable"),
])
def test_loaded_modules_resolve_names_exactly(spec, words):
    """os and os.path re-export with `import *`, which reading their source cannot follow: the module this
    process has loaded already answers, without running anything."""
    with pytest.raises(ConfigError, match=words) as exc:
        check_rewards({"reward_funcs": [spec]})
    assert len(exc.value.problems) == 1
    assert check_rewards({"reward_funcs": ["os.path:join"]}) == ["os.path:join"]


def test_a_name_bound_to_a_value_is_refused(tmp_path):
    (tmp_path / "scores.py").write_text("THRESHOLD = 0.5\nNAMES = ['a']\n\ndef score(completions, **kw):\n"
                                        "    return [1.0] * len(completions)\n\nmaybe = 1\nif THRESHOLD:\n"
                                        "    def maybe(completions, **kw):\n        return [0.0]\n")
    f = tmp_path / "scores.py"
    for attr in ("THRESHOLD", "NAMES"):
        with pytest.raises(ConfigError, match=f"'{attr}' of file .* is not callable"):
            check_rewards({"reward_funcs": [f"{f}:{attr}"]})
    # a function, and a name also bound to a function in a branch (cannot tell: the trainer's import decides)
    assert check_rewards({"reward_funcs": [f"{f}:score", f"{f}:maybe"]}) == [f"{f}:score", f"{f}:maybe"]


def test_a_reward_source_that_does_not_parse_is_refused_at_plan_time(tmp_path, monkeypatch):
    """A reward file (or module on the path) with a syntax error: the plan refuses it with its line, as the
    trainer's import would fail only on the cluster; the same file fixed is accepted."""
    bad = tmp_path / "rw.py"
    bad.write_text("def fn(:\n    return 1\n")
    with pytest.raises(ConfigError, match=r"file .*rw.py does not parse as Python 3\.\d+ \(line 1: "):
        check_rewards({"reward_funcs": [f"{bad}:fn"]})
    (tmp_path / "rwmod.py").write_text("x = 1\n\ndef fn(completions, **kw)\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"module 'rwmod' does not parse as Python 3\.\d+ \(line 3: "):
        check_rewards({"reward_funcs": ["rwmod:fn"]})
    bad.write_text("def fn(completions, **kw):\n    return [0.0] * len(completions)\n")
    assert check_rewards({"reward_funcs": [f"{bad}:fn"]}) == [f"{bad.resolve()}:fn"]
