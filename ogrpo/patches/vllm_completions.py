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
        return params

    to_sampling_params._ogrpo_ids_only = True
    CompletionRequest.to_sampling_params = to_sampling_params
