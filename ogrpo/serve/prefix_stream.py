"""One completion's request, streamed: the tokens sampled so far reach the trainer while the server still
generates (issue 36: the reference pass of a completion runs on its prefix as it grows, so that only its last
tokens wait for its end).

TRL's client (`VLLMClient.generate`, TRL >= 1.16: vLLM's API server) asks `/v1/completions` once and reads the
whole answer. Here the same request (the payload TRL builds from the same arguments, TRL's defaults read off its
signature) is sent with `stream: true` and vLLM's per-request `stream_interval`, so the server sends the new
tokens every INTERVAL tokens; `on_tokens(ids)` gets the completion's token ids so far after each chunk but the
last. Streaming changes nothing the engine samples (the sampling parameters, the seed included, are the same), and
the answer is assembled into the dict TRL's `generate` returns, from the same fields: prompt ids, completion ids and
the sampled tokens' log-probs (the chunks' `logprobs` lists end to end are the unstreamed answer's).
"""

from __future__ import annotations

import inspect
import json
from typing import Any, Callable

from ogrpo.serve.auth import UNFINISHED, GenerationAborted

INTERVAL = 16  # tokens per streamed chunk: about 16 messages a completion at the 256-token cap
_LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def trl_generate_problems() -> list[str]:
    """What this module relies on in TRL's client that is no longer there (empty: all found): the route, the
    token-id options and the log-prob parser its `generate` uses."""
    from trl.generation import vllm_client

    source = inspect.getsource(vllm_client.VLLMClient.generate)
    problems = [f"VLLMClient.generate no longer sends {needle}" for needle in
                ("/v1/completions", '"return_token_ids": True', '"return_tokens_as_token_ids": True', "parse_logprobs(")
                if needle not in source]
    if not hasattr(vllm_client, "parse_logprobs"):
        problems.append("trl.generation.vllm_client.parse_logprobs is gone")
    return problems


def _sampling(kwargs: dict) -> dict:
    """The sampling parameters TRL's `generate` sends for these keywords, its own defaults filled in."""
    from trl.generation.vllm_client import VLLMClient

    bound = inspect.signature(VLLMClient.generate).bind(None, **kwargs)
    bound.apply_defaults()
    args = dict(bound.arguments)
    params = {k: args[k] for k in ("n", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
                                   "max_tokens", "logprobs")}
    if args.get("structured_outputs_regex") is not None:
        params["structured_outputs"] = {"regex": args["structured_outputs_regex"]}
    params.update(args.get("generation_kwargs") or {})
    return params


def streamable(kwargs: dict) -> bool:
    """Whether a request with these keywords can stream: one prompt of token ids or text, one completion, no image
    features (those go through another route)."""
    prompts = kwargs.get("prompts")
    return (kwargs.get("features") is None and isinstance(prompts, list) and len(prompts) == 1
            and int(kwargs.get("n") or 1) == 1)


def generate(client, on_tokens: Callable[[list[int]], Any], interval: int = INTERVAL, **kwargs) -> dict:
    """TRL's `client.generate(**kwargs)` for one completion, streamed; `on_tokens(ids so far)` after each chunk
    that does not end it. Raises like TRL's client on an HTTP error."""
    from trl.generation.vllm_client import parse_logprobs

    payload = {"model": client.model, "prompt": kwargs["prompts"], "return_token_ids": True,
               "return_tokens_as_token_ids": True, **_sampling(kwargs), "stream": True,
               "stream_interval": int(interval)}
    prompt_ids: list[int] | None = None
    finished: str | None = None
    ids: list[int] = []
    logprobs: dict[str, list] | None = None
    with client.session.post(f"{client.base_url}/v1/completions", json=payload, stream=True) as response:
        if response.status_code != 200:
            raise Exception(f"Request failed: {response.status_code}, {response.text}")
        for line in response.iter_lines():
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise Exception(f"Request failed: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                if choice.get("prompt_token_ids") is not None:
                    prompt_ids = list(choice["prompt_token_ids"])
                ids.extend(choice.get("token_ids") or [])
                part = choice.get("logprobs")
                if part is not None:
                    logprobs = logprobs or {k: [] for k in _LISTS}
                    for k in _LISTS:
                        logprobs[k].extend(part.get(k) or [])
                if choice.get("finish_reason") is None:
                    on_tokens(list(ids))
                else:
                    finished = choice["finish_reason"]
    # as the unstreamed answers are checked (ogrpo.serve.auth): a sequence the server did not finish (aborted on
    # its way down, failed) or a stream cut before its end is never a completion
    if finished is None or finished in UNFINISHED:
        raise GenerationAborted(f"vLLM server's streamed answer from {client.base_url}/v1/completions "
                                + (f"ended with finish_reason {finished}" if finished else "ended before its finish")
                                + " (an unfinished sequence); it is not used")
    if prompt_ids is None:
        raise Exception("Request failed: the streamed answer carried no prompt token ids")
    parsed, parsed_ids = parse_logprobs([logprobs])
    return {"prompt_ids": [prompt_ids], "completion_ids": [ids], "logprobs": parsed,
            "logprob_token_ids": parsed_ids}
