"""One home for sequence-length rules: prompt + completion tokens -> the server's max_model_len.

TRL 1.16 does not truncate prompts, so the prompt length is O-GRPO's planning assumption: `ogrpo.max_prompt_length`,
else an old recipe's `max_prompt_length`, else 512 (capped to what the model's positions leave after the
completion). The completion length is TRL's `max_completion_length` (GRPOConfig's default 512 when unset). Server
and trainer must agree on the sum, so the planner, `ogrpo serve` and the trainer's server check all ask here.
Pure: no torch import.
"""

from __future__ import annotations

import re

DEFAULT_PROMPT_LENGTH = 512
DEFAULT_COMPLETION_LENGTH = 512  # TRL GRPOConfig.max_completion_length default (1.16)
# A model with fewer positions left than this after the completion gets the default prompt budget anyway, and
# the planner reports the overflow instead of planning a uselessly short prompt.
MIN_PROMPT_ROOM = 16


# Runs of letters and groups of up to three digits: every byte-level BPE pre-tokenizer in use (GPT-2's, Llama 3's,
# Qwen's) and SentencePiece's whitespace/script/number split put each in a piece of its own, so their count is a
# lower bound on the tokens of a text under any of them; a long run holds at least one token per LONGEST_TOKEN
# characters (vocabularies' longest pieces are shorter), and any text at least one per LONGEST_ANY (whitespace and
# punctuation runs included).
_PIECES = re.compile(r"[^\W\d_]+|\d{1,3}")
LONGEST_TOKEN = 64
LONGEST_ANY = 256


def min_tokens(text: str, stop: int | None = None) -> int:
    """A lower bound on the tokens of `text` without a tokenizer (cheap: the plan loads none). Counting ends once
    it passes `stop`, so a 50 MB text costs no more than a short one over the same bound."""
    floor = len(text) // LONGEST_ANY
    if stop is not None and floor > stop:
        return floor
    n = 0
    for m in _PIECES.finditer(text):
        n += -(-(m.end() - m.start()) // LONGEST_TOKEN)
        if stop is not None and n > stop:
            break
    return max(n, floor)


def completion_length(trl: dict) -> int:
    return int(trl.get("max_completion_length") or DEFAULT_COMPLETION_LENGTH)


def prompt_length(trl: dict, max_prompt_length: int | None = None, max_positions: int | None = None,
                  completion: int | None = None) -> int:
    """Prompt tokens to budget for (`max_prompt_length`: the ogrpo option, which wins over the TRL key)."""
    prompt = max_prompt_length or trl.get("max_prompt_length")
    if prompt:
        return int(prompt)
    if max_positions:
        room = int(max_positions) - (completion if completion is not None else completion_length(trl))
        if room >= MIN_PROMPT_ROOM:
            return min(DEFAULT_PROMPT_LENGTH, room)
    return DEFAULT_PROMPT_LENGTH


def budget(trl: dict, max_prompt_length: int | None = None, max_positions: int | None = None) -> tuple[int, int]:
    """(prompt, completion) tokens to plan for."""
    completion = completion_length(trl)
    return prompt_length(trl, max_prompt_length, max_positions, completion), completion


def max_model_len(prompt: int, completion: int) -> int:
    return int(prompt) + int(completion)


def required_max_model_len(trl: dict, ogrpo: dict | None = None, plan=None) -> int:
    """Context the trainer needs from the server: TRL's explicit `vllm_max_model_length`, else the Plan's
    `batch.max_model_len` (the plan already capped the prompt budget to the model's positions), else the run's
    prompt budget (or the plan's) plus the completion length. `plan`: the Plan the trainer runs
    (ogrpo/planner/types.py; read by attribute, this layer sits below it), or None."""
    if trl.get("vllm_max_model_length"):
        return int(trl["vllm_max_model_length"])
    ogrpo = ogrpo or {}
    batch = plan.batch if plan is not None else None
    if batch is not None and batch.max_model_len:
        return int(batch.max_model_len)
    prompt = (ogrpo.get("max_prompt_length") or trl.get("max_prompt_length")
              or (batch.prompt_length if batch is not None else 0) or DEFAULT_PROMPT_LENGTH)
    completion = (trl.get("max_completion_length") or (batch.completion_length if batch is not None else 0)
                  or DEFAULT_COMPLETION_LENGTH)
    return max_model_len(prompt, completion)
