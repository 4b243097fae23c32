"""`ogrpo::fused_sample` as a torch custom op: compiled CPU/CUDA kernels, verified before use, and the PyTorch
reference wherever they are missing or wrong.

The op is deterministic given its `uniforms` (one per row, drawn by the caller from its torch.Generator), which is
what makes seeding reproducible, the CPU and CUDA kernels draw-for-draw comparable, and `opcheck` applicable.
Per device, the first call builds/loads the extension and checks it against the reference on a small input; a
failure warns once and the reference runs from then on. `STATUS` records which one runs and why (the trainer
copies it into the run manifest).
"""

from __future__ import annotations

import torch

from ogrpo.kernels import _build
from ogrpo.kernels.fused_sample.reference import fused_sample_from_uniforms, processed_scores
from ogrpo.kernels.guarded import Guarded



@torch.library.custom_op("ogrpo::fused_sample", mutates_args=())
def fused_sample_op(logits: torch.Tensor, previous_tokens: torch.Tensor | None, uniforms: torch.Tensor,
                    temperature: float, top_k: int, top_p: float, repetition_penalty: float) -> torch.Tensor:
    # Devices without a kernel of their own (and any device whose kernel failed its check) run the reference.
    return fused_sample_from_uniforms(logits, previous_tokens, uniforms, temperature, top_k, top_p,
                                      repetition_penalty)


@fused_sample_op.register_fake
def _(logits, previous_tokens, uniforms, temperature, top_k, top_p, repetition_penalty):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


def _compiled_or_reference(logits, previous_tokens, uniforms, temperature, top_k, top_p, repetition_penalty):
    ext = extension(logits.device.type)
    if ext is None:
        return fused_sample_from_uniforms(logits, previous_tokens, uniforms, temperature, top_k, top_p,
                                          repetition_penalty)
    return ext.fused_sample(logits, previous_tokens, uniforms, temperature, top_k, top_p, repetition_penalty)


fused_sample_op.register_kernel("cpu")(_compiled_or_reference)
fused_sample_op.register_kernel("cuda")(_compiled_or_reference)


def _load(device: str):
    return _build.load_extension("fused_sample", cuda=device == "cuda")


# `_load`/`verify` looked up per call: a test replaces `_load` on this module
_GUARD = Guarded("fused_sample", lambda kind: _load(kind),
                 lambda ext, device: verify(ext, getattr(device, "type", device)))
# device type -> {"impl": "compiled" | "reference", "reason": str} (the shape linear_logprobs records too)
STATUS = _GUARD.status


def extension(device):
    """The verified compiled module for `device` ("cpu"/"cuda" or a torch.device), or None when the reference must
    run (ogrpo.kernels.guarded: decided once per device type, warned once, recorded in STATUS)."""
    return _GUARD.extension(device)


def reset() -> None:
    """Forget loaded extensions and their checks (tests; a process normally checks once)."""
    _GUARD.reset()


# Small, odd-sized first-use cases: greedy with penalty, plain, top-k, top-p, both (V not a multiple of 8/256).
_CHECKS = ((0.0, 0, 1.0, 1.3), (1.0, 0, 1.0, 1.0), (0.7, 5, 1.0, 1.0), (1.3, 0, 0.8, 1.2), (0.9, 40, 0.9, 1.1))


def verify(ext, device: str) -> str | None:
    """None when `ext` agrees with the reference on `device`, else what differed. A sampled token agrees when the
    row's uniform falls inside that token's slice of the reference CDF (1e-4 slack for summation order)."""
    gen = torch.Generator().manual_seed(1234)
    rows, vocab = 7, 517
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(device)
    logits[0, :3] = float("-inf")
    previous = torch.randint(0, vocab, (rows, 11), generator=gen).to(device)
    uniforms = torch.rand(rows, generator=gen, dtype=torch.float64).to(device)
    dtypes = (torch.float32, torch.float16) if device == "cuda" else (torch.float32,)
    for dtype in dtypes:
        x = logits.to(dtype)
        for temperature, top_k, top_p, penalty in _CHECKS:
            got = ext.fused_sample(x, previous, uniforms, temperature, top_k, top_p, penalty).cpu()
            if temperature == 0:
                want = fused_sample_from_uniforms(x, previous, uniforms, 0.0, 0, 1.0, penalty).cpu()
                if not torch.equal(got, want):
                    return f"greedy {dtype} tokens {got.tolist()} != {want.tolist()}"
                continue
            probs = processed_scores(x, temperature, top_k, top_p, penalty, previous).softmax(-1).double().cpu()
            cdf = probs.cumsum(-1) / probs.sum(-1, keepdim=True)
            picked_p = probs.gather(1, got[:, None]).squeeze(1)
            hi = cdf.gather(1, got[:, None]).squeeze(1)
            lo = hi - picked_p / probs.sum(-1)
            u = uniforms.cpu()
            bad = (picked_p <= 0) | (u < lo - 1e-4) | (u > hi + 1e-4)
            if bad.any():
                row = int(bad.nonzero()[0])
                return (f"{dtype} T={temperature} top_k={top_k} top_p={top_p} penalty={penalty}: row {row} drew "
                        f"token {int(got[row])} (p={float(picked_p[row]):.3g}) for u={float(u[row]):.6f}")
    return None
