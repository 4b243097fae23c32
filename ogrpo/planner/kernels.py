"""O-GRPO's own kernels (ogrpo/kernels) a plan turns on, each with its reason."""

from __future__ import annotations


def plan_kernels(profile: str, mode: str, liger: bool, wanted: bool | None) -> dict[str, tuple[bool, str]]:
    """name -> (on, reason). `wanted`: `ogrpo.kernels`."""
    if wanted is False:
        return {k: (False, "ogrpo.kernels: false in the run config") for k in ("linear_logprobs", "fused_sample")}
    safe = profile != "conservative" or wanted is True
    if liger:
        logprobs = (False, "use_liger_kernel: Liger's chunked loss already avoids the full logits")
    elif safe:
        logprobs = (True, "log-probs and entropies one token chunk at a time: the B·C·V logits are never held "
                          "(memory term: one chunk)")
    else:
        logprobs = (False, "the conservative profile keeps TRL's own log-prob path")
    if mode != "none":
        sample = (False, "vLLM samples the rollouts")
    elif safe:
        sample = (True, "HF generate rollouts: penalty, temperature, top-k/p and the draw in one pass per row")
    else:
        sample = (False, "the conservative profile keeps transformers' sampling")
    return {"linear_logprobs": logprobs, "fused_sample": sample}
