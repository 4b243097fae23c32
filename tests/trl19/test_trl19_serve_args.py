"""What `ogrpo serve` and `ogrpo train` hand TRL 1.9.2, checked by TRL 1.9.2 itself: the `trl vllm-serve` command
line parsed by its own parser (unknown flags are errors there), and the GRPOConfig kwargs of GPU plans built
into its real GRPOConfig. Nothing is patched: the flavor comes from the installed TRL."""

from __future__ import annotations

import json

import pytest
import yaml

from ogrpo import compat
from ogrpo.config import load_run_config
from ogrpo.plan import plan_from_config
from ogrpo.serve.server import build_server_argv, resolve_settings, serve

GPU_PLANS = [("4xV100-32G", None, "float16"), ("3xA40", None, "bfloat16"),
             ("2x8xA100-80G", "Qwen/Qwen2.5-7B-Instruct", "bfloat16")]


def _trl_parse(argv):
    from trl.scripts.vllm_serve import make_parser

    (args,) = make_parser().parse_args_and_config(args=argv)
    return args


def test_installed_flavor_is_trl_vllm_serve():
    assert compat.runtime_server_flavor() == compat.TRL_VLLM_SERVE


@pytest.mark.parametrize("gpus, model, dtype", GPU_PLANS)
def test_gpu_plan_server_argv_parses_with_trls_own_parser(basic_recipe, gpus, model, dtype):
    rc = load_run_config(basic_recipe)
    plan = plan_from_config(rc, gpus=gpus, model=model)
    p = plan.to_dict()
    s = resolve_settings(dict(rc.trl), {}, plan)
    argv = build_server_argv(s, "10.0.0.5", 20001, python="python3")  # flavor: the installed TRL's
    assert argv[1:3] == ["-m", "ogrpo.serve.trl_api"]
    args = _trl_parse(argv[3:])
    assert args.model == s.model and args.host == "10.0.0.5" and args.port == 20001 and args.dtype == dtype
    assert args.tensor_parallel_size == p["vllm"]["tensor_parallel_size"]
    assert args.gpu_memory_utilization == p["vllm"]["args"]["gpu_memory_utilization"]
    assert args.max_model_len == p["vllm"]["args"]["max_model_len"]
    assert args.enable_prefix_caching is True and args.enforce_eager is p["vllm"]["args"]["enforce_eager"]


def test_cpu_plan_serves_trl_vllm_serve_on_cpu(tiny_recipe, tmp_path):
    """A CPU plan rendered here runs TRL's server through ogrpo.serve.trl_serve_cpu, with the same arguments."""
    from ogrpo import tiny

    rc = load_run_config(tiny_recipe, {"ogrpo": {"use_vllm": True}})
    typed = plan_from_config(rc, gpus="2xcpu", model=str(tiny.ensure_tiny_model()))
    plan = typed.to_dict()
    assert plan["mode"] == "server" and compat.plan_server_flavor(typed) == compat.TRL_VLLM_SERVE
    run = rc.to_dict()
    run["ogrpo"]["plan"] = plan
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    argv = serve(str(tmp_path / "run.yaml"), "127.0.0.1", 20002, dry_run=True)
    assert argv[1:3] == ["-m", "ogrpo.serve.trl_serve_cpu"]
    args = _trl_parse(argv[3:])
    assert args.dtype == "float32" and args.port == 20002 and args.max_model_len == plan["batch"]["max_model_len"]


@pytest.mark.parametrize("gpus, model, dtype", GPU_PLANS)
def test_gpu_plan_trainer_kwargs_build_trl_19s_grpo_config(basic_recipe, gpus, model, dtype):
    """settings.py against the real GRPOConfig of TRL 1.9.2: no plan key dropped, every kwarg accepted. Built
    with use_cpu (there is no GPU here); precision flags are checked as values, not by TrainingArguments."""
    from trl import GRPOConfig

    from ogrpo.trainer.settings import grpo_config_kwargs

    rc = load_run_config(basic_recipe)
    p = plan_from_config(rc, gpus=gpus, model=model)
    kwargs, notes = grpo_config_kwargs(dict(rc.trl), p, "/tmp/out", "http://10.0.0.5:20000")
    assert not notes, notes
    assert kwargs["vllm_mode"] == "server" and kwargs["vllm_server_base_url"] == "http://10.0.0.5:20000"
    assert bool(kwargs.get("fp16")) == (dtype == "float16") and bool(kwargs.get("bf16")) == (dtype == "bfloat16")
    cpu_safe = {**kwargs, "fp16": False, "bf16": False, "tf32": None, "use_cpu": True, "report_to": []}
    cfg = GRPOConfig(**cpu_safe)
    for key, value in kwargs.items():
        if key not in cpu_safe or cpu_safe[key] != value:
            continue
        if isinstance(value, (bool, int, float, str)) and key not in ("output_dir",):
            assert getattr(cfg, key) == value, key
    # The plan's model kwargs (attention, dtype) survive GRPOConfig's post-init unchanged, as JSON-able data.
    assert kwargs["model_init_kwargs"] and cfg.model_init_kwargs == kwargs["model_init_kwargs"]
    assert json.loads(json.dumps(cfg.model_init_kwargs)) == kwargs["model_init_kwargs"]
