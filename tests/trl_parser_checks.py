"""The one comparison of recipe value conversion between a TRL line's own TrlParser and O-GRPO's loader, run in
each environment (TRL 1.16 in tests/test_config_values.py, TRL 1.9.2 in tests/trl19/test_trl19_values.py)."""

from __future__ import annotations

from ogrpo.config import load_run_config

MODEL = {"model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"}


class Refused(Exception):
    """TrlParser refused a value (argparse would have exited)."""


def trl_parser():
    """`trl grpo`'s parser over its dataclasses, raising Refused where argparse would exit."""
    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser
    from trl.scripts.grpo import GRPOScriptArguments

    parser = TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig))

    def fail(message):
        raise Refused(message)

    parser.error = fail
    return parser


def converts_like_trl(parser, ints: list[str], floats: list[str], bools: list[str]) -> dict:
    """String values for every int/float/bool field through TRL's parser and through the loader: equal values of
    equal types. Returns the recipe used."""
    recipe = {**{k: "7" for k in ints}, **{k: "0.5" for k in floats}, **{k: "no" for k in bools},
              "learning_rate": "1e-6"}
    parser.set_defaults_with_config(**recipe)
    ns, _ = parser.parse_known_args([])
    ours = load_run_config({**MODEL, **recipe}).trl
    for k in recipe:
        assert getattr(ns, k) == ours[k] and type(getattr(ns, k)) is type(ours[k]), k
    return recipe
