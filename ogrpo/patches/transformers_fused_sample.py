"""transformers: fused sampling (ogrpo.kernels.fused_sample) inside HF `generate` (TRL's rollout when `use_vllm` is false).

Hook: transformers 5.19's `generate` calls `type(self)._sample(self, input_ids, logits_processor=...,
generation_config=...)`, and `_sample` picks each token as `argmax(logits_processor(input_ids, logits))` when
`do_sample` is false. So the wrapper swaps the processor list for one `FusedSampler` that draws the token with
`fused_sample` and returns a score row whose argmax is that token, and passes `do_sample=False`: the chain's
full-vocabulary sort (top-p), the softmax and torch.multinomial are gone, the decoding loop stays transformers'
own. It does so only when the chain holds nothing but the four processors fused_sample implements (repetition
penalty, temperature, top-k, top-p with transformers' defaults) and per-step scores are not requested; any other
generate call runs untouched. The wrapper is installed on the model's class but acts only for instances that
`install` marked, so other models of the same class keep stock behaviour.

Seeding: sampled tokens come from `torch.rand` on the default generator (the one torch.multinomial would use),
so `torch.manual_seed` makes a patched rollout reproducible; greedy decoding is token-for-token unchanged.
"""

from __future__ import annotations

import copy
import inspect

from ogrpo.errors import OgrpoError
from ogrpo.kernels.fused_sample import fused_sample
from ogrpo.patches.target import moved

NAME = "transformers_fused_sample"
LIBRARY = "transformers"

_MARK = "_ogrpo_fused_sample"
_ORIGINAL = "_ogrpo_original"

# What the hook relies on in transformers' source: if one of these moved, installing must fail loudly rather than
# silently sample with the stock chain (or, worse, with a half-applied one).
_SAMPLE_NEEDS = ("next_token_scores = logits_processor(input_ids, next_token_logits)",
                 "next_tokens = torch.argmax(next_token_scores, dim=-1)", "if do_sample:")
_GENERATE_NEEDS = "getattr(type(self), GENERATION_MODES_MAPPING[generation_mode])"
_SAMPLE_PARAMS = ("input_ids", "logits_processor", "stopping_criteria", "generation_config")


def check_hook() -> None:
    """Raise OgrpoError when transformers' generate no longer has the shape this hook patches."""
    import transformers
    from transformers.generation import logits_process as lp
    from transformers.generation import utils

    problems = []
    mapping = getattr(utils, "GENERATION_MODES_MAPPING", {})
    for mode in ("SAMPLE", "GREEDY_SEARCH"):
        if mapping.get(getattr(utils.GenerationMode, mode, None)) != "_sample":
            problems.append(f"GENERATION_MODES_MAPPING[{mode}] is no longer '_sample'")
    sample = getattr(utils.GenerationMixin, "_sample", None)
    if sample is None:
        problems.append("GenerationMixin._sample is gone")
    else:
        params = inspect.signature(sample).parameters
        problems += [f"_sample lost its `{name}` parameter" for name in _SAMPLE_PARAMS if name not in params]
        source = inspect.getsource(sample)
        problems += [f"_sample no longer contains `{line}`" for line in _SAMPLE_NEEDS if line not in source]
    generate = getattr(utils.GenerationMixin, "generate", None)
    if generate is None or _GENERATE_NEEDS not in inspect.getsource(generate):
        problems.append(f"generate no longer dispatches through `{_GENERATE_NEEDS}`")
    attrs = {lp.RepetitionPenaltyLogitsProcessor: ("penalty", "prompt_ignore_length"),
             lp.TemperatureLogitsWarper: ("temperature",),
             lp.TopKLogitsWarper: ("top_k", "filter_value"),  # min_tokens_to_keep is folded into top_k
             lp.TopPLogitsWarper: ("top_p", "filter_value", "min_tokens_to_keep")}
    for cls, names in attrs.items():
        probe = _probe(cls)
        problems += [f"{cls.__name__} has no `{n}`" for n in names if not hasattr(probe, n)]
    if problems:
        raise moved(NAME, LIBRARY, [f"fused sampling cannot hook transformers {transformers.__version__}: "
                                    + "; ".join(problems)])


check = check_hook  # the name every patch module exposes


def _probe(cls):
    from transformers.generation import logits_process as lp

    args = {lp.RepetitionPenaltyLogitsProcessor: (1.1,), lp.TemperatureLogitsWarper: (0.7,),
            lp.TopKLogitsWarper: (5,), lp.TopPLogitsWarper: (0.9,)}[cls]
    return cls(*args)


