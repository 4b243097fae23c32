"""Where generation runs, by measured cost (ogrpo/planner/costs.py): the plan weighs a vLLM server against
generation inside the trainer with the shipped per-token costs, lists its choice with the numbers, never
overrides a choice the recipe made, and weighs a bf16 server only on a CPU with bf16 matrix units."""

from __future__ import annotations

import json

import pytest

from ogrpo.config import load_run_config
from ogrpo.plan import plan_from_config
from ogrpo.planner import costs
from ogrpo.planner.types import Mode

TINY_PARAMS = 10_000_000  # near conftest's TINY_CONFIG; the table below is interpolated to the model anyway
# Inside the trainer is cheaper: HF generate about as fast as the server, and every server step pays a push.
SLOW_SERVER = {"hf_tok_s": 9000.0, "server_tok_s": 9500.0, "train_tok_s": 40000.0, "push_s": 0.08,
               "request_s": 0.02}
# The server is cheaper: HF generate crawls.
FAST_SERVER = {"hf_tok_s": 200.0, "server_tok_s": 20000.0, "train_tok_s": 40000.0, "push_s": 0.01,
               "request_s": 0.005, "server_bf16_tok_s": 40000.0}


def _table(numbers: dict) -> dict:
    return {"source": "test table", "entries": [
        {"device": "cpu", "params": TINY_PARAMS // 10, **{k: v * 10 if k.endswith("tok_s") else v / 10
                                                            for k, v in numbers.items()}},
        {"device": "cpu", "params": TINY_PARAMS, **numbers}]}


@pytest.fixture
def cost_table(monkeypatch):
    def use(numbers: dict, flags=frozenset()):
        monkeypatch.setattr(costs, "table", lambda: _table(numbers))
        monkeypatch.setattr(costs, "cpu_flags", lambda: frozenset(flags))
    return use


def _plan(write_recipe, tiny_model_dir, extra: str = "", gpus: str = "2xcpu"):
    path = write_recipe(f"model_name_or_path: {tiny_model_dir}\nper_device_train_batch_size: 8\nnum_generations: 4\n"
                        f"max_completion_length: 32\n{extra}ogrpo:\n  max_prompt_length: 32\n")
    return plan_from_config(load_run_config(path), gpus=gpus)


def _setting(plan, name):
    return next((s for s in plan.settings if s.name == name), None)


def _expected(plan, numbers: dict, bf16: bool = False) -> costs.Costs:
    return costs.estimate(_table(numbers), "cpu", plan.model.params, total=2, per_process=8, prompt_len=32,
                          completion_len=32, bf16=bf16)


def test_estimate_arithmetic():
    """The step formulas of the module docstring, on a table with one size (no interpolation)."""
    t = {"source": "s", "entries": [{"device": "cpu", "params": 100, "hf_tok_s": 100.0, "server_tok_s": 400.0,
                                     "train_tok_s": 1000.0, "push_s": 0.5, "request_s": 0.1,
                                     "server_bf16_tok_s": 800.0}]}
    c = costs.estimate(t, "cpu", 100, total=3, per_process=4, prompt_len=10, completion_len=40, bf16=False)
    train = 4 * 50 / 1000.0
    assert c.inside_s == pytest.approx(4 * 40 / 100.0 + train) and c.inside_completions == 12
    assert c.server_s == pytest.approx(0.1 + 0.5 + 2 * 4 * 40 / 400.0 + train) and c.server_completions == 8
    assert c.per_completion == pytest.approx((0.15, 0.2)) and c.server_dtype == "float32" and c.mode == "none"
    b = costs.estimate(t, "cpu", 100, total=3, per_process=4, prompt_len=10, completion_len=40, bf16=True)
    assert b.server_dtype == "bfloat16" and b.server_s == pytest.approx(0.1 + 0.5 + 2 * 4 * 40 / 800.0 + train)
    assert b.fp32_server_s == pytest.approx(c.server_s)
    # between two measured sizes: log-log (throughput 1000 at 10 params, 100 at 1000: 316 at 100)
    two = {"entries": [{"device": "cpu", "params": 10, "hf_tok_s": 1000.0},
                       {"device": "cpu", "params": 1000, "hf_tok_s": 100.0}]}
    assert costs._interp(two["entries"], "hf_tok_s", 100) == pytest.approx(1000 / 10 ** 0.5)
    # no numbers for this device kind, or a single device: no cost decision
    assert costs.estimate(t, "A40", 100, total=3, per_process=4, prompt_len=1, completion_len=1, bf16=False) is None
    assert costs.estimate(t, "cpu", 100, total=1, per_process=4, prompt_len=1, completion_len=1, bf16=False) is None


