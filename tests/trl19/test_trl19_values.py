"""The images' TRL line (1.9.2) types recipe values as the loader does: its TrlParser converts the same strings
to the same values, its transformers' enums are the vendored choices, and the typed values a GPU plan renders
construct its GRPOConfig."""

from __future__ import annotations

import pytest

from ogrpo.config import _field_index, load_run_config
from ogrpo.errors import ConfigError

MODEL = {"model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"}


def _only(kind: str, dests: set[str]) -> list[str]:
    return sorted(k for k, info in _field_index().items()
                  if set(info["kinds"]) - {"none"} == {kind} and k in dests)


def test_trl19_parser_converts_as_the_loader():
    from trl_parser_checks import Refused, converts_like_trl, trl_parser

    parser = trl_parser()
    dests = {a.dest for a in parser._actions}
    ints, floats, bools = _only("int", dests), _only("float", dests), _only("bool", dests)
    assert len(ints) >= 25 and len(floats) >= 25 and len(bools) >= 40
    recipe = converts_like_trl(parser, ints, floats, bools)
    parser.set_defaults_with_config(**{**recipe, ints[0]: "7.5"})
    with pytest.raises(Refused):
        parser.parse_known_args([])
    with pytest.raises(ConfigError, match=ints[0]):
        load_run_config({**MODEL, ints[0]: "7.5"})


def test_trl19_enum_choices_are_vendored():
    from ogrpo.data.vendor_trl_fields import installed_choices
    from ogrpo.values import _choices

    assert _choices()["1.9"] == installed_choices()


def test_a_gpu_plans_typed_values_construct_trl19s_grpo_config(tmp_path):
    from ogrpo.plan import plan_from_config
    from ogrpo.trainer.settings import grpo_config_kwargs

    rc = load_run_config({**MODEL, "per_device_train_batch_size": "8", "num_generations": "8",
                          "learning_rate": "1e-6", "top_k": None, "use_liger_loss": "false"})
    plan = plan_from_config(rc, gpus="3xA40")
    kwargs, _ = grpo_config_kwargs(rc.trl, plan, tmp_path / "run")
    for key in ("tf32", "bf16", "optim", "dataloader_num_workers", "torch_compile"):
        kwargs.pop(key, None)  # GPU-only settings: this CPU machine cannot construct them
    kwargs["use_cpu"] = True
    from trl import GRPOConfig

    cfg = GRPOConfig(**kwargs)
    assert (cfg.per_device_train_batch_size, cfg.learning_rate, cfg.top_k) == (8, 1e-6, 0)
