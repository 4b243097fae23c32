"""OgrpoGRPOTrainer (ogrpo/trainer/grpo.py): one subclass of TRL's GRPOTrainer whose layers are its bases.

- the layers stand in the class in the order ogrpo/trainer/overrides.py states, and override only the methods it
  lists (its `check()` holds each TRL line to those);
- a layer that is off is TRL's method: arguments and result pass through untouched;
- nowhere in ogrpo/ is a method of TRL's trainer replaced on an instance, and no `_ogrpo_*` attribute is set on
  another library's object outside the patches (ogrpo/patches/, and the patch modules registered elsewhere);
- a TRL line that drops or reshapes an overridden method fails the check, one line per change.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from ogrpo import patches
from ogrpo.patches.target import PatchTargetMoved
from ogrpo.trainer import overrides

# TRL is part of the test environment (.venv, the train extra): its absence is a failure, not a skip.
import trl  # noqa: E402

from ogrpo.trainer.grpo import LAYERS, OgrpoGRPOTrainer  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[1] / "ogrpo"


def _defining_layers(method: str) -> tuple[str, ...]:
    names = {cls: name for name, cls in LAYERS.items()}
    return tuple(names[c] for c in OgrpoGRPOTrainer.__mro__ if c in names and method in vars(c))


def test_the_layers_are_the_bases_in_the_stated_order_and_override_only_the_listed_methods():
    mro = [c for c in OgrpoGRPOTrainer.__mro__ if c in LAYERS.values()]
    assert mro == list(LAYERS.values())
    assert OgrpoGRPOTrainer.__mro__.index(trl.GRPOTrainer) == len(LAYERS) + 1  # every layer above TRL's class
    trl_names = set(dir(trl.GRPOTrainer))
    overridden = {name for layer in LAYERS.values() for name in vars(layer) if name in trl_names
                  and not name.startswith("__")}
    assert overridden == set(overrides.OVERRIDES)
    for method, (layers, _) in overrides.OVERRIDES.items():
        assert _defining_layers(method) == layers, method  # outermost first, as the table says
    # each layer's state: declared on the layer, listed for the check (TRL's class must not have those names)
    state = {name for layer in LAYERS.values() for name, value in vars(layer).items()
             if not name.startswith("__") and not callable(value) and name not in trl_names}
    assert state <= set(overrides.STATE), state - set(overrides.STATE)


class _Recorder:
    """TRL's methods as a stand-in: each records its arguments and returns a marker."""

    def __init__(self):
        self.calls = []


def _trl_stand_in():
    methods = {}
    for method in overrides.OVERRIDES:
        def fn(self, *args, _name=method, **kwargs):
            self.calls.append((_name, args, kwargs))
            return ("trl", _name)
        methods[method] = fn
    return type("TrlStandIn", (_Recorder,), methods)


def test_every_layer_off_is_trls_method():
    Trainer = type("Off", (*LAYERS.values(), _trl_stand_in()), {})
    trainer = Trainer()
    for method in overrides.OVERRIDES:
        args, kwargs = (object(), object(), object(), object()), {"batch_size": 2}
        if method in ("get_batch_samples", "_calculate_rewards", "_log_completion_extra", "_log_metric",
                      "_save_checkpoint"):
            kwargs = {}  # overrides that name every parameter TRL's method has
            args = args[:len(overrides.OVERRIDES[method][1])]
        elif method in ("_generate", "_generate_and_score_completions", "_save_rng_state", "_load_rng_state",
                        "_get_output_dir"):
            args = args[:1]
        trainer.calls.clear()
        assert getattr(trainer, method)(*args, **kwargs) == ("trl", method), method
        assert trainer.calls == [(method, args, kwargs)], method


def _assigned_attributes(tree: ast.AST):
    """(attribute name, line) of every `x.attr = ...` and `setattr(x, "attr", ...)` in a module."""
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store):
                    yield t.attr, t.lineno
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
            yield str(node.args[1].value), node.lineno


def test_no_trainer_method_is_replaced_on_an_instance_and_no_foreign_ogrpo_attribute_outside_the_patches():
    methods = {n for n in dir(trl.GRPOTrainer) if callable(getattr(trl.GRPOTrainer, n, None))}
    patch_files = {PACKAGE / "patches"} | {PACKAGE.parent / (m.replace(".", "/") + ".py")
                                           for m in patches.ELSEWHERE.values()}
    replaced, foreign = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE.parent))
        in_patches = any(path == f or f in path.parents for f in patch_files)
        for name, line in _assigned_attributes(ast.parse(path.read_text())):
            if name in methods:
                replaced.append(f"{where}:{line} sets .{name}")
            if name.startswith("_ogrpo_") and not in_patches:
                foreign.append(f"{where}:{line} sets .{name}")
    assert replaced == [] and foreign == []


def test_the_overrides_check_names_each_changed_method_in_one_line(monkeypatch):
    from transformers import Trainer

    overrides.check()  # the installed line has every method, parameter and free state name
    monkeypatch.delattr(trl.GRPOTrainer, "_generate")

    def _calculate_rewards(self, inputs, prompts, completions):  # a parameter renamed away
        raise AssertionError("never called")

    monkeypatch.setattr(trl.GRPOTrainer, "_calculate_rewards", _calculate_rewards)

    def _save_checkpoint(self, model, trial):  # builds its paths another way
        return None

    monkeypatch.setattr(trl.GRPOTrainer, "_save_checkpoint", _save_checkpoint)
    monkeypatch.setattr(Trainer, "_save_checkpoint", _save_checkpoint)
    monkeypatch.setattr(trl.GRPOTrainer, "timeline", None, raising=False)  # TRL took one of our state names
    with pytest.raises(PatchTargetMoved) as info:
        overrides.check()
    text = str(info.value)
    assert text.startswith(f"patch {overrides.NAME} cannot apply to trl {trl.__version__}: ")
    problems = text.split(": ", 1)[1].split("; ")
    assert len(problems) == 4, problems
    assert "GRPOTrainer._generate is gone" in problems[0]
    assert "_calculate_rewards lost its `completion_ids_list` parameter" in problems[1]
    assert "_save_checkpoint no longer contains `self._get_output_dir(trial=trial)`" in problems[2]
    assert "has its own `timeline`" in problems[3]


def test_the_assembly_turns_layers_on_through_the_class():
    """What ogrpo.trainer.assembly calls exists on the class (a rename there is a failure here, not at a run's start)."""
    for name in ("use_linear_logprobs", "pipeline_generation", "guard_nonfinite", "stage_checkpoints",
                 "rewards_beneath", "logps_beneath"):
        assert callable(getattr(OgrpoGRPOTrainer, name)), name
    assert inspect.signature(OgrpoGRPOTrainer.pipeline_generation).parameters.keys() >= {"mode", "stream"}
