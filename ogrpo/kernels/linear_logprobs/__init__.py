"""linear_logprobs: per-token log-probs and entropies of an LM head without materializing the [N, V] logits.

    from ogrpo.kernels.linear_logprobs import linear_logprobs, linear_logprobs_reference
    logp, entropy = linear_logprobs(hidden, lm_head.weight, targets, temperature)

Layout (one stem per op): reference.py (plain PyTorch), op.py (torch custom ops, autograd, dispatch, first-use
check), csrc/ (C++ CPU kernel, CUDA kernels + launchers); its GRPOTrainer wiring is a library patch and lives with
the others, in ogrpo.patches.trl_linear_logprobs. Names resolve lazily so importing the package does not import torch.
"""

from __future__ import annotations

_EXPORTS = {
    "linear_logprobs": "op", "implementation": "op", "STATUS": "op", "reset": "op",
    "linear_logprobs_reference": "reference", "linear_logprobs_naive": "reference",
    "default_chunk_size": "reference",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{module}"), name)
