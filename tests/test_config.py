"""Run config loading: TRL flat recipes, the ogrpo: section, collected errors, the vendored TRL field list."""

from __future__ import annotations

import json
import sys

import pytest

from ogrpo.config import FIELDS_FILE, field_table_from_trl, load_run_config
from ogrpo.errors import ConfigError


def test_vendored_fields_match_trl():
    """The vendored table equals what the installed TRL declares (regenerate: python -m ogrpo.config
    --regen-fields)."""
    vendored = json.loads(FIELDS_FILE.read_text())
    real = json.loads(json.dumps(field_table_from_trl()))
    assert vendored == real


def test_vendored_fields_match_trl_after_a_parser_was_built():
    """transformers' HfArgumentParser rewrites the dataclasses' Field.type in place (Optional[X] -> X): the table
    read after one was built in this process (another test's, or the loader's) must still say which fields take
    None. Under `make test-fast`'s two workers this test ran after such a test and failed."""
    from transformers import HfArgumentParser
    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig
    from trl.scripts.grpo import GRPOScriptArguments

    HfArgumentParser((GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig))
    assert json.loads(json.dumps(field_table_from_trl())) == json.loads(FIELDS_FILE.read_text())


def test_vendored_fields_cover_training_arguments():
    from transformers import TrainingArguments
    import dataclasses

    vendored = json.loads(FIELDS_FILE.read_text())
    ta = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    assert ta <= set(vendored["GRPOConfig"])


def test_loading_does_not_import_trl(basic_recipe):
    import subprocess

    code = (f"import sys; from ogrpo.config import load_run_config; load_run_config({str(basic_recipe)!r}); "
            "bad = [m for m in ('trl', 'torch', 'transformers', 'vllm') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_basic_recipe(basic_recipe):
    rc = load_run_config(basic_recipe)
    assert rc.trl["model_name_or_path"] == "Qwen/Qwen2.5-1.5B-Instruct"
    assert rc.trl["reward_funcs"] == ["accuracy_reward"]
    assert rc.get("num_generations") == 8
    assert rc.get("beta") == 0.0  # TRL 1.16's default, from the vendored table
    assert rc.get("vllm_mode") == "colocate"
    assert rc.warnings == []
    assert rc.source == str(basic_recipe)


def test_open_r1_recipe_loads_with_warnings(open_r1_recipe):
    rc = load_run_config(open_r1_recipe)
    warned = " ".join(rc.warnings)
    # Keys outside TRL 1.16's dataclasses are named with what happens to them (ogrpo/fields.py).
    for key in ("system_prompt", "dataset_prompt_column", "hub_model_revision", "callbacks", "benchmarks",
                "torch_dtype", "max_prompt_length", "overwrite_output_dir"):
        assert key in warned, key
    assert "dataset_prompt_column: a key of open-r1's scripts, not of TRL 1.16; mapped to ogrpo.prompt_column" in warned
    assert "callbacks: a key of open-r1's scripts; not applied" in warned
    # warmup_ratio is a GRPOConfig field of the images' TRL 1.9 (and warmup_steps' ratio form on 1.16): no warning.
    assert "warmup_ratio" not in warned
    # Loaded unchanged: every key is kept.
    assert rc.trl["system_prompt"].startswith("You are")
    assert rc.trl["num_generations"] == 16
    groups = rc.by_group()
    assert "system_prompt" in groups["other"] and "num_generations" in groups["GRPOConfig"]
    assert "model_revision" in groups["ModelConfig"] and "dataset_name" in groups["GRPOScriptArguments"]
    # open-r1's prompt column and system prompt reach the options the trainer reads.
    assert rc.ogrpo.prompt_column == "problem" and rc.ogrpo.system_prompt.startswith("You are")


def test_trl_types_and_open_r1_keys_are_accepted(write_recipe):
    # scale_rewards is typed `str` in both TRL lines, but TRL documents and maps True/False ("group"/"none").
    rc = load_run_config(write_recipe("scale_rewards: false\ndataset_name: x\ndataset_configs: [all]\n"
                                      "num_processes: 7\nvllm_data_parallel_size: 2\nlogging_dir: logs\n"
                                      "dataloader_in_order: true\ncosine_max_len: 2000\n"))
    assert rc.trl["scale_rewards"] is False
    assert rc.trl["dataset_config"] == "all"  # open-r1's list form -> TRL's single config
    with pytest.raises(ConfigError) as e:
        load_run_config(write_recipe("scale_rewards: 3\nnum_processes: many\ndataset_configss: [a]\n", "bad.yaml"))
    text = str(e.value)
    assert "scale_rewards: expected bool or str" in text and "num_processes: expected int" in text
    assert "did you mean dataset_configs?" in text


def test_explicit_ogrpo_options_win_over_open_r1_keys(write_recipe):
    rc = load_run_config(write_recipe("dataset_prompt_column: problem\nsystem_prompt: S\ndataset_config: main\n"
                                      "dataset_configs: [all]\nogrpo:\n  prompt_column: question\n"))
    assert rc.ogrpo.prompt_column == "question" and rc.ogrpo.system_prompt == "S"
    assert rc.trl["dataset_config"] == "main"
    # the key not applied is named, not said to be mapped
    assert any(w.startswith("dataset_prompt_column: 'problem' is not applied: ogrpo.prompt_column ('question')")
               for w in rc.warnings), rc.warnings
    assert not any(w.startswith("dataset_prompt_column: a key of") for w in rc.warnings), rc.warnings


@pytest.mark.parametrize("key, home, a, b", [("system_prompt", "system_prompt", "TOP", "NESTED"),
                                             ("max_prompt_length", "max_prompt_length", 100, 200),
                                             ("reward_weights", "reward_weights", [0.5], [2.0])])
def test_a_key_set_at_the_top_and_under_ogrpo_is_named_where_the_ogrpo_one_wins(write_recipe, key, home, a, b):
    rc = load_run_config(write_recipe(f"{key}: {json.dumps(a)}\nogrpo:\n  {home}: {json.dumps(b)}\n"))
    assert getattr(rc.ogrpo, home) == b
    assert any(w.startswith(f"{key}: {a!r} is not applied: ogrpo.{home} ({b!r})") for w in rc.warnings), rc.warnings


def test_errors_are_collected_once(write_recipe):
    path = write_recipe(
        "model_name_or_path: Qwen/Qwen2.5-1.5B\n"
        "learning_rat: 1e-6\n"  # misspelled
        "num_generations: many\n"  # wrong type
        "per_device_train_batch_size: 0\n"  # out of range
        "bf16: yes please\n"  # wrong type
        "frobnicate: 1\n"  # unknown
        "ogrpo:\n  gpu: 3xA40\n  profile: fast\n"
    )
    with pytest.raises(ConfigError) as e:
        load_run_config(path)
    problems = e.value.problems
    text = str(e.value)
    assert "did you mean learning_rate?" in text
    assert "num_generations: expected int" in text
    assert "per_device_train_batch_size: must be at least 1" in text
    assert "bf16: expected bool" in text
    assert "unknown key 'frobnicate'" in text
    assert "did you mean ogrpo.gpus?" in text
    assert "ogrpo.profile" in text
    assert len(problems) == 7
    assert "\n" not in text


@pytest.mark.parametrize(
    "text, words",
    [
        ("a: [1, 2\n", "malformed YAML at line"),
        ("- a\n- b\n", "top level must be a mapping"),
        ("num_generations: 1\n", "at least 2 generations"),
        ("bf16: true\nfp16: true\n", "set only one"),
        ("ogrpo: 3\n", "ogrpo: must be a mapping"),
        ("ogrpo:\n  gpus: 3xZ99\n", "unknown GPU type Z99"),
        ("ogrpo:\n  params: lots\n", "ogrpo.params"),
        ("ogrpo:\n  vllm_gpus: -1\n", "0 or more"),
    ],
)
def test_bad_configs(write_recipe, text, words):
    with pytest.raises(ConfigError, match=words):
        load_run_config(write_recipe(text))


def test_missing_file_and_recipe_names(tmp_path):
    with pytest.raises(ConfigError, match="no such file or built-in recipe"):
        load_run_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="no such file or built-in recipe"):
        load_run_config("no-such-recipe")
    with pytest.raises(ConfigError, match="not a file"):
        load_run_config(tmp_path)


