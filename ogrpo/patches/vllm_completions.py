"""vLLM: completions that ask for token ids only are not detokenized (`python -m ogrpo.serve.vllm_api`).

TRL's client posts token-id prompts with `return_token_ids` and `return_tokens_as_token_ids` and reads back
token ids and log-probs, never text. vLLM still detokenizes every sampled token and decodes the token of every
log-prob entry, in the API server process, on each engine step; on CPU that work competes with the engine for
the same cores. Such requests get `detokenize=False`: the tokens and log-probs are the same, `text` is empty.
A request with stop strings (matched on text) or `echo` keeps detokenizing.
"""

from __future__ import annotations

from ogrpo.patches.target import moved, require

NAME = "vllm_completions"
LIBRARY = "vllm"
TARGETS = {"vllm.entrypoints.openai.completion.protocol:CompletionRequest.to_sampling_params": ("self",),
           "vllm:SamplingParams": ("detokenize", "stop")}
# request fields read by wants_ids_only
REQUEST_FIELDS = ("return_token_ids", "return_tokens_as_token_ids", "echo")


def check() -> None:
    require(NAME, LIBRARY, TARGETS)
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    fields = getattr(CompletionRequest, "model_fields", {})
    missing = [f for f in REQUEST_FIELDS if f not in fields]
    if missing:
        raise moved(NAME, LIBRARY, [f"CompletionRequest lost the field(s) {', '.join(missing)}"])


def wants_ids_only(request, params) -> bool:
    return bool(getattr(request, "return_token_ids", False) and getattr(request, "return_tokens_as_token_ids", False)
                and not getattr(request, "echo", False) and not params.stop)


def spread_seed(request, params) -> None:
    """A seeded request of TRL's client (ogrpo.serve.client.seeded_generation_kwargs): prompt i of the request
    samples with seed + i x n, and vLLM gives completion j of it seed + i x n + j, so no two sequences of one
    request share their random draws (vLLM's default hands every prompt the same seed). vLLM builds one
    SamplingParams per prompt, in prompt order: the count of calls so far on this request is the prompt index."""
    if params.seed is None:
        return
    index = getattr(request, "_ogrpo_prompt_index", 0)
    object.__setattr__(request, "_ogrpo_prompt_index", index + 1)  # the pydantic model takes no new fields
    params.seed = int(params.seed) + index * max(1, int(params.n or 1))


def install() -> None:
    check()
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    original = CompletionRequest.to_sampling_params
    if getattr(original, "_ogrpo_ids_only", False):
        return

    def to_sampling_params(self, *args, **kwargs):
        params = original(self, *args, **kwargs)
        if wants_ids_only(self, params):
            params.detokenize = False
            spread_seed(self, params)
        return params

    to_sampling_params._ogrpo_ids_only = True
    CompletionRequest.to_sampling_params = to_sampling_params
