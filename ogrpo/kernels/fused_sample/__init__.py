"""Fused next-token sampling: repetition penalty -> temperature -> top-k -> top-p -> draw, in one kernel per row
instead of transformers' logits-processor chain (a full-vocabulary sort for top-p) + softmax + torch.multinomial.

    from ogrpo.kernels.fused_sample import fused_sample
    tokens = fused_sample(logits, temperature=0.9, top_k=0, top_p=0.95, repetition_penalty=1.1,
                          previous_tokens=input_ids, generator=gen)

impl="auto" runs the compiled kernel for the logits' device when it built and passed its first-use check, else
the PyTorch reference drawing from the same uniforms; "compiled" insists on the kernel; "reference" is
transformers' chain + torch.multinomial, written out in `reference.py`. torch is imported on first call only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ogrpo.errors import OgrpoError

if TYPE_CHECKING:
    import torch

IMPLS = ("auto", "reference", "compiled")


def fused_sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, repetition_penalty: float,
                 previous_tokens: torch.Tensor | None = None, generator: torch.Generator | None = None, *,
                 impl: str = "auto") -> torch.Tensor:
    """Next tokens [B] (int64) for `logits` [B, V] (fp32/fp16/bf16). temperature 0 = greedy (argmax after the
    penalty); top_k 0, top_p 1.0 and repetition_penalty 1.0 turn those steps off."""
    import torch

    _validate(logits, temperature, top_k, top_p, repetition_penalty, previous_tokens, impl)
    if impl == "reference":
        # heavy: torch
        from ogrpo.kernels.fused_sample.reference import fused_sample_reference

        return fused_sample_reference(logits, temperature, top_k, top_p, repetition_penalty, previous_tokens,
                                      generator)
    # heavy: torch
    from ogrpo.kernels.fused_sample import op

    device = logits.device.type
    if impl == "compiled" and op.extension(device) is None:
        raise OgrpoError(f"compiled fused_sample is not available on {device}: {op.STATUS[device]['reason']}")
    rows = logits.shape[0]
    if temperature == 0:
        # greedy draws nothing, like transformers' greedy path: the generator's state is left as it was
        uniforms = torch.zeros(rows, dtype=torch.float64, device=logits.device)
    else:
        source = generator.device if generator is not None else logits.device
        uniforms = torch.rand(rows, generator=generator, dtype=torch.float64, device=source).to(logits.device)
    if previous_tokens is not None:
        previous_tokens = previous_tokens.to(device=logits.device, dtype=torch.int64)
    return op.fused_sample_op(logits, previous_tokens, uniforms, float(temperature), int(top_k), float(top_p),
                              float(repetition_penalty))


def fused_sample_reference(logits, temperature, top_k, top_p, repetition_penalty, previous_tokens=None,
                           generator=None):
    """transformers' processor chain + softmax + torch.multinomial (see `reference.py`)."""
    # heavy: torch
    from ogrpo.kernels.fused_sample.reference import fused_sample_reference as reference

    return reference(logits, temperature, top_k, top_p, repetition_penalty, previous_tokens, generator)


def implementation(device="cpu") -> dict[str, str]:
    """{"impl": "compiled" | "reference", "reason": ...}: what `impl="auto"` runs on `device` (a str or
    torch.device) and why, loading and checking the kernel if nothing ran there yet."""
    import torch

    # heavy: torch
    from ogrpo.kernels.fused_sample import op

    kind = torch.device(device).type
    op.extension(kind)
    return dict(op.STATUS[kind])


def _validate(logits, temperature, top_k, top_p, repetition_penalty, previous_tokens, impl) -> None:
    import torch

    problems = []
    if impl not in IMPLS:
        problems.append(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if logits.dim() != 2 or not logits.is_floating_point() or logits.shape[1] == 0:
        problems.append(f"logits must be a floating [B, V] tensor, got {tuple(logits.shape)} {logits.dtype}")
    if not temperature >= 0 or temperature == float("inf"):
        problems.append(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        problems.append(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if not 0.0 <= top_p <= 1.0:
        problems.append(f"top_p must be in [0, 1] (1.0 = off), got {top_p}")
    if not repetition_penalty > 0 or repetition_penalty == float("inf"):
        problems.append(f"repetition_penalty must be > 0 (1.0 = off), got {repetition_penalty}")
    if previous_tokens is not None and (
            previous_tokens.dim() != 2 or previous_tokens.shape[0] != logits.shape[0]
            or previous_tokens.dtype.is_floating_point or previous_tokens.dtype == torch.bool):
        problems.append(f"previous_tokens must be an integer [B, L] tensor with B={logits.shape[0]}, "
                        f"got {tuple(previous_tokens.shape)} {previous_tokens.dtype}")
    if problems:
        raise OgrpoError("fused_sample: " + "; ".join(problems))
