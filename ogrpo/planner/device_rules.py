"""Everything the planner decides differently per device kind, in one object per kind.

`rules_for(gpu)` gives `CpuRules` for CPU processes and `GpuRules` for a catalog GPU; a GPU family's own facts
(bf16, TF32, flash-attn 2, interconnect, tensor cores: ogrpo/hardware.py's catalog) decide the rest, so V100
(sm_70: fp16, SDPA, no TF32) and A40/A100/H100 (bf16, FA2, TF32) are the same class with different facts. A new
GPU family is a catalog line; a new device-specific decision is a method here, on both classes.

The planner's steps (ogrpo/planner/*) ask these objects instead of testing `is_cpu` themselves, and so does
whatever turns a plan into a job and runs it (memory, jobspec, render, launch, the server): `rules_of(plan)`.
`GpuType.is_cpu` stays the catalog fact the rules are built from; tests/test_device_rules.py counts the tests
of it left elsewhere.
"""

from __future__ import annotations

from ogrpo import dtypes, packages
from ogrpo.config import STRATEGIES
from ogrpo.fields import CPU_LINE, IMAGE_LINE
from ogrpo.hardware import Cluster, GpuType, known_types, parse_gpus
from ogrpo.planner import memory

# Share of host RAM a CPU vLLM may take (a measured working value): the ceiling its estimate is
# checked against; vLLM itself gets an explicit KV budget on CPU.
CPU_VLLM_UTIL = 0.2
# The colocated vLLM's share of a GPU grows in these steps up to this ceiling until one sequence fits.
COLOCATE_UTIL_STEP = 0.05
COLOCATE_UTIL_MAX = 0.7

# On CPU the server's engine runs the model in its own process, with every core of the server's device set.
# vLLM's CPU platform otherwise splits it into an EngineCore process that busy-polls one core and a worker
# bound to the other(s): on 2 cores that halves generation throughput. The OpenAI server keeps its EngineCore
# in a separate process either way. `ogrpo serve` sets the same default for a CPU server started by hand.
CPU_SERVER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

# CPUs per GPU when the site does not say (ogrpo.cpus_per_gpu): data loading, tokenization, reward functions and
# vLLM's API server each want a core or two per device.
DEFAULT_CPUS_PER_GPU = 8

STRATEGY_NAMES = {"ddp": "DDP", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
                  "zero3_offload": "ZeRO-3 with optimizer offload"}

_FP32_MASTER = "fp32 master weights: bf16/fp16 weights would round away updates at lr ~1e-6"


class DeviceRules:
    """The interface; see CpuRules and GpuRules. `gpu` is the device's catalog entry."""

    is_cpu: bool
    unit: str  # what one trainer rank runs on, in messages: "process" | "GPU"
    dtype_bytes: int  # bytes per weight/KV element vLLM serves with
    # How vLLM's KV cache is sized: "kv_bytes" (an explicit budget for the generation batch) or "utilization"
    # (a share of device memory, TRL's vllm_gpu_memory_utilization).
    kv_policy: str
    # How a separate server is placed: "one_process" (CPU) or "tensor_parallel" (GPUs, ogrpo/planner/placement).
    server_placement: str
    strategies: tuple[str, ...]  # trainer strategies tried, cheapest first, when the run config names none
    suggests_lora: bool  # whether "LoRA" is offered as a fix for a trainer that does not fit
    counts_gpus: bool  # whether steps ask the scheduler for GPUs (--gres, the steps' devices)
    kind: str  # "cpu" | "gpu": the kind's name in messages and in tables kept per kind (the preemption step's default)
    # whether a rerun of the same plan computes the same bits (`ogrpo reproduce`): not on GPUs, whose CUDA kernels
    # (atomics in reductions, vLLM's batching) are not deterministic by default
    reruns_bit_for_bit: bool
    stack: str  # the stack a plan runs on (ogrpo/packages.py): "cpu", or the GPU family's image
    memory_terms: memory.DeviceTerms  # the memory model's per-kind terms (runtime, KV blocks, CUDA graphs ...)
    # Whether a role's device estimate is itself host RAM (processes sharing the host), so the step's --mem is
    # that estimate; on GPUs host RAM is counted from what each process keeps on the host (ogrpo/planner/host_memory.py).
    estimates_host_ram: bool
    # Whether a plan runs in the environment that renders it (no Slurm needed; its TRL is the installed one)
    # rather than in the GPU images (ogrpo/compat.py's image line).
    runs_locally: bool
    torch_device: str  # the device the server's engine runs on: "cpu" | "cuda"
    # Whether a step refuses to start where the planned devices are not (ogrpo/device_check.py).
    checks_devices: bool
    # Whether a ZeRO plan's trainer gets DeepSpeed through accelerate's DEEPSPEED launcher (accelerate.yaml names
    # deepspeed.json); otherwise through GRPOConfig's `deepspeed` inside each gloo process (ogrpo/trainer/settings.py).
    deepspeed_through_accelerate: bool
    cpus_per_device: int  # Slurm CPUs per device (trainer process or GPU) when ogrpo.cpus_per_gpu is unset
    server_health_timeout_s: int  # how long the supervisor waits for the server's health check

    def __init__(self, gpu: GpuType):
        self.gpu = gpu

    def step_gpus(self, gpus: list[int]) -> list[int]:
        """The device indices a step names (empty where steps ask for no GPUs)."""
        return list(gpus) if self.counts_gpus else []

    @property
    def trl_line(self) -> str:
        raise NotImplementedError


