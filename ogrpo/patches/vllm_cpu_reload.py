"""vLLM (CPU build): load new weights into a running model, for the colocated trainer and the server's `cpu_shm`
weight-transfer backend. Not a monkeypatch, but it drives vLLM internals (the layerwise reload) and filters one of
vLLM's loggers, so it lives with the patches and has a `check()`.

Why this exists: on CPU, vLLM packs each linear weight into a oneDNN/AMX handle after loading and replaces
`layer.weight` by an empty Parameter, so TRL's per-parameter `load_weights` fails (`no attribute
'weight_loader'`). What works: ONE layerwise reload for all weights (one reload per
parameter gives NaN), then rebuilding the packed copy of a tied `lm_head`, which otherwise stays stale and makes
outputs drift silently. Used by the colocated trainer and by the server's `cpu_shm` weight-transfer backend.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from ogrpo.patches.target import require

NAME = "vllm_cpu_reload"
LIBRARY = "vllm"
TARGETS = {
    "vllm.model_executor.model_loader.reload:initialize_layerwise_reload": ("model",),
    "vllm.model_executor.model_loader.reload:finalize_layerwise_reload": ("model", "model_config"),
    "vllm.model_executor.model_loader.reload:layerwise.logger": None,
}


def check() -> None:
    require(NAME, LIBRARY, TARGETS)


def refresh_tied_lm_head(model: Any) -> None:
    if _is_tied(model):
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


def _is_tied(model: Any) -> bool:
    lm = getattr(model, "lm_head", None)
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    return lm is not None and emb is not None and getattr(lm, "weight", None) is emb.weight


class _ExpectedNotLoaded(logging.Filter):
    """Drops vLLM's "<Layer>: Failed to load weights" for layers that never receive weights by design, logged on
    every push during the layerwise reload:
    - RotaryEmbedding: its cos/sin cache is computed from the config, never part of a checkpoint or a push;
    - ParallelLMHead, when tied to the embedding: it shares the embedding's tensor, so there is no lm_head
      entry to load; the embedding was loaded and refresh_tied_lm_head repacks the head from it right after
      (the log-prob gap tests check the result). For an untied head the line stays: then it is real;
    - modules that own no tensor at all (Qwen2Model, ModuleList, SiluAndMul ...): vLLM 0.19 (the images' line,
      CI's second env) logs the line for each of them on every reload; there is nothing they could load."""

    def __init__(self, tied_head: bool, tensorless: frozenset[str] = frozenset()):
        super().__init__()
        self.expected = {"RotaryEmbedding"} | ({"ParallelLMHead"} if tied_head else set()) | set(tensorless)

    def filter(self, record: logging.LogRecord) -> bool:
        layer, sep, rest = record.getMessage().partition(": ")
        return not (sep and rest == "Failed to load weights" and layer in self.expected)


def _tensorless_classes(model: Any) -> frozenset[str]:
    """Class names whose every instance in MODEL owns no parameter or buffer itself."""
    owns: dict[str, bool] = {}
    for m in model.modules():
        mine = any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False))
        owns[type(m).__name__] = owns.get(type(m).__name__, False) or mine
    return frozenset(name for name, has in owns.items() if not has)


def begin_reload(model: Any) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    # Read before the reload: it swaps the layers' tensors, and the head/embedding identity only holds again
    # after it has finished.
    model._ogrpo_tied_head = _is_tied(model)
    model._ogrpo_tensorless = _tensorless_classes(model)
    initialize_layerwise_reload(model)


def finish_reload(model: Any, model_config: Any) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, layerwise

    notice = _ExpectedNotLoaded(bool(getattr(model, "_ogrpo_tied_head", False)),
                                getattr(model, "_ogrpo_tensorless", frozenset()))
    layerwise.logger.addFilter(notice)
    try:
        finalize_layerwise_reload(model, model_config)
    finally:
        layerwise.logger.removeFilter(notice)
    refresh_tied_lm_head(model)


def reload_weights(model: Any, model_config: Any, weights: Iterable[tuple[str, Any]]) -> None:
    """Push all (name, tensor) pairs into `model` as one layerwise reload."""
    begin_reload(model)
    model.load_weights(weights)
    finish_reload(model, model_config)
