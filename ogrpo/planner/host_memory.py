"""Host RAM each step of a plan needs per node, in GiB (pure arithmetic from the plan, no torch).

What a Slurm job asks for with `--mem`, and what preflight compares with the partition's nodes (`sinfo %m`).
The GPU-memory model is ogrpo/planner/memory.py; this adds only what lives in host RAM:
- trainer process on a GPU: the runtime (CUDA context's host side, torch + transformers + TRL, data loading:
  ~3 GiB resident per process) and the weights once in the dtype the trainer loads them in
  (trainer_args.model_init_kwargs.dtype: fp32 master weights are 4 bytes per parameter): from_pretrained builds
  the state dict on the host before it moves to the GPU, every process at once; ZeRO-3 partitions it while
  loading (zero3_init), 1/N each;
- ZeRO-3 offload: what the trainer estimate keeps in host RAM per process (memory.py's `host_terms`: the
  optimizer's fp32 master weights and Adam m, v, the fp32 gradients DeepSpeed's CPU Adam steps on and the
  half gradient partition, 18 bytes per trainable parameter over the N processes);
- vLLM server on GPUs: the API server + engine (~4 GiB) and one worker per GPU (~2 GiB each), plus the weights
  once (safetensors are read through the page cache: P·2 bytes per node);
- ZeRO-3 under `ogrpo.overlap: one-step`: rank 0 keeps a host copy of the full weights between the optimizer
  step and the weight push (P x the precision's bytes), counted on every trainer node (the plan does not say
  which node holds rank 0 first);
- CPU plans: the plan's own per-process estimates are host memory already (memory_gib_per_gpu; the device
  rules' `estimates_host_ram`).
A 10 % margin covers allocator slack; the figure is rounded up to whole GiB.
"""

from __future__ import annotations

import math

from ogrpo import dtypes
from ogrpo.planner.device_rules import rules_of
from ogrpo.planner.types import Overlap

GiB = float(2**30)
TRAINER_RUNTIME_GIB = 3.0
SERVER_RUNTIME_GIB = 4.0
SERVER_WORKER_GIB = 2.0
MARGIN = 1.10


def _per_node(total_processes: int, nodes: list) -> int:
    return max(1, -(-int(total_processes) // max(1, len(nodes))))


def step_host_gib(p) -> dict[str, float]:
    """role → host RAM in GiB that the role's step needs on each of its nodes (`p`: a Plan)."""
    rules = rules_of(p)
    params = float(p.model.params or 0)
    load_dtype = p.trainer_args.model_init_kwargs.get("dtype")
    # "auto" loads the checkpoint's own dtype: 2 bytes for every released model we plan for
    weight_bytes = float(dtypes.nbytes("bf16" if str(load_dtype) == "auto" else load_dtype,
                                       default=dtypes.nbytes(p.precision)))
    t = p.trainer
    procs = _per_node(t.num_processes, t.nodes)
    out: dict[str, float] = {}
    if rules.estimates_host_ram:
        trainer = procs * float(t.memory_gib_per_gpu or 0)
    else:
        shard = max(1, int(t.num_processes)) if t.strategy.is_zero3 else 1
        per_proc = TRAINER_RUNTIME_GIB + params * weight_bytes / shard / GiB
        per_proc += sum((t.memory_terms or {}).get("host_terms", {}).values())
        trainer = procs * per_proc
        if t.strategy.is_zero3 and p.has_server and p.overlap is Overlap.ONE_STEP:
            # the one-step push's copy of the full weights, on rank 0's node (ogrpo/overlap/zero3_push.py; LoRA's
            # merged push, which keeps TRL's, gathers as much)
            trainer += params * dtypes.nbytes(p.precision) / GiB
    out["trainer"] = trainer
    if p.has_server:
        v = p.vllm
        if rules.estimates_host_ram:
            server = float(v.memory_gib_per_gpu or 0) or SERVER_RUNTIME_GIB
        else:
            server = SERVER_RUNTIME_GIB + SERVER_WORKER_GIB * max(1, len(v.gpus or [0])) + params * 2.0 / GiB
        out["server"] = server
    return {role: float(math.ceil(gib * MARGIN)) for role, gib in out.items()}