class CpuRules(DeviceRules):
    is_cpu = True
    reruns_bit_for_bit = True
    unit = "process"
    dtype_bytes = dtypes.BYTES["float32"]
    kv_policy = "kv_bytes"
    server_placement = "one_process"
    # An explicit ogrpo.strategy is honoured (DeepSpeed runs over gloo), but none is picked for memory.
    strategies = ("ddp",)
    suggests_lora = False
    counts_gpus = False
    kind = "cpu"
    stack = packages.CPU_STACK
    memory_terms = memory.CPU_TERMS
    estimates_host_ram = True
    runs_locally = True
    torch_device = "cpu"
    checks_devices = False
    # `accelerate launch --multi_gpu` over gloo never reads accelerate.yaml's DeepSpeed section.
    deepspeed_through_accelerate = False
    cpus_per_device = 1  # one trainer process computes on one core's worth of work; the server step shares them
    server_health_timeout_s = 600

    @property
    def trl_line(self) -> str:
        return CPU_LINE  # the CPU/CI stack's TRL (ogrpo/compat.py)

    # ---- precision and attention
    def precision(self, trl: dict) -> tuple[str, str, list[tuple[str, object, str]]]:
        """(precision, reason, [(key, value, change reason)] the recipe's keys become)."""
        why = "CPU: fp32 keeps vLLM and HF log-probs equal (no half-precision autocast)"
        return ("fp32", "CPU: fp32 keeps vLLM and HF log-probs equal (bf16 differs by ~0.01)",
                [("bf16", False, why), ("fp16", False, why)])

    def model_problem(self, model) -> str | None:
        return None

    def attn_supported(self, impl: str) -> bool:
        return impl in ("eager", "sdpa")

    def default_attn(self) -> tuple[str, str]:
        return "sdpa", "CPU: PyTorch SDPA (flash-attn needs CUDA)"

    def attn_change_reason(self, impl: str) -> str:
        return f"CPU: {impl} needs CUDA; PyTorch SDPA"

    # ---- vLLM
    def max_seqs(self, profile_max: int) -> int:
        return 64

    def server_util(self, want: float | None, profile_util: float) -> float:
        return CPU_VLLM_UTIL

    def util_change_reason(self) -> str | None:
        """Why a recipe's vllm_gpu_memory_utilization is dropped on this kind (None: it is honoured)."""
        return ("CPU: vLLM gets an explicit KV budget (kv_cache_memory_bytes) for the generation batch, not a "
                "share of host memory")

    def colocate_util(self, want: float | None, profile_util: float) -> float:
        return CPU_VLLM_UTIL

    def colocate_util_can_grow(self) -> bool:
        return False

    def raises_server_util(self) -> bool:
        """Whether a recipe's too-small server share may be raised to the profile's to fit one sequence."""
        return False

    def wider_tp_fixes(self) -> bool:
        return False

    def no_room(self, e, max_model_len: int, seqs: int) -> str:
        return (f"weights {e.terms['weights']:.1f} GiB + KV for {seqs} x {max_model_len} tokens "
                f"{e.terms['kv_cache']:.1f} GiB + overhead exceed {e.budget_gib:.1f} GiB of host RAM")

    def vllm_dtype(self, precision: str) -> tuple[str, str]:
        return "float32", "CPU: fp32 so vLLM log-probs match the trainer's"

    def kv_setting_reason(self, seqs: int, max_model_len: int) -> str:
        return (f"CPU: KV for {seqs} x {max_model_len} tokens; a share of host memory depends on the NUMA "
                "node's size and the process's resident set (a cold compile cache failed at 0.1)")

    def server_env(self, total: int) -> list[tuple[str, str, str | None]]:
        """(variable, value, setting reason or None) for the server step."""
        return [(k, v, "CPU: the engine computes on all the server's cores in one process instead of busy-polling "
                       "one (1.8x tokens/s)") for k, v in CPU_SERVER_ENV.items()]

    # ---- trainer
    def trainer_budget(self, memory_gib: float, headroom: float, colocate_util: float, num_processes: int,
                       server_gib: float) -> float:
        # All processes share host RAM: each gets an equal share of what the server (or, colocated, every
        # process's own vLLM share) leaves.
        host_left = memory_gib * (1 - headroom - colocate_util * num_processes) - server_gib
        return host_left / max(1, num_processes)

    def strategy_reason(self, strategy: str, n: int, wanted: str | None, lora: bool = False) -> str:
        if wanted is not None:
            return (f"set in the run config (ogrpo.strategy {wanted})"
                    + (f": {STRATEGY_NAMES[wanted]} over gloo on {n} CPU processes" if wanted != "ddp" else ""))
        return "CPU: DDP over gloo; ogrpo.strategy picks DeepSpeed ZeRO (it runs over gloo too, but slower)"

    def precision_args(self, precision: str, strategy: str) -> tuple[dict, list[tuple[str, object, str]], str]:
        """(TrainingArguments precision flags, settings [(name, value, reason)], the dtype weights load in)."""
        return ({"bf16": False, "fp16": False, "use_cpu": True},
                [("use_cpu", True, "CPU plan: TrainingArguments must not look for CUDA")], "float32")

    def dtype_change_prefix(self, user_dtype: str) -> str:
        return ""

    def tf32(self, user) -> tuple[bool, str | None, str] | None:
        """(value, setting reason or None, change reason), or None: TrainingArguments gets no tf32."""
        if user:
            return False, None, "CPU: no TF32"
        return None

    def optim(self) -> tuple[str, str]:
        return "adamw_torch", "CPU: plain AdamW"

    def torch_compile(self, profile: str) -> tuple[bool, str]:
        return False, "CPU: compile time dominates short runs"

    def dataloader_workers(self) -> int:
        return 0

    def use_cpu(self, user) -> tuple[bool, bool, str] | None:
        """(set it in TrainingArguments, value, change reason) for the recipe's use_cpu, or None: nothing."""
        return False, True, "CPU plan: TrainingArguments must not look for CUDA"

    def job_env(self, total: int) -> list[tuple[str, str, str | None]]:
        return []

    # ---- the job
    def launcher_flags(self, num_processes: int) -> list[str]:
        """`accelerate launch` flags the trainer step adds for NUM_PROCESSES processes."""
        # `--cpu --num_processes 2` silently starts ONE process; --multi_gpu with use_cpu in the config starts real
        # gloo workers.
        return ["--multi_gpu"] if num_processes >= 2 else []

    def accelerate_device_fields(self) -> dict:
        """accelerate.yaml's device keys."""
        return {"use_cpu": True}

    def deepspeed_precision(self, precision: str) -> dict:
        """deepspeed.json's bf16/fp16 sections."""
        # fp32 on CPU: "auto" takes GRPOConfig's bf16/fp16 (both False); an explicit `enabled: true` makes
        # DeepSpeed cast the model to bf16 and the gloo run then differs from the plan's fp32.
        return {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}

    def deepspeed_offload(self) -> tuple[dict, dict]:
        """(zero_optimization's offload_optimizer, top-level deepspeed.json keys) of a zero3_offload plan."""
        # Parameters already live in host RAM: the offload is ZeRO-Offload's code path (the optimizer steps on
        # the fp32 partition outside the engine), with the trainer's torch AdamW instead of DeepSpeed's CPU
        # Adam, whose C++ op would be JIT-compiled on first use (DS_BUILD_OPS=0 install). No pinned memory
        # without CUDA.
        return {"device": "cpu", "pin_memory": False}, {"zero_force_ds_cpu_optimizer": False}

    def devices_text(self, gpus: list[int], processes: int) -> str:
        """A role's devices on its node, for `ogrpo plan`'s table."""
        return f"{processes} process(es)"

    # ---- fixes
    def hardware_fix_specs(self, cluster: Cluster) -> list[list[str]]:
        """Groups of `--gpus` values to try as fixes, each smallest first."""
        # A host with more RAM: the same processes, 2x / 4x / 8x the memory (more processes share the same RAM,
        # so they do not help).
        count = f"{cluster.total_gpus}x" if cluster.total_gpus > 1 else ""
        return [[f"{count}cpu-{cluster.gpu.memory_gib * k:g}G" for k in (2, 4, 8)]]


