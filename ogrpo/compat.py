"""The one place where TRL / transformers / vLLM version differences are handled.

Supported lines are listed in `ogrpo.stacks`. Everything else in `ogrpo/train` calls these helpers instead of
testing versions itself, so a new TRL release means editing this file only.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

# TRL's logged gap between the trainer's and vLLM's log-probs of the sampled tokens (TRL >= 0.20 name).
SAMPLING_GAP_METRIC = "sampling/sampling_logp_difference/mean"


@lru_cache(maxsize=1)
def grpo_config_fields() -> frozenset[str]:
    from trl import GRPOConfig

    return frozenset(f.name for f in dataclasses.fields(GRPOConfig) if f.init)


def model_dtype_key() -> str:
    """transformers >= 4.56 takes `dtype`; older releases only `torch_dtype`."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def vllm_generation_module():
    """The module whose globals TRL's GRPO generation looks up (`LLM`, `VLLMClient`)."""
    try:
        import trl.generation.vllm_generation as mod  # TRL >= 1.0
    except ImportError:  # TRL 0.x kept vLLM handling inside the trainer module
        import trl.trainer.grpo_trainer as mod
    return mod


def vllm_generation_class():
    """The class that owns `sync_weights` for colocated/server generation (TRL >= 1.0: VLLMGeneration)."""
    mod = vllm_generation_module()
    cls = getattr(mod, "VLLMGeneration", None)
    if cls is None:
        raise RuntimeError("this TRL has no VLLMGeneration class; O-GRPO's CPU colocate sync needs TRL >= 1.0")
    return cls


def trl_version() -> str:
    import trl

    return trl.__version__