def install(model_or_trainer):
    """Route `generate`'s sampling through `fused_sample` for this model (a PreTrainedModel, a wrapped one, or a
    trainer holding one). Returns the patched model. Idempotent."""
    from transformers.generation.utils import GenerationMixin

    check_hook()
    model = _generating_model(model_or_trainer)
    cls = type(model)
    current = cls._sample
    while _ORIGINAL in getattr(current, "__dict__", {}):
        current = current.__dict__[_ORIGINAL]
    if current is not GenerationMixin._sample:  # check_hook vouched for GenerationMixin's loop only
        raise OgrpoError(f"fused sampling: {cls.__name__} overrides generate's `_sample`; leave use_vllm on or "
                         "drop the fused-sampling hook for this model")
    if _ORIGINAL not in getattr(cls.__dict__.get("_sample"), "__dict__", {}):
        cls._sample = _wrap(cls._sample)
    setattr(model, _MARK, True)
    return model


def uninstall(model_or_trainer) -> None:
    """Stock sampling again for this model (the class keeps the inert wrapper)."""
    model = _generating_model(model_or_trainer)
    if getattr(model, _MARK, False):
        delattr(model, _MARK)


def _generating_model(obj):
    from transformers.generation.utils import GenerationMixin

    if hasattr(obj, "accelerator") and hasattr(obj, "model"):  # a (TRL) Trainer
        obj = obj.model
    for _ in range(8):  # DDP / DeepSpeed engine (.module) and PEFT (get_base_model) wrap the generating model
        if isinstance(obj, GenerationMixin) and not hasattr(obj, "get_base_model"):
            return obj
        if hasattr(obj, "get_base_model"):
            obj = obj.get_base_model()
        elif hasattr(obj, "module"):
            obj = obj.module
        else:
            break
    raise OgrpoError(f"fused sampling: {type(obj).__name__} is not a transformers model with `generate`")


def _wrap(original):
    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        if getattr(self, _MARK, False):
            plan = fused_plan(logits_processor, generation_config)
            if plan is not None:
                generation_config = copy.copy(generation_config)
                generation_config.do_sample = False  # _sample then takes argmax of our one-hot scores
                from transformers.generation.logits_process import LogitsProcessorList

                logits_processor = LogitsProcessorList([FusedSampler(**plan)])
        return original(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs)

    _sample.__dict__[_ORIGINAL] = original
    _sample.__doc__ = original.__doc__
    return _sample


def fused_plan(processors, generation_config) -> dict | None:
    """fused_sample's arguments equivalent to `processors` (+ sampling), or None when they are not expressible."""
    from transformers.generation import logits_process as lp

    if generation_config.return_dict_in_generate and generation_config.output_scores:
        return None  # the caller wants the processed scores, which the fused path never materializes
    order = (lp.RepetitionPenaltyLogitsProcessor, lp.TemperatureLogitsWarper, lp.TopKLogitsWarper,
             lp.TopPLogitsWarper)
    sampling = bool(generation_config.do_sample)
    plan = {"temperature": 1.0 if sampling else 0.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}
    last = -1
    for proc in processors:
        kind = order.index(type(proc)) if type(proc) in order else None
        if kind is None or kind <= last:  # an unknown processor, a subclass, or an unusual order
            return None
        last = kind
        if kind == 0:
            if proc.prompt_ignore_length or getattr(proc, "logits_indices", None) is not None:
                return None
            plan["repetition_penalty"] = float(proc.penalty)
        elif kind == 1:
            plan["temperature"] = float(proc.temperature)
        else:
            if proc.filter_value != -float("inf"):
                return None
            if kind == 2:  # top_k already holds max(top_k, min_tokens_to_keep) (transformers 5.5 keeps no more)
                plan["top_k"] = int(proc.top_k)
            elif proc.min_tokens_to_keep != 1:
                return None
            else:
                plan["top_p"] = float(proc.top_p)
    if not sampling and (last > 0 or plan["repetition_penalty"] == 1.0):
        return None  # greedy: warpers never run; plain argmax needs no fusing
    return plan


class FusedSampler:
    """A one-member logits-processor list: draws the next token with fused_sample and returns scores that are 0
    at that token and -inf elsewhere, so `_sample`'s greedy argmax returns it."""

    def __init__(self, temperature: float, top_k: int, top_p: float, repetition_penalty: float):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.repetition_penalty = repetition_penalty

    def __call__(self, input_ids, scores):
        import torch

        previous = input_ids if self.repetition_penalty != 1.0 else None
        tokens = fused_sample(scores, self.temperature, self.top_k, self.top_p, self.repetition_penalty, previous,
                              None)
        # A new tensor: with output_logits, `scores` is the raw-logits tensor transformers hands back.
        picked = torch.full_like(scores, -float("inf"))
        return picked.scatter_(1, tokens[:, None], 0.0)