class GpuRules(DeviceRules):
    is_cpu = False
    reruns_bit_for_bit = False
    unit = "GPU"
    dtype_bytes = dtypes.BYTES["bfloat16"]  # bf16 or fp16 (vllm_dtype): 2 bytes either way
    kv_policy = "utilization"
    server_placement = "tensor_parallel"
    strategies = STRATEGIES
    suggests_lora = True
    counts_gpus = True
    kind = "gpu"
    memory_terms = memory.GPU_TERMS
    estimates_host_ram = False
    runs_locally = False
    torch_device = "cuda"
    checks_devices = True
    deepspeed_through_accelerate = True
    cpus_per_device = DEFAULT_CPUS_PER_GPU
    server_health_timeout_s = 900

    @property
    def stack(self) -> str:
        return packages.image_stack(self.gpu)

    @property
    def label(self) -> str:
        return f"{self.gpu.name} (sm_{self.gpu.sm})"

    @property
    def trl_line(self) -> str:
        return IMAGE_LINE  # the images' TRL (ogrpo/compat.py)

    def precision(self, trl: dict) -> tuple[str, str, list[tuple[str, object, str]]]:
        g = self.gpu
        if g.bf16:
            if trl.get("fp16") is True:
                return "fp16", "fp16 requested in the run config", []
            return "bf16", f"{g.name} (sm_{g.sm}) has bf16: no loss scaling needed", []
        return ("fp16", f"{g.name} (sm_{g.sm}) has no bf16: fp16 with loss scaling",
                [("bf16", False, f"{g.name} (sm_{g.sm}) has no bf16: fp16 with dynamic loss scaling (fp16: true)")])

    def model_problem(self, model) -> str | None:
        g = self.gpu
        if model.fp32_only and not g.bf16:
            return (f"{model.name} ({model.model_type}) runs only in fp32 in vLLM, and {g.name} cannot serve it "
                    "with --dtype half; use an sm_80+ GPU (A40, A100) or another model")
        return None

    def attn_supported(self, impl: str) -> bool:
        # eager and SDPA run everywhere; anything else (flash-attn 2, hub kernels) needs an sm_80+ GPU here.
        return impl in ("eager", "sdpa") or self.gpu.fa2

    def default_attn(self) -> tuple[str, str]:
        if self.gpu.fa2:
            return "flash_attention_2", f"sm_{self.gpu.sm} runs flash-attn 2 (Ampere+)"
        return "sdpa", f"flash-attn 2 needs sm_80+; SDPA's memory-efficient kernel covers sm_{self.gpu.sm}"

    def attn_change_reason(self, impl: str) -> str:
        return (f"{impl} has no kernels for {self.gpu.name} (sm_{self.gpu.sm}, needs sm_80+); SDPA's "
                "memory-efficient kernel instead")

    def max_seqs(self, profile_max: int) -> int:
        return profile_max

    def server_util(self, want: float | None, profile_util: float) -> float:
        return want or profile_util

    def util_change_reason(self) -> str | None:
        return None

    def colocate_util(self, want: float | None, profile_util: float) -> float:
        return float(want or profile_util)

    def colocate_util_can_grow(self) -> bool:
        return True

    def raises_server_util(self) -> bool:
        return True

    def wider_tp_fixes(self) -> bool:
        return True

    def no_room(self, e, max_model_len: int, seqs: int) -> str:
        return (f"weights {e.terms['weights']:.1f} GiB + overhead leave no room for one {max_model_len}-token "
                f"sequence in {e.budget_gib:.1f} GiB per GPU")

    def vllm_dtype(self, precision: str) -> tuple[str, str]:
        if precision == "bf16":
            return "bfloat16", "same dtype as training"
        return "half", "bf16 models fall back badly on sm_70: pass --dtype half"

    def kv_setting_reason(self, seqs: int, max_model_len: int) -> str:
        raise AssertionError("GPU plans size KV by utilization")

    def server_env(self, total: int) -> list[tuple[str, str, str | None]]:
        return [("NCCL_P2P_DISABLE", "1", None)] if self._pcie_broadcast(total) else []

    def _pcie_broadcast(self, total: int) -> bool:
        return self.gpu.interconnect == "pcie" and total > 1

    def trainer_budget(self, memory_gib: float, headroom: float, colocate_util: float, num_processes: int,
                       server_gib: float) -> float:
        return memory_gib * (1 - headroom - colocate_util)

    def strategy_reason(self, strategy: str, n: int, wanted: str | None, lora: bool = False) -> str:
        if wanted is not None:
            return f"set in the run config (ogrpo.strategy {wanted})"
        if lora:
            return {"ddp": "LoRA: the frozen base and the adapters' state fit on each GPU unsharded (fastest)",
                    "zero2": f"LoRA: the adapters' gradients and optimizer states sharded over {n} GPUs to fit",
                    "zero3": f"LoRA: the frozen base sharded over {n} GPUs (with the adapters' state) to fit",
                    "zero3_offload": "LoRA: even sharded, the adapters' optimizer does not fit: moved to host RAM"
                    }[strategy]
        return {"ddp": "weights, gradients and optimizer fit on each GPU unsharded (fastest)",
                "zero2": f"gradients and optimizer states sharded over {n} GPUs to fit",
                "zero3": f"weights, gradients and optimizer sharded over {n} GPUs to fit",
                "zero3_offload": "even sharded, the optimizer does not fit: moved to host RAM"}[strategy]

    def precision_args(self, precision: str, strategy: str) -> tuple[dict, list[tuple[str, object, str]], str]:
        if precision == "bf16":
            return {"bf16": True, "fp16": False}, [], "float32" if strategy == "ddp" else "bfloat16"
        # TRL turns bf16 on unless fp16 is set, so both are explicit (GPU families: ogrpo/stacks.py).
        return ({"bf16": False, "fp16": True},
                [("bf16", False, "GRPOConfig enables bf16 unless told otherwise; V100-class GPUs would fail")],
                "float32")

    def dtype_change_prefix(self, user_dtype: str) -> str:
        if user_dtype.endswith("bfloat16") and not self.gpu.bf16:
            return f"{self.label} has no bf16: "
        return ""

    def tf32(self, user) -> tuple[bool, str | None, str] | None:
        g = self.gpu
        tf32 = bool(g.tf32) if (user is None or not g.tf32) else bool(user)
        reason = (("set in the run config" if user is not None else "TF32 matmuls on Ampere+") if g.tf32 else
                  f"sm_{g.sm} has no TF32 (transformers raises if it is set)")
        return tf32, reason, f"{self.label} has no TF32 (transformers raises if it is set)"

    def optim(self) -> tuple[str, str]:
        return "adamw_torch_fused", "fused AdamW: one kernel per step on GPU"

    def torch_compile(self, profile: str) -> tuple[bool, str]:
        g = self.gpu
        if g.triton_tensor_cores and profile == "aggressive":
            return True, "Triton has tensor cores on sm_80+ and the aggressive profile accepts compile time"
        if not g.triton_tensor_cores:
            return False, f"Triton's tl.dot has no tensor cores on sm_{g.sm}"
        return False, "compile time and recompiles on varying lengths outweigh the gain outside the aggressive profile"

    def dataloader_workers(self) -> int:
        return 2

    def use_cpu(self, user) -> tuple[bool, bool, str] | None:
        if user:
            return True, False, f"a {self.gpu.name} plan trains on its GPUs"
        return None

    def job_env(self, total: int) -> list[tuple[str, str, str | None]]:
        env: list[tuple[str, str, str | None]] = [("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", None)]
        if self._pcie_broadcast(total):
            env.append(("NCCL_P2P_DISABLE", "1", f"{self.gpu.name} boxes are PCIe: the trainer→vLLM NCCL broadcast "
                                                 "can hang with P2P (TRL #5865, #2923)"))
        return env

    def launcher_flags(self, num_processes: int) -> list[str]:
        return []

    def accelerate_device_fields(self) -> dict:
        return {"use_cpu": False, "gpu_ids": "all"}

    def deepspeed_precision(self, precision: str) -> dict:
        if precision == "fp16":
            # V100: dynamic loss scaling (loss_scale 0) starting at 2^16.
            return {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                             "hysteresis": 2, "min_loss_scale": 1},
                    "bf16": {"enabled": False}}
        return {"bf16": {"enabled": True}, "fp16": {"enabled": False}}

    def deepspeed_offload(self) -> tuple[dict, dict]:
        # ZeRO-Offload steps the optimizer on the CPU: it needs DeepSpeed's CPU Adam, not the client's.
        return ({"device": "cpu", "pin_memory": True},
                {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                           "weight_decay": "auto"}}})

    def devices_text(self, gpus: list[int], processes: int) -> str:
        return f"GPU {','.join(map(str, gpus))}"

    def hardware_fix_specs(self, cluster: Cluster) -> list[list[str]]:
        # The fewest GPUs of any type at least this large (a few big GPUs before many small ones), then the
        # fewest of this type (what the user may have).
        return [_fewest_gpus(cluster), _more_gpus(cluster)]