def test_builtin_recipe_by_name(monkeypatch, tmp_path):
    import ogrpo.config as config

    (tmp_path / "mini.yaml").write_text("model_name_or_path: Qwen/Qwen2.5-0.5B\nnum_generations: 4\n")
    monkeypatch.setattr(config, "RECIPES_DIR", tmp_path)
    rc = load_run_config("mini")
    assert rc.trl["num_generations"] == 4 and rc.source.endswith("mini.yaml")


def test_overrides_and_ogrpo_options(basic_recipe):
    rc = load_run_config(basic_recipe, {"num_generations": 4, "seed": 7, "ogrpo": {"gpus": "3xA40", "profile": None},
                                        "ogrpo.vllm_gpus": 1})
    assert rc.trl["num_generations"] == 4 and rc.trl["seed"] == 7
    assert rc.ogrpo.gpus == "3xA40" and rc.ogrpo.vllm_gpus == 1 and rc.ogrpo.profile is None


def test_yaml_round_trip(basic_recipe, tmp_path):
    rc = load_run_config(basic_recipe, {"ogrpo": {"gpus": "2xcpu", "reward_weights": [1.0, 0.5]}})
    out = tmp_path / "again.yaml"
    out.write_text(rc.to_yaml())
    again = load_run_config(out)
    assert again.trl == rc.trl and again.ogrpo == rc.ogrpo
    assert again.to_dict()["ogrpo"] == {"gpus": "2xcpu", "reward_weights": [1.0, 0.5]}


def test_quoted_numbers_are_accepted(write_recipe):
    # YAML 1.1 reads 1e-6 (no dot) as a string; TRL's parser accepts it, so do we.
    rc = load_run_config(write_recipe("learning_rate: 1e-6\n"))
    assert rc.trl["learning_rate"] == 1e-6 and isinstance(rc.trl["learning_rate"], float)
