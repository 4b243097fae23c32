"""vLLM's OpenAI server as `ogrpo serve` runs it (TRL 1.16 line): unchanged, except that completions which ask
for token ids only are not detokenized.

TRL's client posts token-id prompts with `return_token_ids` and `return_tokens_as_token_ids` and reads back
token ids and log-probs, never text. vLLM still detokenizes every sampled token and decodes the token of every
log-prob entry, in the API server process, on each engine step; on CPU that work competes with the engine for
the same cores. Such requests get `detokenize=False`: the tokens and log-probs are the same, `text` is empty.
A request with stop strings (matched on text) or `echo` keeps detokenizing.

Run as `python -m ogrpo.serve.vllm_api ARGS` with the arguments of `python -m vllm.entrypoints.openai.api_server`.
"""

from __future__ import annotations

import runpy
import sys


def wants_ids_only(request, params) -> bool:
    return bool(getattr(request, "return_token_ids", False) and getattr(request, "return_tokens_as_token_ids", False)
                and not getattr(request, "echo", False) and not params.stop)


def install_ids_only_completions() -> None:
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


def main() -> None:
    install_ids_only_completions()
    sys.argv[0] = "vllm.entrypoints.openai.api_server"
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
