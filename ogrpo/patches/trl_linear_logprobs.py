"""TRL: wire linear_logprobs (ogrpo.kernels.linear_logprobs) into TRL's GRPOTrainer where it scores completions (policy, old policy, reference model).

`install(trainer)` teaches the model (and the reference model) a private forward mode that runs the backbone and
then linear_logprobs on the lm_head weight, and returns the Scorer that the trainer's KernelScoring layer
(ogrpo/trainer/kernels.py) calls instead of TRL's scoring. The scoring call still goes through the wrapped model (DDP, DeepSpeed engine, PEFT), so DDP's gradient hooks and ZeRO-3's parameter
hooks fire as for TRL's own call; only the [B, T, V] logits are never built.

Both supported TRL lines have the same method signature; they differ in what they return:
- "fused" line (TRL with `add_fused_lm_head`, e.g. 1.16): scores in the model's forward with a fused LM head;
  positions whose attention mask is 0 get log-prob 0 and entropy 0; the entropy carries a gradient.
- "logits" line (TRL 1.9.2, the GPU images): full logits + selective_log_softmax; padded positions are scored
  like any other; the entropy carries a gradient only when the entropy bonus is on (`_entropy_bonus_enabled`).
Anything outside the plain path (multimodal inputs, the MoE aux loss, a head with a bias or logit softcapping or
scaling) runs TRL's original method, logged once per reason.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types

from ogrpo.errors import OgrpoError
from ogrpo.kernels.linear_logprobs import linear_logprobs
from ogrpo.patches.target import moved

log = logging.getLogger(__name__)

NAME = "trl_linear_logprobs"
LIBRARY = "trl"

METHOD = "_get_per_token_logps_and_entropies"
# The leading parameters both TRL lines (1.9.2 and 1.16.0, read from their sources) share, in order. Every later
# parameter is a multimodal input defaulting to None; when one is set, TRL's original method runs.
LEADING = ("self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
           "compute_aux_loss")
FORWARD_KEY = "ogrpo_linear_logprobs"  # the private forward kwarg; absent in every other call
PATCHED = "_ogrpo_linear_logprobs"  # set on a model whose forward knows FORWARD_KEY
# Config fields that change the logits after the head: any of them set means the head is not a plain projection.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                    "logits_scaling")

_logged: set[str] = set()


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        log.warning("linear_logprobs: using TRL's own log-prob path: %s", reason)


def check_trl_method(cls) -> str:
    """The TRL line's flavour ("fused" or "logits"); OgrpoError if the method this patch replaces moved."""
    method = getattr(cls, METHOD, None)
    if method is None:
        raise moved(NAME, LIBRARY, [f"{cls.__name__} has no {METHOD} (supported: TRL 1.9.2 and 1.16); turn the "
                                    "kernel off in the plan"])
    params = list(inspect.signature(method).parameters.values())
    names = tuple(p.name for p in params)
    extra = [p for p in params[len(LEADING):] if p.default is not None or p.kind is not p.POSITIONAL_OR_KEYWORD]
    if names[:len(LEADING)] != LEADING or extra:
        raise moved(NAME, LIBRARY, [f"{cls.__name__}.{METHOD} changed its signature to ({', '.join(names)}); the "
                                    "patch knows (" + ", ".join(LEADING) + ", <multimodal>=None...); or turn the "
                                    "kernel off"])
    from trl.trainer import utils as trl_utils

    return "fused" if hasattr(trl_utils, "add_fused_lm_head") else "logits"


def check() -> str:
    """TRL's GRPOTrainer still has the scoring method this patch replaces; returns the TRL line."""
    from trl import GRPOTrainer

    return check_trl_method(GRPOTrainer)


def unsupported_reason(model) -> str | None:
    """Why this model's head cannot go through linear_logprobs, or None when it can."""
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:
        return f"lm_head is {type(head).__name__}, not a plain nn.Linear"
    if head.bias is not None:
        return "lm_head has a bias"
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in LOGIT_TRANSFORMS:
        if getattr(config, name, None) not in (None, 1.0):
            return f"the model config sets {name}={getattr(config, name)!r}"
    if getattr(model, "base_model", None) is None or model.base_model is model:
        return "the model exposes no backbone (base_model)"
    return None


def _patch_forward(model) -> bool:
    """Add the private scoring mode to `model.forward` (per instance, on top of any earlier patch)."""
    if getattr(model, PATCHED, False):
        return True
    reason = unsupported_reason(model)
    if reason is not None:
        _log_once(reason)
        return False
    previous = model.forward  # TRL's fused-head forward on the fused line, the class forward otherwise

    # The class forward's signature is kept: `generate` validates its model kwargs against it.
    @functools.wraps(type(model).forward)
    def forward(self, *args, **kwargs):
        spec = kwargs.pop(FORWARD_KEY, None)
        if spec is None:
            return previous(*args, **kwargs)
        return _score(self, spec, **kwargs)

    model.forward = types.MethodType(forward, model)
    setattr(model, PATCHED, True)
    return True


# Forward kwargs a wrapper may add (PEFT passes its whole signature) that mean nothing to the backbone call.
_IGNORED_KWARGS = ("labels", "use_cache", "return_dict", "output_attentions", "output_hidden_states",
                   "num_items_in_batch", "task_ids")