def _layouts(gpn: int) -> list[tuple[int, str]]:
    """(GPUs, layout) of one node (1-8 GPUs) and of 2-8 whole nodes of `gpn` GPUs."""
    return [(c, f"{c}") for c in range(1, 9)] + [(n * gpn, f"{n}x{gpn}") for n in range(2, 9)]


def _more_gpus(cluster: Cluster) -> list[str]:
    """Specs of the same GPU type with more GPUs, fewest first: one node up to 8, then whole nodes."""
    gpn = cluster.gpus_per_node if cluster.nodes > 1 else 8
    return [f"{layout}x{cluster.gpu.name}" for count, layout in sorted(_layouts(gpn))
            if count > cluster.total_gpus and (cluster.nodes == 1 or "x" in layout)]


def _fewest_gpus(cluster: Cluster) -> list[str]:
    """Specs on this GPU type (more GPUs) or on any catalog type with more memory (any count), fewest GPUs first,
    then the smaller GPU."""
    gpn = cluster.gpus_per_node if cluster.nodes > 1 else 8
    out = [(parse_gpus(spec).total_gpus, cluster.gpu.memory_gib, spec) for spec in _more_gpus(cluster)]
    for name in known_types():
        if name == "cpu":
            continue
        g = parse_gpus(name).gpu
        if g.memory_gib > cluster.gpu.memory_gib:
            out += [(count, g.memory_gib, f"{layout}x{g.name}") for count, layout in _layouts(gpn)]
    return [spec for _, _, spec in sorted(out)]


def rules_for(gpu: GpuType) -> DeviceRules:
    return CpuRules(gpu) if gpu.is_cpu else GpuRules(gpu)


def rules_of(plan) -> DeviceRules:
    """The rules of the device a Plan (or a Cluster) was made for."""
    return rules_for(getattr(plan, "cluster", plan).gpu)