def test_choice_flips_with_the_numbers_and_is_listed(cost_table, write_recipe, tiny_model_dir):
    cost_table(SLOW_SERVER)
    p = _plan(write_recipe, tiny_model_dir)
    c = _expected(p, SLOW_SERVER)
    assert c.mode == "none"
    assert p.mode is Mode.NONE and p.trainer_args.to_dict()["use_vllm"] is False and p.trainer.num_processes == 2
    s = _setting(p, "generation")
    assert s.value.startswith("inside the trainer")
    # the numbers the choice was made with, as computed from the table
    assert f"{c.inside_s:.3f} s/step for 16 completions" in s.reason
    assert f"{c.server_s:.3f} s/step for 8" in s.reason and "test table" in s.reason
    assert not any(ch.key == "use_vllm" for ch in p.changes)  # TRL's own default: nothing changed

    cost_table(FAST_SERVER)
    p = _plan(write_recipe, tiny_model_dir)
    c = _expected(p, FAST_SERVER)
    assert c.mode == "server" and p.mode is Mode.SERVER and p.trainer_args.to_dict()["vllm_mode"] == "server"
    assert _setting(p, "generation").value == "a vLLM server"
    change = next(ch for ch in p.changes if ch.key == "use_vllm")
    assert (change.old, change.new) == (False, True) and f"{c.server_s:.3f} s/step" in change.reason
    assert p.vllm.args.to_dict()["dtype"] == "float32"  # no bf16 units on this (pretend) CPU


@pytest.mark.parametrize("extra", ["use_vllm: true\n", "vllm_mode: server\n", "ogrpo_use_vllm"],
                         ids=["use_vllm", "vllm_mode", "ogrpo.use_vllm"])
def test_user_choice_wins(cost_table, write_recipe, tiny_model_dir, extra):
    cost_table(SLOW_SERVER)  # the table says: inside the trainer
    if extra == "ogrpo_use_vllm":
        path = write_recipe(f"model_name_or_path: {tiny_model_dir}\nper_device_train_batch_size: 8\n"
                            "num_generations: 4\nmax_completion_length: 32\nogrpo:\n  use_vllm: true\n")
        p = plan_from_config(load_run_config(path), gpus="2xcpu")
    else:
        p = _plan(write_recipe, tiny_model_dir, extra)
    assert p.mode is Mode.SERVER and _setting(p, "generation") is None


def test_user_choice_wins_the_other_way(cost_table, write_recipe, tiny_model_dir):
    cost_table(FAST_SERVER)  # the table says: a server
    p = _plan(write_recipe, tiny_model_dir, "use_vllm: false\n")
    assert p.mode is Mode.NONE and _setting(p, "generation") is None


def test_bf16_server_only_with_the_cpu_flag(cost_table, write_recipe, tiny_model_dir):
    cost_table(FAST_SERVER, flags={"avx512f", "amx_bf16"})
    p = _plan(write_recipe, tiny_model_dir)
    c = _expected(p, FAST_SERVER, bf16=True)
    assert c.server_dtype == "bfloat16" and p.mode is Mode.SERVER
    assert p.vllm.args.to_dict()["dtype"] == "bfloat16"
    assert p.trainer_args.to_dict()["vllm_importance_sampling_correction"] is True
    change = next(ch for ch in p.changes if ch.key == "vllm.dtype")
    assert (change.old, change.new) == ("float32", "bfloat16")
    assert "amx_bf16" in change.reason and f"{c.server_s:.3f} s vs {c.fp32_server_s:.3f} s" in change.reason
    json.dumps(p.to_dict())  # still pure data

    cost_table(FAST_SERVER, flags={"avx512f"})  # no bf16 units
    p = _plan(write_recipe, tiny_model_dir)
    assert p.mode is Mode.SERVER and p.vllm.args.to_dict()["dtype"] == "float32"
    assert not any(ch.key == "vllm.dtype" for ch in p.changes)

    cost_table(FAST_SERVER, flags={"amx_bf16"})  # the correction turned off in the recipe: no bf16 server
    p = _plan(write_recipe, tiny_model_dir, "vllm_importance_sampling_correction: false\n")
    assert p.vllm.args.to_dict()["dtype"] == "float32"


def test_shipped_table_sends_tiny_into_the_trainer(write_recipe, tiny_model_dir):
    """The measured table reproduces what the issue saw: `tiny` on two CPUs is cheaper generating inside the
    trainer than with a server."""
    table = costs.table()
    assert table["entries"] and all(e["device"] == "cpu" for e in table["entries"])
    p = _plan(write_recipe, tiny_model_dir)
    assert p.mode is Mode.NONE and "measured per-token costs" in _setting(p, "generation").reason


def test_regenerating_some_sizes_keeps_the_others_measured_the_same_way():
    from ogrpo.bench.costs import merged

    def entry(model, params, tok, date):
        return {"device": "cpu", "model": model, "params": params, "server_tok_s": tok, "date": date}

    old = merged({}, [entry("tiny", 10, 1.0, "d1"), entry("32.5M", 1000, 2.0, "d1")], "cpu A", "w")
    new = merged(old, [entry("32.5M", 1000, 3.0, "d2")], "cpu A", "w")
    assert [(e["model"], e["server_tok_s"], e["date"]) for e in new["entries"]] == [("tiny", 1.0, "d1"),
                                                                                 ("32.5M", 3.0, "d2")]
    # another machine or workload: the old numbers are not comparable, so they go
    assert [e["model"] for e in merged(old, [entry("32.5M", 1000, 3.0, "d2")], "cpu B", "w")["entries"]] == ["32.5M"]
    assert [e["model"] for e in merged(old, [entry("32.5M", 1000, 3.0, "d2")], "cpu A", "w2")["entries"]] == ["32.5M"]
