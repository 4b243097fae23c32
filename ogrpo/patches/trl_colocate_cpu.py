"""TRL (colocated vLLM on the CPU build): make TRL's in-process weight sync work, and run vLLM in the trainer's dtype.

Why: on CPU, vLLM packs each linear weight into a oneDNN handle after loading, so TRL's
per-parameter `model.load_weights([(name, param)])` fails ('Parameter' object has no attribute
'weight_loader'). What works is ONE layerwise reload for all weights followed by a refresh of a tied lm_head
(`ogrpo.patches.vllm_cpu_reload`). TRL also passes no dtype to `LLM(...)`, and vLLM then picks bf16 on CPU even for an
fp32 model, which makes the trainer/vLLM log-prob gap ~1e-2 instead of ~1e-7.

The fix swaps two names TRL looks up at call time, without editing TRL: `VLLMGeneration.sync_weights` (only the
colocate-on-CPU branch changes; everything else calls TRL's original) and the module-level `LLM` (fills the
keyword arguments TRL does not pass: dtype, enforce_eager, and the plan's KV budget, else a host-memory share).
"""

from __future__ import annotations

from ogrpo import compat
from ogrpo.errors import OgrpoError
from ogrpo.patches.target import moved, problems_of
from ogrpo.patches.vllm_cpu_reload import reload_weights

NAME = "trl_colocate_cpu"
LIBRARY = "trl"

# On CPU, vLLM's gpu_memory_utilization is a share of host memory; the machine is shared with the trainer.
CPU_MEMORY_SHARE = 0.1
_LLM_DEFAULTS: dict = {}


def not_applicable() -> str | None:
    """TRL 1.9 (the GPU images' line) has no `_iter_named_params`: colocated vLLM on CPU runs on the CPU stack only
    (`install` refuses there, naming it)."""
    import trl

    if compat.server_flavor(trl.__version__) == compat.TRL_VLLM_SERVE:
        return f"colocated vLLM on CPU needs the CPU stack (TRL {compat.CPU_TRL_VERSION}); this line never takes it"
    return None


def check() -> None:
    """TRL's colocate generation: the module-level `LLM` it calls and `VLLMGeneration.sync_weights`/
    `_iter_named_params`/`mode`, which this patch wraps or reads."""
    try:
        mod = compat.vllm_generation_module()
        compat.vllm_generation_class()
    except (ImportError, OgrpoError) as exc:
        raise moved(NAME, LIBRARY, [str(exc)]) from None
    name = mod.__name__
    problems = problems_of({f"{name}:LLM": None, f"{name}:VLLMGeneration.sync_weights": ("self",),
                            f"{name}:VLLMGeneration._iter_named_params": ("self",)})
    if problems:
        raise moved(NAME, LIBRARY, problems)


def _model_runner(llm):
    executor = llm.llm_engine.model_executor
    worker = executor.driver_worker
    worker = getattr(worker, "worker", worker)  # WorkerWrapperBase in some vLLM versions
    return worker.model_runner


def cpu_sync_weights(self) -> None:
    """All trainer parameters → vLLM in one layerwise reload (the CPU replacement for TRL's colocate loop)."""
    runner = _model_runner(self.llm)
    model_config = getattr(runner, "model_config", None) or self.llm.llm_engine.model_config
    # Materialize first: a layerwise reload must see every tensor of a layer within one pass.
    # Copies, not views: with PEFT, TRL unmerges the adapters in place once the iteration ends.
    weights = [(name, param.detach().clone()) for name, param in self._iter_named_params()]
    reload_weights(runner.model, model_config, weights)
    self.llm.reset_prefix_cache()


def install(dtype: str | None = "float32", enforce_eager: bool | None = True,
            memory_share: float = CPU_MEMORY_SHARE, kv_cache_bytes: int | None = None) -> None:
    """Idempotent. Call before the GRPOTrainer is built (it constructs the LLM in its __init__).
    `kv_cache_bytes`: the plan's explicit KV budget, which vLLM takes over the memory share."""
    import torch

    if torch.cuda.is_available():
        return
    check()
    mod = compat.vllm_generation_module()
    cls = compat.vllm_generation_class()
    _LLM_DEFAULTS.clear()
    if dtype:
        _LLM_DEFAULTS["dtype"] = dtype
    if enforce_eager is not None:
        _LLM_DEFAULTS["enforce_eager"] = enforce_eager
    if kv_cache_bytes:
        _LLM_DEFAULTS["kv_cache_memory_bytes"] = int(kv_cache_bytes)

    if not getattr(cls.sync_weights, "_ogrpo_cpu", False):
        original_sync = cls.sync_weights

        def sync_weights(self):
            if self.mode == "colocate":
                return cpu_sync_weights(self)
            return original_sync(self)

        sync_weights._ogrpo_cpu = True
        sync_weights._ogrpo_original = original_sync
        cls.sync_weights = sync_weights

    if not getattr(mod.LLM, "_ogrpo_cpu", False):
        original_llm = mod.LLM

        def LLM(*args, **kwargs):  # noqa: N802 - stands in for vllm.LLM
            for key, value in _LLM_DEFAULTS.items():
                kwargs.setdefault(key, value)
            if kwargs.get("gpu_memory_utilization") is None or kwargs["gpu_memory_utilization"] > memory_share:
                kwargs["gpu_memory_utilization"] = memory_share
            return original_llm(*args, **kwargs)

        LLM._ogrpo_cpu = True
        LLM._ogrpo_original = original_llm
        mod.LLM = LLM


def uninstall() -> None:
    mod = compat.vllm_generation_module()
    cls = compat.vllm_generation_class()
    if getattr(cls.sync_weights, "_ogrpo_cpu", False):
        cls.sync_weights = cls.sync_weights._ogrpo_original
    if getattr(mod.LLM, "_ogrpo_cpu", False):
        mod.LLM = mod.LLM._ogrpo_original
