"""The anchor of `ogrpo bench step --placement split`: plain TRL's own server mode on the same split.

`trl vllm-serve` (TRL's `build_command`, the exact `vllm serve` command line it execs) on one core and
`GRPOTrainer(use_vllm=True, vllm_mode="server")` with TRL's defaults on the other. Only what a CPU cannot do
without is replaced, the way `ogrpo serve` does it on CPU: the weight-transfer backend (TRL asks for NCCL;
here `cpu_shm`, registered by its worker extension) and, on the trainer, the client class whose
`init_communicator`/`update_named_params` use it (ogrpo.serve.client). Nothing else of O-GRPO's runs: no job
key, no per-request seeds, no in-process engine, no overlap. The server gets the same model, dtype, context and
KV budget as O-GRPO's plan gives its own (a memory budget is not a speed setting; TRL's default share of
"GPU" memory would be 90 % of the host's on CPU), so the two differ by the software around the engine only.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from ogrpo.bench.rollout import _stop_server, _wait_health
from ogrpo.bench.task import token_reward
from ogrpo.launch import cpu_slots
from ogrpo.launch.ports import free_ports
from ogrpo.patches import trl_vllm_client
from ogrpo.profile.hooks import profiled
from ogrpo.profile.profiler import StageProfiler
from ogrpo.serve import CPU_BACKEND, CPU_EXTENSION_CLS
from ogrpo.serve.client import _cpu_client_cls
from ogrpo.serve.server import version_shim_dir


def server_command(model: str, port: int, vllm_args: dict) -> list[str]:
    """`trl vllm-serve`'s command line for this model, with the CPU weight-transfer backend instead of NCCL."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    args = ScriptArguments(model=model, host="127.0.0.1", port=port, dtype=vllm_args["dtype"],
                           max_model_len=vllm_args.get("max_model_len"))
    extra = []
    if vllm_args.get("kv_cache_memory_bytes"):
        extra = ["--kv-cache-memory-bytes", str(vllm_args["kv_cache_memory_bytes"])]
    cmd = build_command(args, extra)
    i = cmd.index("--weight-transfer-config")
    cmd[i + 1] = json.dumps({"backend": CPU_BACKEND})
    return cmd + ["--worker-extension-cls", CPU_EXTENSION_CLS]


def server_env() -> dict[str, str]:
    """What `trl vllm-serve` sets (dev mode) plus the version shim the CPU build of vLLM needs for `vllm serve`;
    the trainer's thread cap is not the server's."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["VLLM_SERVER_DEV_MODE"] = "1"
    shim = version_shim_dir()
    if shim:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (shim, env.get("PYTHONPATH")) if p)
    return env


def run(workdir: Path, rec: dict, vllm_args: dict, profile_path: Path, server_slots: str | None = None,
        trainer_slots: str | None = None) -> None:
    """Start the server, train `rec` against it with plain TRL and the stage profiler, stop the server.
    `server_slots`/`trainer_slots`: the plan's OGRPO_CPU_SLOTS of each side; each side is pinned to those cores
    as the local launcher pins O-GRPO's (a server left on every core would generate on the trainer's too)."""

    (port,) = free_ports(1)
    pinned = cpu_slots.step_env("server", server_slots)
    log = open(workdir / "split-trl-server.log", "wb")
    proc = subprocess.Popen(server_command(rec["model_name_or_path"], port, vllm_args), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, env={**server_env(), **pinned},
                            preexec_fn=lambda: cpu_slots.pin_from_env(pinned))
    try:
        _wait_health(f"http://127.0.0.1:{port}/health", proc, timeout=900)
        cpu_slots.pin_from_env(cpu_slots.step_env("trainer", trainer_slots))
        cores = {"server": sorted(os.sched_getaffinity(proc.pid)), "trainer": sorted(os.sched_getaffinity(0))}
        (workdir / "split-trl-cores.json").write_text(json.dumps(cores) + "\n")
        _train(workdir, rec, port, profile_path)
    finally:
        _stop_server(proc, port, log)


def _train(workdir: Path, rec: dict, port: int, profile_path: Path) -> None:
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    cls = _cpu_client_cls()  # run_seed None: TRL's own unseeded requests
    trl_vllm_client.install_client_class(cls)
    keys = {k: v for k, v in rec.items()
            if k not in ("model_name_or_path", "dataset_name", "reward_funcs", "dtype", "ogrpo")}
    args = GRPOConfig(output_dir=str(workdir / "split-trl-out"), use_cpu=True, bf16=rec["dtype"] == "bfloat16",
                      model_init_kwargs={"dtype": rec["dtype"]}, use_vllm=True, vllm_mode="server",
                      vllm_server_base_url=f"http://127.0.0.1:{port}", vllm_server_timeout=900,
                      **{**keys, "report_to": []})
    tok = AutoTokenizer.from_pretrained(rec["model_name_or_path"])
    ds = datasets.load_dataset("json", data_files=rec["dataset_name"], split="train")
    # plain TRL with only the profiler's layers: timed as O-GRPO's runs are
    trainer = profiled(GRPOTrainer)(model=rec["model_name_or_path"], reward_funcs=[token_reward], args=args, train_dataset=ds,
                          processing_class=tok)
    StageProfiler(profile_path).attach(trainer)
    trainer.train()
