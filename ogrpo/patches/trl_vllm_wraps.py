"""TRL's VLLMGeneration and VLLMClient, instances the trainer builds inside TRL's own __init__: the methods O-GRPO
wraps on them, and the order those wrappers stack in, stated once (ORDER) and enforced by `wrap`. (The trainer's
own methods are not wrapped: OgrpoGRPOTrainer overrides them, its layers' order is its class's, see
ogrpo/trainer/grpo.py.)

Every such wrapper goes through `wrap(obj, method, layer, make)`: the layer must be listed for that method in
ORDER, and it is refused (OgrpoError, naming both) when a layer that ORDER puts outside it is already installed,
so a reordered install fails at start-up instead of timing or pipelining the wrong thing. Layers, innermost first
(each one installed after, and so around, the ones before it):

- `overlap` (ogrpo.overlap.pipeline.Pipeline.attach): the main process's client sends requests ahead, waits for
  them before a weight push and learns the server's version after it;
- `profiler` (ogrpo.profile.profiler): times the push and the requests the trainer waits on, the overlap's
  hand-over included;
- `zero3_push` (ogrpo.patches.trl_zero3_push): the ZeRO-3 push's parameter iterator, alone on it.

Class-level patches of the same methods (ogrpo.patches.trl_colocate_cpu's `VLLMGeneration.sync_weights`,
ogrpo.serve.client's VLLMClient subclasses) sit beneath every instance layer by construction.
"""

from __future__ import annotations

import functools

from ogrpo.errors import OgrpoError
from ogrpo.patches.target import moved, problems_of, resolve, trl_generation_module

NAME = "trl_vllm_wraps"
LIBRARY = "trl"

# (object, method) -> O-GRPO's layers on it, innermost first: the order they are installed in
ORDER: dict[tuple[str, str], tuple[str, ...]] = {
    ("vllm_generation", "sync_weights"): ("profiler",),
    ("vllm_generation", "_iter_named_params"): ("zero3_push",),
    ("vllm_client", "generate"): ("overlap", "profiler"),
    ("vllm_client", "update_named_params"): ("overlap",),
    ("vllm_client", "update_named_param"): ("overlap",),
    ("vllm_client", "reset_prefix_cache"): ("overlap",),
}
# methods a layer wraps only where the TRL line has them (the others must exist on every supported line)
OPTIONAL = {("vllm_generation", "_iter_named_params"), ("vllm_client", "update_named_params"),
            ("vllm_client", "update_named_param")}
_LAYERS = "_ogrpo_layers"  # on each wrapper: the layers it and everything beneath it are, innermost first


def check() -> None:
    """Every method ORDER wraps exists on TRL's classes (the optional ones on the lines that have them)."""
    gen = trl_generation_module(NAME)  # TRL's generation and client modules import vLLM (a REQUIRES of this patch)
    owners = {"vllm_generation": f"{gen}:VLLMGeneration", "vllm_client": f"{gen}:VLLMClient"}
    problems = problems_of({f"{owners[kind]}.{method}": None for kind, method in ORDER
                            if (kind, method) not in OPTIONAL})
    try:
        client = resolve(owners["vllm_client"])
    except (ImportError, AttributeError):
        client = None  # already a problem: its generate is gone
    if client is not None and not any(hasattr(client, m) for m in ("update_named_params", "update_named_param")):
        problems.append(f"{owners['vllm_client']} has neither update_named_params nor update_named_param "
                        "(the weight push)")
    if problems:
        raise moved(NAME, LIBRARY, problems)


def layers(obj, method: str) -> tuple[str, ...]:
    """O-GRPO's layers installed on `obj.method`, innermost first."""
    return tuple(getattr(getattr(obj, method, None), _LAYERS, ()))


def wrap(obj, method: str, layer: str, make, kind: str) -> None:
    """`obj.method = make(obj.method)` on this instance (`kind`: vllm_generation | vllm_client), as
    `layer` of ORDER; the wrapper keeps the wrapped one's name, docstring and signature (functools)."""
    order = ORDER.get((kind, method))
    if order is None or layer not in order:
        raise OgrpoError(f"{layer} wraps {kind}.{method}, which ogrpo/patches/{NAME}.py does not list for it")
    original = getattr(obj, method, None)
    if original is None:
        raise moved(NAME, LIBRARY, [f"the {kind} has no {method} (wrapped by {layer})"])
    below = layers(obj, method)
    outside = [other for other in below if other in order and order.index(other) > order.index(layer)]
    if outside:
        raise OgrpoError(f"{layer} must wrap {kind}.{method} before {', '.join(outside)} does (the order in "
                         f"ogrpo/patches/{NAME}.py: {' < '.join(order)})")
    wrapped = make(original)  # a new function (or partial) per install: its attributes are set below
    functools.update_wrapper(wrapped, original)
    setattr(wrapped, _LAYERS, (*below, layer))
    setattr(obj, method, wrapped)
