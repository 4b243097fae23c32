"""O-GRPO's own kernels (ogrpo/kernels) a plan turns on, each with its reason."""

from __future__ import annotations

from typing import Callable

from ogrpo.planner.device_rules import STRATEGY_NAMES



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


def _fit_text(fit: tuple[str, bool], other: tuple[str, bool] | None = None) -> str:
    """"ZeRO-2", or with recomputation named where that is what differs from `other`."""
    strategy, gc = fit
    return STRATEGY_NAMES[strategy] + (" with gradient checkpointing" if gc and (other is None or not other[1])
                                       else "")


def logprobs_where_it_pays(kernels: dict[str, tuple[bool, str]], device_kind: str, wanted: bool | None,
                           pick: Callable[[bool], tuple[str, bool] | None],
                           logits_gib: Callable[[bool], float]) -> dict[str, tuple[bool, str]]:
    """linear_logprobs on a GPU only where memory needs it. On an H200 it ran ~1.5x slower than TRL's full-logits
    path for 6-25x less memory (issue 34's lease), while on CPU it is the faster of the two: so on a GPU the
    kernel stays on only where the full logits would not fit, or would push the fit (`pick(fused)`, the
    memory model's cheapest strategy and checkpointing that fit) to a worse strategy or to recomputation; a
    run config's `ogrpo.kernels: true` keeps it on regardless. `logits_gib(fused)`: the memory model's logits
    term, quoted in the reason."""
    on, _why = kernels["linear_logprobs"]
    if not on or device_kind == "cpu" or wanted is True:
        return kernels
    with_kernel, without = pick(True), pick(False)
    if without is not None and without == with_kernel:
        choice = (False, f"full logits fit: {_fit_text(without, (without[0], False))} either way "
                         f"({logits_gib(False):.1f} GiB of logits); TRL's path is faster on a GPU")
    elif without is None:
        choice = (True, f"without it nothing fits ({logits_gib(False):.1f} GiB of logits, "
                        f"{logits_gib(True):.2f} with it): a smaller micro-batch or a shorter completion")
    else:
        choice = (True, f"without it {_fit_text(without, with_kernel)} instead of "
                        f"{_fit_text(with_kernel, without)} ({logits_gib(False):.1f} GiB of logits, "
                        f"{logits_gib(True):.2f} with it)")
    return {**kernels, "linear_logprobs": choice}
