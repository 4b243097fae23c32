"""The one-home modules: dtype names, sequence lengths, placeholder filling, job directory layout."""

from __future__ import annotations

import pytest

from ogrpo import dtypes, layout, lengths
from ogrpo.errors import OgrpoError
from ogrpo.placeholders import PLACEHOLDERS, fill_argv, fill_text


@pytest.mark.parametrize("spelling,torch_name,precision,vllm", [
    ("fp32", "float32", "fp32", "float32"), ("float", "float32", "fp32", "float32"),
    ("torch.bfloat16", "bfloat16", "bf16", "bfloat16"), ("BF16", "bfloat16", "bf16", "bfloat16"),
    ("half", "float16", "fp16", "half"), ("float16", "float16", "fp16", "half"),
])
def test_every_spelling_maps_to_each_vocabulary(spelling, torch_name, precision, vllm):
    assert dtypes.torch_name(spelling) == torch_name
    assert dtypes.precision(spelling) == precision
    assert dtypes.vllm_name(spelling) == vllm
    flags = dtypes.trainer_flags(spelling)
    assert flags == {"bf16": precision == "bf16", "fp16": precision == "fp16"}
    assert dtypes.from_trainer_flags(flags) == (None if precision == "fp32" else torch_name)


def test_unknown_dtype_is_a_one_line_error_and_auto_only_when_allowed():
    with pytest.raises(OgrpoError, match="unknown dtype 'int8'"):
        dtypes.torch_name("int8")
    with pytest.raises(OgrpoError):
        dtypes.torch_name("auto")
    assert dtypes.torch_name("auto", allow_auto=True) == "auto" and dtypes.vllm_name("auto") == "auto"
    assert dtypes.nbytes("bf16") == 2 and dtypes.nbytes("auto", default=4.0) == 4.0


def test_lengths_budget_prompt_and_cap_it_to_the_model():
    assert lengths.budget({}) == (512, 512)
    assert lengths.budget({"max_completion_length": 256}, max_positions=600) == (344, 256)  # capped to the room
    assert lengths.budget({"max_completion_length": 256, "max_prompt_length": 900}, 100) == (100, 256)  # option wins
    assert lengths.budget({"max_completion_length": 590}, max_positions=600) == (512, 590)  # < 16 left: default
    assert lengths.required_max_model_len({"max_completion_length": 64}) == 576
    assert lengths.required_max_model_len({"vllm_max_model_length": 99}) == 99
    from ogrpo.hardware import parse_gpus
    from ogrpo.planner.types import Plan

    plan = Plan.from_dict({"cluster": parse_gpus("cpu").to_dict(), "batch": {"max_model_len": 300}})
    assert lengths.required_max_model_len({}, {"max_prompt_length": 10}, plan) == 300  # the Plan's, when it has one
    assert lengths.required_max_model_len({"max_completion_length": 64}, {"max_prompt_length": 10}) == 74


def test_step_placeholders_fill_only_their_names():
    argv = ["--port", "{server_port}", '{"backend": "x"}', "{node_rank}", "{unknown}"]
    assert fill_argv(argv, {"server_port": 7, "node_rank": 1}) == ["--port", "7", '{"backend": "x"}', "1",
                                                                   "{unknown}"]
    assert fill_text("{job_dir}/run", {}) == "{job_dir}/run"  # no value: left for a later filler
    assert "job_dir" in PLACEHOLDERS


def test_layout_paths(tmp_path):
    assert layout.step_logs(tmp_path) == tmp_path / "run" / "logs"
    assert layout.roles_dir(tmp_path) == tmp_path / "run" / "roles"
    assert layout.slurm_output(tmp_path, 12) == tmp_path / "logs" / "slurm-12.out"
    assert layout.ports_file(tmp_path) == tmp_path / "run" / "ports.json"
    assert set(layout.JOB_SUBDIRS) == {"slurm", "logs", "run/logs", "run/roles"}
