"""TRL's GRPOTrainer, its VLLMGeneration and its VLLMClient: the methods several of O-GRPO's modules wrap on the one
trainer's instances, and the order those wrappers stack in, stated once (ORDER) and enforced by `wrap`.

Every such wrapper goes through `wrap(obj, method, layer, make)`: the layer must be listed for that method in
ORDER, and it is refused (OgrpoError, naming both) when a layer that ORDER puts outside it is already installed,
so a reordered install in ogrpo.train.run fails at start-up instead of timing, guarding or pipelining the wrong
thing. Layers, innermost first (each one installed after, and so around, the ones before it):

- `linear_logprobs` (ogrpo.patches.trl_linear_logprobs): replaces TRL's scoring computation itself;
- `passes` (ogrpo.train.profiler, StageProfiler.count_passes): counts the positions each forward that runs
  computes and the ones its mask keeps (`pad_share`), beneath the overlap, so that the streamed groups' own passes
  are counted and the TRL calls the overlap answers with them are not;
- `overlap` (ogrpo.patches.trl_overlap): hands TRL results computed ahead (the streamed groups' log-probs and
  rewards), so it must see the kernel's pass beneath it and be seen by the layers above as TRL's own call;
- `profiler` (ogrpo.train.profiler): times whatever runs below, the overlap's hand-over included; on the client,
  it reads whether the overlap pipeline (ogrpo.train.overlap.Pipeline.attach, beneath it) already records the
  server's busy spans;
- `nonfinite` (ogrpo.train.callbacks): checks the loss and log-probs TRL finally receives, outermost, so its
  error is the one the trainer sees;
- `zero3_push` (ogrpo.patches.trl_zero3_push): the ZeRO-3 push's parameter iterator, alone on it;
- `overlap_resume` (ogrpo.train.overlap_resume): the Trainer's per-checkpoint RNG save/load, alone on them.

The overlap pipeline's layers on the client instance (ogrpo.train.overlap.Pipeline.attach) are set by the
pipeline itself, before the profiler's: listed here for the order, they carry no layer mark, so `wrap` cannot
refuse a profiler installed beneath them.

Class-level patches of the same methods (ogrpo.patches.trl_colocate_cpu's `VLLMGeneration.sync_weights`,
ogrpo.serve.client's VLLMClient subclasses) sit beneath every instance layer by construction.
"""

from __future__ import annotations

import functools

from ogrpo.errors import OgrpoError
from ogrpo.patches.target import moved, problems_of, resolve, trl_generation_module

NAME = "trl_trainer_wraps"
LIBRARY = "trl"
_GRPO = "trl.trainer.grpo_trainer"

# (object, method) -> O-GRPO's layers on it, innermost first: the order they are installed in
ORDER: dict[tuple[str, str], tuple[str, ...]] = {
    ("trainer", "_get_per_token_logps_and_entropies"): ("linear_logprobs", "passes", "overlap", "profiler",
                                                        "nonfinite"),
    ("trainer", "training_step"): ("profiler", "nonfinite"),
    ("trainer", "_generate"): ("overlap", "profiler"),
    ("trainer", "_generate_and_score_completions"): ("overlap", "profiler"),
    ("trainer", "_calculate_rewards"): ("overlap", "profiler"),
    ("trainer", "get_batch_samples"): ("overlap",),
    ("trainer", "_log_completion_extra"): ("overlap",),
    ("trainer", "_log_metric"): ("overlap",),
    # transformers' Trainer calls these once per checkpoint (save) and on resume (load): the batch in flight
    # travels with the checkpoint
    ("trainer", "_save_rng_state"): ("overlap_resume",),
    ("trainer", "_load_rng_state"): ("overlap_resume",),
    ("vllm_generation", "sync_weights"): ("profiler",),
    ("vllm_generation", "_iter_named_params"): ("zero3_push",),
    ("vllm_client", "generate"): ("overlap", "profiler"),
    ("vllm_client", "update_named_params"): ("overlap",),
    ("vllm_client", "update_named_param"): ("overlap",),
    ("vllm_client", "reset_prefix_cache"): ("overlap",),
}
# methods a layer wraps only where the TRL line has them (the others must exist on every supported line)
OPTIONAL = {("trainer", "_log_completion_extra"), ("trainer", "_log_metric"),
            ("vllm_generation", "_iter_named_params"), ("vllm_client", "update_named_params"),
            ("vllm_client", "update_named_param")}
_LAYERS = "_ogrpo_layers"  # on each wrapper: the layers it and everything beneath it are, innermost first


def check() -> None:
    """Every method ORDER wraps exists on TRL's classes (the optional ones on the lines that have them)."""
    from ogrpo.patches import installed

    owners = {"trainer": f"{_GRPO}:GRPOTrainer"}
    if installed("vllm"):  # TRL's generation and client modules import vLLM
        gen = trl_generation_module(NAME)
        owners.update(vllm_generation=f"{gen}:VLLMGeneration", vllm_client=f"{gen}:VLLMClient")
    problems = problems_of({f"{owners[kind]}.{method}": None for kind, method in ORDER
                            if kind in owners and (kind, method) not in OPTIONAL})
    if "vllm_client" in owners:
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


def wrap(obj, method: str, layer: str, make, kind: str = "trainer") -> None:
    """`obj.method = make(obj.method)` on this instance (`kind`: trainer | vllm_generation | vllm_client), as
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