def _score(model, spec: dict, input_ids=None, attention_mask=None, **kwargs):
    """Backbone -> hidden states of the positions that predict the last `logits_to_keep` tokens -> kernel."""
    import torch

    # heavy: torch
    from ogrpo.kernels.linear_logprobs.op import gathered

    if input_ids is None:
        raise OgrpoError("linear_logprobs scoring needs input_ids (prompt-learning adapters that pass "
                         "inputs_embeds are not supported); turn the kernel off in the plan")
    extra = {k: v for k, v in kwargs.items() if v is not None and k not in _IGNORED_KWARGS}
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                              **extra).last_hidden_state
    if "index" in spec:  # a packed pass (ogrpo.trainer.packing): the positions that predict the scored tokens
        hidden, targets = hidden[spec["index"]], spec["targets"]
    else:
        keep = spec["logits_to_keep"]
        hidden = hidden[:, :-1][:, -keep:]  # position i predicts token i + 1; the last position predicts nothing
        targets = input_ids[:, -keep:]
    weight = model.get_output_embeddings().weight
    # the head's dtype decides (TRL's cast_lm_head_to_fp32 keeps an fp32 head under bf16 autocast)
    hidden = hidden.to(device=weight.device, dtype=weight.dtype)
    with torch.autocast(hidden.device.type, enabled=False), gathered(weight):
        return linear_logprobs(hidden, weight, targets.to(weight.device), spec["temperature"])


def unwrap(trainer, model):
    """The transformers model inside the trainer's wrappers (accelerate's, PEFT's)."""
    inner = trainer.accelerator.unwrap_model(model)
    if hasattr(inner, "get_base_model"):  # PEFT: the transformers model sits inside
        inner = inner.get_base_model()
    return inner


def install(trainer) -> tuple[dict, object]:
    """Teach `trainer`'s models the kernel's scoring mode. Returns what was done (for the manifest): {"installed",
    "trl_line", "models", "reason", "implementation"}, and the scorer the trainer's KernelScoring layer calls in
    place of TRL's scoring (None where the policy cannot use it); the implementation (compiled or the PyTorch
    fallback, and why) is decided here, so a build problem shows before the first step. Raises OgrpoError if TRL's
    method moved."""
    line = check()
    models = {"policy": _patch_forward(unwrap(trainer, trainer.model))}
    if getattr(trainer, "ref_model", None) is not None:
        models["reference"] = _patch_forward(unwrap(trainer, trainer.ref_model))
    if not models["policy"]:
        return {"installed": False, "trl_line": line, "models": models,
                "reason": unsupported_reason(unwrap(trainer, trainer.model)), "implementation": None}, None
    # heavy: torch
    from ogrpo.kernels.linear_logprobs.op import implementation

    device = unwrap(trainer, trainer.model).get_output_embeddings().weight.device
    return ({"installed": True, "trl_line": line, "models": models, "reason": None,
             "implementation": implementation(device)}, Scorer(line))


class Scorer:
    """TRL's `_get_per_token_logps_and_entropies` through the kernel where the call is the plain path; `calls`
    counts which calls ran the kernel and which fell back to TRL's path (the manifest's `calls`)."""

    def __init__(self, line: str):
        self.line = line
        self.calls = {"kernel": 0, "trl": 0}

    def __call__(self, trainer, original, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                 compute_entropy=False, compute_aux_loss=False, **extra):
        reason = None
        if compute_aux_loss:
            reason = "the MoE load-balancing loss is requested"
        elif any(v is not None for v in extra.values()):
            reason = "multimodal inputs (" + ", ".join(k for k, v in extra.items() if v is not None) + ")"
        elif not getattr(unwrap(trainer, model), PATCHED, False):
            reason = "the scoring model was not patched (unsupported head)"
        if reason is not None:
            _log_once(reason)
            self.calls["trl"] += 1
            return original(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                            compute_aux_loss, **extra)
        self.calls["kernel"] += 1
        return _scored(trainer, self.line, model, input_ids, attention_mask, logits_to_keep, batch_size,
                       compute_entropy)


def _scored(trainer, line, model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy):
    import torch

    batch_size = batch_size or input_ids.size(0)  # TRL's micro-batching of the scoring pass, kept
    spec = {"logits_to_keep": logits_to_keep, "temperature": trainer.temperature}
    all_logps, all_entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids = input_ids[start:start + batch_size]
        mask = attention_mask[start:start + batch_size]
        if line == "fused":
            with trainer.accelerator.autocast():
                logps, entropies = model(input_ids=ids, attention_mask=mask, **{FORWARD_KEY: spec})
            padded = mask[:, -logits_to_keep:] == 0  # TRL scores these as label -100: zero log-prob and entropy
            logps, entropies = logps.masked_fill(padded, 0.0), entropies.masked_fill(padded, 0.0)
        else:
            logps, entropies = model(input_ids=ids, attention_mask=mask, **{FORWARD_KEY: spec})
            if not getattr(trainer, "_entropy_bonus_enabled", False):
                entropies = entropies.detach()  # TRL 1.9 computes it under no_grad unless the bonus is on
        all_logps.append(logps)
        all_entropies.append(entropies)
    logps = torch.cat(all_logps, dim=0)
    entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
    return logps, entropies, None
