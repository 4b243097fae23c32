"""Recipe values typed as `trl grpo --config` types them, ranges, and bad input.

The typing tests are generated from the field table (every field the loader accepts, with its kinds), and the
conversions are compared with TRL's own parser (TrlParser over the dataclasses `trl grpo` parses), so a value
that plans is the value the job's GRPOConfig gets.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from ogrpo.config import _field_index, load_run_config
from ogrpo.errors import ConfigError
from ogrpo.values import RANGES

MODEL = {"model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"}


def _typed_fields() -> dict[str, tuple[str, ...]]:
    """Every key the loader accepts whose kinds constrain the value."""
    return {k: tuple(info["kinds"]) for k, info in _field_index().items() if "any" not in info["kinds"]}


def _named(problems: list[str]) -> set[str]:
    return {p.split(":", 1)[0] for p in problems}


def _wrong_value(kinds: tuple[str, ...]):
    """A value of a kind the field does not take (int counts as float, as in TRL)."""
    for value, kind in (({"x": 1}, "dict"), ([1], "list"), (1.5, "float"), (True, "bool"), ("zz", "str")):
        if kind not in kinds:
            return value
    raise AssertionError(f"no wrong value for {kinds}")


def test_every_typed_field_refuses_a_value_of_another_kind():
    fields = _typed_fields()
    assert len(fields) > 250  # both TRL lines' GRPOConfig, ModelConfig, script arguments, open-r1 keys
    bad = {k: _wrong_value(kinds) for k, kinds in fields.items()}
    with pytest.raises(ConfigError) as e:
        load_run_config({**MODEL, **bad})
    named = _named(e.value.problems)
    assert set(bad) - {"model_name_or_path"} <= named, sorted(set(bad) - named)
    assert "\n" not in str(e.value)


def _by_kind(kind: str) -> list[str]:
    """Fields whose only value kind (besides null) is `kind`."""
    return sorted(k for k, kinds in _typed_fields().items() if set(kinds) - {"none"} == {kind})


def test_strings_are_converted_as_trls_parser_converts_them():
    ints, floats, bools = _by_kind("int"), _by_kind("float"), _by_kind("bool")
    assert len(ints) >= 40 and len(floats) >= 40 and len(bools) >= 60
    rc = load_run_config({**MODEL, **{k: "7" for k in ints}, **{k: " 0.5 " for k in floats},
                          **{k: "No" for k in bools}})
    for k in ints:
        assert rc.trl[k] == 7 and type(rc.trl[k]) is int, k
    for k in floats:
        assert rc.trl[k] == 0.5 and type(rc.trl[k]) is float, k
    for k in bools:
        assert rc.trl[k] is False, k
    # YAML 1.1 reads 1e-6 (no dot) as a string; TRL's float() makes it a number
    assert load_run_config({**MODEL, "learning_rate": "1e-6"}).trl["learning_rate"] == 1e-6
    for truthy in ("yes", "TRUE", "t", "y", "1"):
        assert load_run_config({**MODEL, "use_vllm": truthy}).trl["use_vllm"] is True


def test_strings_trls_parser_refuses_are_refused():
    ints, bools = _by_kind("int"), _by_kind("bool")
    with pytest.raises(ConfigError) as e:
        load_run_config({**MODEL, **{k: "7.5" for k in ints}})
    assert set(ints) <= _named(e.value.problems)
    with pytest.raises(ConfigError) as e:
        load_run_config({**MODEL, **{k: "1e3" for k in ints}})
    assert set(ints) <= _named(e.value.problems)
    with pytest.raises(ConfigError) as e:
        load_run_config({**MODEL, **{k: "maybe" for k in bools}})
    assert set(bools) <= _named(e.value.problems)


def test_conversions_match_trls_own_parser():
    """The same YAML values through TRL's TrlParser (the dataclasses `trl grpo` parses): equal results, and the
    strings it refuses are the ones the loader refuses."""
    from trl_parser_checks import Refused, converts_like_trl, trl_parser

    parser = trl_parser()
    dests = {a.dest for a in parser._actions}
    ints = [k for k in _by_kind("int") if k in dests]
    floats = [k for k in _by_kind("float") if k in dests]
    bools = [k for k in _by_kind("bool") if k in dests]
    assert len(ints) >= 30 and len(floats) >= 30 and len(bools) >= 50
    recipe = converts_like_trl(parser, ints, floats, bools)
    for k in ints[:: max(1, len(ints) // 8)]:  # a sample: each refusal is one parse
        parser.set_defaults_with_config(**{**recipe, k: "7.5"})
        with pytest.raises(Refused):
            parser.parse_known_args([])
        with pytest.raises(ConfigError, match=k):
            load_run_config({**MODEL, k: "7.5"})


def _outside(lo, lo_in, hi, hi_in, is_int):
    """(a value just outside the range, a value on its boundary that is inside)."""
    step = 1 if is_int else 1e-9
    if lo is not None:
        return (lo - step if lo_in else lo), (lo if lo_in else lo + step)
    return (hi + step if hi_in else hi), (hi if hi_in else hi - step)


def test_range_boundaries_from_the_table():
    index = _field_index()
    checked = 0
    for key, (lo, lo_in, hi, hi_in) in RANGES.items():
        if key not in index:
            continue
        is_int = "float" not in index[key]["kinds"]
        for bounds in ((lo, lo_in, None, False), (None, False, hi, hi_in)):
            if bounds[0] is None and bounds[2] is None:
                continue
            out, edge = _outside(*bounds, is_int)
            with pytest.raises(ConfigError) as e:
                load_run_config({**MODEL, key: out})
            assert _named(e.value.problems) == {key}, (key, out)
            extra = {"num_generations": 2} if key == "per_device_train_batch_size" else {}
            assert load_run_config({**MODEL, key: edge, **extra}).trl[key] == edge, (key, edge)
            checked += 1
    assert checked >= 45
    # every number field refuses NaN and infinities (a NaN learning rate trains nothing)
    numbers = [k for k, kinds in _typed_fields().items() if "float" in kinds]
    for bad in (math.nan, math.inf, "nan", "-inf"):
        with pytest.raises(ConfigError) as e:
            load_run_config({**MODEL, **{k: bad for k in numbers}})
        assert set(numbers) <= _named(e.value.problems)


@pytest.mark.parametrize("value, ok", [(1.5, False), (-0.1, False), (0, False), (1, True), (0.01, True)])
def test_vllm_gpu_memory_utilization_is_a_share(value, ok):
    if ok:
        assert load_run_config({**MODEL, "vllm_gpu_memory_utilization": value}).trl[
            "vllm_gpu_memory_utilization"] == value
    else:
        with pytest.raises(ConfigError, match=r"vllm_gpu_memory_utilization: must be in \(0, 1\]"):
            load_run_config({**MODEL, "vllm_gpu_memory_utilization": value})


def test_json_object_strings_are_parsed_as_trl_parses_them(tiny_model_dir, tmp_path):
    """model_init_kwargs, generation_kwargs, ... may be JSON object strings: TRL's GRPOConfig parses them. The loader
    parses them the same way, so the plan reads them (before, a dtype there was not planned for, and the trainer
    failed at start with a traceback) and TRL 1.9, which does not parse generation_kwargs, gets the mapping too.
    A string that is no JSON object is refused in one line."""
    from ogrpo.plan import plan_from_config
    from ogrpo.trainer.settings import grpo_config_kwargs

    rc = load_run_config({"model_name_or_path": str(tiny_model_dir), "generation_kwargs": '{"min_tokens": 1}',
                          "model_init_kwargs": '{"dtype": "float32", "low_cpu_mem_usage": true}'})
    assert rc.trl["generation_kwargs"] == {"min_tokens": 1}
    assert rc.trl["model_init_kwargs"] == {"dtype": "float32", "low_cpu_mem_usage": True}
    plan = plan_from_config(rc, gpus="cpu")
    kwargs, _ = grpo_config_kwargs(rc.trl, plan, tmp_path)
    assert kwargs["model_init_kwargs"]["low_cpu_mem_usage"] is True
    plan_from_config(rc, gpus="4xV100-32G")  # TRL 1.9.2's line: a mapping, which it takes
    for key, value, words in (("model_init_kwargs", "dtype=float32", "is no mapping"),
                              ("lr_scheduler_kwargs", "[1]", "is no mapping"),
                              ("generation_kwargs", '{"top_k": 5', "is not valid JSON")):
        with pytest.raises(ConfigError, match=rf"{key}: .* {words}"):
            load_run_config({"model_name_or_path": str(tiny_model_dir), key: value})


def test_rendered_values_are_typed_and_trl_builds_them(run_cli, write_recipe, tmp_path):
    path = write_recipe("model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct\ndataset_name: ogrpo:tiny\n"
                        "reward_funcs: [tiny_letter]\nlearning_rate: 1e-6\nper_device_train_batch_size: '8'\n"
                        "num_generations: '8'\nlogging_steps: '1'\nuse_vllm: 'no'\n")
    out = run_cli("render", "--gpus", "cpu-64G", "--config", path, "--dry-run", "--json", check_rc=0)
    run_yaml = json.loads(out.stdout)["files"]["run.yaml"]
    (tmp_path / "run.yaml").write_text(run_yaml)
    rc = load_run_config(tmp_path / "run.yaml")
    assert rc.trl["per_device_train_batch_size"] == 8 and rc.trl["learning_rate"] == 1e-6
    assert "per_device_train_batch_size: 8\n" in run_yaml and "learning_rate: 1.0e-06\n" in run_yaml
    from ogrpo.planner.types import Plan
    from ogrpo.trainer.settings import build_grpo_config

    cfg = build_grpo_config(rc.trl, Plan.from_dict(rc.plan), tmp_path / "run")
    assert cfg.per_device_train_batch_size == 8 and cfg.learning_rate == 1e-6 and cfg.use_vllm is False


# --- bad input ----------------------------------------------------------------------------------------------


def test_duplicate_keys(write_recipe):
    with pytest.raises(ConfigError, match=r"duplicate key 'learning_rate' with another value \(first set at line 1\)"
                                          r".* at line 3"):
        load_run_config(write_recipe("learning_rate: 1.0e-6\nseed: 1\nlearning_rate: 2.0e-6\n"))
    with pytest.raises(ConfigError, match="duplicate key 'gpus'"):
        load_run_config(write_recipe("seed: 1\nogrpo:\n  gpus: 3xA40\n  gpus: 4xA40\n"))
    # the same value twice (open-r1's recipes repeat `do_eval: false`) changes nothing: a warning
    rc = load_run_config(write_recipe("do_eval: false\nseed: 1\ndo_eval: false\n"))
    assert rc.trl["do_eval"] is False
    assert any("'do_eval' is set twice to the same value (lines 1 and 3)" in w for w in rc.warnings)


def test_ogrpo_section_must_be_a_mapping(write_recipe):
    for text in ("ogrpo: [x]\n", "ogrpo: 3\n", "ogrpo: text\n"):
        # with command-line options merged (what plan/render/submit do) as well as without
        for overrides in (None, {"ogrpo": {"gpus": "3xA40"}}, {"ogrpo.profile": "balanced"}):
            with pytest.raises(ConfigError, match="ogrpo: must be a mapping"):
                load_run_config(write_recipe(text), overrides)


BAD_FILES = {
    "latin1": "model_name_or_path: Qwen/Qwen2.5-0.5B\nsystem_prompt: caf\xe9\n".encode("latin-1"),
    "utf16": "seed: 1\n".encode("utf-16"),
    "binary": bytes(range(256)),
    "nul": b"seed: 1\x00\n",
    "empty": b"",
    "list": b"- a\n- b\n",
    "scalar": b"just text\n",
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "deep_map": b"a:\n" + b"".join(b" " * (i + 1) + b"a:\n" for i in range(200)),
    "dup": b"seed: 1\nseed: 2\n",
    "ogrpo_list": b"model_name_or_path: Qwen/Qwen2.5-0.5B\nogrpo: [x]\n",
    "bad_tag": b"seed: !!python/object:os.system ls\n",
    "timestamp": b"seed: 2001-13-45\n",
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_files_exit_2_with_one_line_and_json(run_cli, tmp_path, name):
    path = tmp_path / "bad.yaml"
    path.write_bytes(BAD_FILES[name])
    proc = run_cli("plan", "--gpus", "3xA40", "--config", path, "--json")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("error: ") and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    d = json.loads(proc.stdout)
    assert d["exit_code"] == 2 and d["errors"] and all(isinstance(m, str) for m in d["errors"])


def test_random_bytes_never_escape_as_a_traceback(tmp_path):
    """Fuzz: random byte strings and mutated recipes through the loader; each is a ConfigError with a one-line
    message (or a valid config). Bounded, seeded."""
    rng = random.Random(23)
    seeds = [b"model_name_or_path: Qwen/Qwen2.5-1.5B\nlearning_rate: 1.0e-6\nnum_generations: 8\nreward_funcs: "
             b"[accuracy]\n", b"ogrpo:\n  gpus: 3xA40\n  vllm_gpus: 1\n", b"a: [1, {b: 2}]\n"]
    path = tmp_path / "fuzz.yaml"
    errors = 0
    for i in range(400):
        if i % 2:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        else:
            data = bytearray(rng.choice(seeds))
            for _ in range(rng.randrange(1, 8)):
                pos = rng.randrange(len(data) + 1)
                data[pos:pos + rng.randrange(0, 3)] = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 4)))
            data = bytes(data)
        path.write_bytes(data)
        try:
            load_run_config(path)
        except ConfigError as exc:
            errors += 1
            assert "\n" not in str(exc) and str(exc).startswith(str(path)), (data, str(exc))
    assert errors > 300


@pytest.mark.parametrize("command", ["plan", "render", "submit"])
def test_json_is_one_object_on_every_exit(run_cli, write_recipe, tmp_path, command):
    extra = {"render": ["--dry-run"], "submit": ["--dry-run", "--backend", "local"], "plan": []}[command]
    bad = write_recipe("model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct\nlearning_rate: .nan\n", "bad.yaml")
    proc = run_cli(command, "--gpus", "cpu", "--config", bad, "--json", *extra)
    assert proc.returncode == 2
    d = json.loads(proc.stdout)
    assert d["errors"] == [f"{bad}: learning_rate: must be a finite number (got nan)"]
    usage = run_cli(command, "--gpus", "cpu", "--config", bad, "--json", "--no-such-option")
    assert usage.returncode == 2 and "No such option" in json.loads(usage.stdout)["errors"][0]
    good = write_recipe("model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct\ndataset_name: ogrpo:tiny\n"
                        "reward_funcs: [tiny_letter]\n", "good.yaml")
    ok = run_cli(command, "--gpus", "cpu-64G", "--config", good, "--json", *extra)
    assert ok.returncode == 0, ok.stderr
    d = json.loads(ok.stdout)
    assert "errors" not in d and isinstance(d, dict)


def test_enum_choices_are_the_installed_transformers():
    """The vendored choices of this environment's TRL line equal what its TRL and transformers accept (CI's second
    environment checks the images' line the same way); regenerate: python ogrpo/data/vendor_trl_fields.py
    --choices ogrpo/data/trl_choices.json."""
    from importlib import metadata

    from ogrpo.data.vendor_trl_fields import installed_choices
    from ogrpo.values import _choices

    line = ".".join(metadata.version("trl").split(".")[:2])
    assert _choices()[line] == installed_choices()


def test_enum_fields_accept_their_choices_and_refuse_others(tiny_model_dir):
    from ogrpo.plan import plan_from_config
    from ogrpo.values import _choices

    for line, table in _choices().items():
        for key, allowed in table.items():
            for value in allowed:
                assert load_run_config({**MODEL, key: value}).trl[key] == value
            with pytest.raises(ConfigError, match=f"{key}: 'no-such-{key}' is not a value"):
                load_run_config({**MODEL, key: f"no-such-{key}"})
    # a value only one line's transformers has is refused for a plan on the other line
    only_gpu = sorted(set(_choices()["1.9"]["optim"]) - set(_choices()["1.16"]["optim"]))
    if only_gpu:
        rc = load_run_config({"model_name_or_path": str(tiny_model_dir), "optim": only_gpu[0]})
        with pytest.raises(ConfigError, match=r"optim: .* TRL 1\.16\.0"):
            plan_from_config(rc, gpus="cpu")
    only_cpu = sorted(set(_choices()["1.16"]["train_sampling_strategy"])
                      - set(_choices()["1.9"]["train_sampling_strategy"]))
    assert only_cpu, "TRL 1.16's transformers has a sampling strategy 1.9's lacks"
    rc = load_run_config({"model_name_or_path": str(tiny_model_dir), "train_sampling_strategy": only_cpu[0]})
    plan_from_config(rc, gpus="cpu")  # the CPU stack's line has it: planned, not refused
    with pytest.raises(ConfigError, match=r"train_sampling_strategy: .* TRL 1\.9\.2"):
        plan_from_config(rc, gpus="1xA40")


def test_trls_own_string_options_are_checked_at_plan_time_on_both_lines():
    """loss_type, scale_rewards, importance_sampling_level, multi_objective_aggregation: TRL's trainer only compares
    them, so a typo fails at the first loss, after the job queued and loaded its model; an unknown
    vllm_importance_sampling_mode silently neither truncates nor masks. Each line lists every loss type."""
    from ogrpo.values import _choices

    losses = {"grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"}
    for line, table in _choices().items():
        assert set(table["loss_type"]) == losses, line
        assert set(table["scale_rewards"]) == {"group", "batch", "none"}, line
        assert set(table["importance_sampling_level"]) == {"token", "sequence"}, line
        assert {"token_truncate", "token_mask", "sequence_truncate", "sequence_mask"} \
            == set(table["vllm_importance_sampling_mode"]), line
        assert set(table["multi_objective_aggregation"]) == {"sum_then_normalize", "normalize_then_sum"}, line
    with pytest.raises(ConfigError, match=r"loss_type: 'dr-grpo' is not a value TRL accepts; did you mean 'dr_grpo'"):
        load_run_config({**MODEL, "loss_type": "dr-grpo"})
    with pytest.raises(ConfigError, match=r"vllm_importance_sampling_mode: 'token_clip'"):
        load_run_config({**MODEL, "vllm_importance_sampling_mode": "token_clip"})
    assert load_run_config({**MODEL, "scale_rewards": False}).trl["scale_rewards"] is False  # TRL maps it: "none"


def test_report_to_names_an_integration_transformers_has(run_cli, tmp_path):
    """report_to: a name transformers has no callback for fails when the trainer builds its callbacks, after the
    job queued and loaded its model; the plan refuses it, alone or in a list, and takes the real ones."""
    from ogrpo.values import _choices

    for line, table in _choices().items():
        assert {"wandb", "tensorboard", "mlflow", "all", "none"} <= set(table["report_to"]), line
    for ok in ("none", "all", "wandb", ["wandb", "tensorboard"], []):
        assert load_run_config({**MODEL, "report_to": ok}).trl["report_to"] == ok
    for bad in ("nonsense", ["wandb", "nonsense"]):
        with pytest.raises(ConfigError, match=r"report_to: 'nonsense' is not a value TRL accepts; did you mean 'none'"):
            load_run_config({**MODEL, "report_to": bad})
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: ogrpo:tiny\ndataset_name: ogrpo:tiny\nreward_funcs: [tiny_letter]\n"
                      "report_to: [wandb, tensorbord]\n")
    proc = run_cli("plan", "--gpus", "cpu", "--config", recipe)
    assert proc.returncode == 2 and "did you mean 'tensorboard'" in proc.stderr, proc.stderr


def test_the_choices_are_read_from_the_comparisons_in_trls_source(tmp_path):
    """What the scan of TRL's sources takes: constants an attribute of that name is compared with, alone or in a
    list, on either side; not other attributes, not a comparison with a variable."""
    from ogrpo.data.vendor_trl_fields import compared_values

    src = tmp_path / "t.py"
    src.write_text("if self.loss_type == 'grpo' or args.loss_type in ['dapo', ('x')]:\n    pass\n"
                   "elif 'sapo' != self.loss_type: pass\n"
                   "if self.loss_type == name or self.loss_type == f'{a}': pass\n"
                   "if self.other == 'nope' or self.loss_type not in ('cispo',): pass\n"
                   "if self.scale_rewards < 'z': pass\n")
    assert compared_values([src], ("loss_type", "scale_rewards")) == {
        "loss_type": {"grpo", "dapo", "x", "sapo", "cispo"}, "scale_rewards": {"z"}}


def test_plan_refuses_a_loss_type_typo_in_one_line(run_cli, tmp_path):
    recipe = tmp_path / "run.yaml"
    recipe.write_text("model_name_or_path: ogrpo:tiny\ndataset_name: ogrpo:tiny\nreward_funcs: [tiny_letter]\n"
                      "loss_type: grpoo\n")
    r = run_cli("plan", "--gpus", "cpu", "--config", str(recipe))
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "loss_type: 'grpoo'" in lines[0] and "did you mean 'grpo'" in lines[0], r.stderr
    assert "Traceback" not in r.stderr
