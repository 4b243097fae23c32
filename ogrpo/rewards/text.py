"""Rewards on the completion's text alone, with open-r1's meaning (src/open_r1/rewards.py): format, tag count,
reasoning steps, n-gram repetition, overlong punishment, and the zero-math-code branch's think_format
(code_format lives with the code rewards); plus `soft_format`, the lenient format check of the GRPO demo open-r1
adapted its tag_count from (tags in order, any whitespace between them).

Pure Python, so these run anywhere; parameterised ones are factories taking the recipe's values. The layout
checks are linear-time scanners with the regexes' exact answers (ogrpo/rewards/formats.py): the regexes backtrack
for seconds on long model-written text. `_STEPS` stays a regex: it is linear already, since each alternative is
a literal or `Step ` plus one digit run that only that occurrence scans.
"""

from __future__ import annotations

import re

from ogrpo.rewards.formats import is_format, is_soft_format, is_think_format
from ogrpo.rewards.math import completion_text

_STEPS = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)")


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 for exactly `<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>`, else 0.0. As open-r1's `$` under
    re.MULTILINE, `</answer>` may also end a line before the text's end (trailing lines after it pass)."""
    return [1.0 if is_format(completion_text(c)) else 0.0 for c in completions]


def soft_format_reward(completions, **kwargs) -> list[float]:
    """1.0 when a `<think>...</think>` block is followed by an `<answer>...</answer>` block, newlines optional."""
    return [1.0 if is_soft_format(completion_text(c).strip()) else 0.0 for c in completions]


def think_format_reward(completions, **kwargs) -> list[float]:
    """open-r1's `think_format` (branch zero-math-code): 1.0 when the completion is only whitespace before its
    `<think>` and has exactly one `<think>` and one `</think>` (anything may follow), else 0.0. Not TRL's
    `think_format_reward`, which differs."""
    return [1.0 if is_think_format(completion_text(c)) else 0.0 for c in completions]


def tag_count_reward(completions, **kwargs) -> list[float]:
    """0.25 for each of `<think>\\n`, `\\n</think>\\n`, `\\n<answer>\\n`, `\\n</answer>` present exactly once."""
    tags = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
    return [sum(0.25 for tag in tags if completion_text(c).count(tag) == 1) for c in completions]


def reasoning_steps_reward(completions, **kwargs) -> list[float]:
    """min(1, markers / 3): "Step N:", "N." at a line start (without re.MULTILINE only the text's start counts,
    as in open-r1), bullets after a newline, First/Second/Next/Finally."""
    return [min(1.0, len(_STEPS.findall(completion_text(c))) / 3) for c in completions]


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0):
    """DeepSeek-style n-gram repetition penalty: (1 - unique n-grams / n-grams) * max_penalty over lower-cased
    whitespace words; 0 for a text shorter than one n-gram."""
    if max_penalty > 0:
        raise ValueError(f"repetition_max_penalty {max_penalty} should not be positive")
    if ngram_size < 1:
        raise ValueError(f"repetition_n_grams {ngram_size} must be at least 1")

    def repetition_penalty_reward(completions, **kwargs) -> list[float]:
        out = []
        for c in completions:
            words = completion_text(c).lower().split()
            if len(words) < ngram_size:
                out.append(0.0)
                continue
            grams = list(zip(*[words[i:] for i in range(ngram_size)]))
            out.append((1 - len(set(grams)) / len(grams)) * max_penalty)
        return out

    return repetition_penalty_reward


def get_soft_overlong_punishment(max_completion_len: int = 16384, soft_punish_cache: int = 4096):
    """DAPO's soft overlong punishment (eq. 13) on token counts: 0 up to max - cache tokens, then falling linearly
    to -1 at max_completion_len, -1 beyond."""
    if soft_punish_cache < 0 or soft_punish_cache > max_completion_len:
        raise ValueError(f"soft_punish_cache {soft_punish_cache} must be between 0 and max_completion_len "
                         f"{max_completion_len}")

    def soft_overlong_punishment_reward(completion_ids, **kwargs) -> list[float]:
        out = []
        for ids in completion_ids:
            n = len(ids)
            if n <= max_completion_len - soft_punish_cache:
                out.append(0.0)
            elif n <= max_completion_len:
                out.append((max_completion_len - soft_punish_cache - n) / soft_punish_cache)
            else:
                out.append(-1.0)
        return out

    return soft_overlong_punishment_reward
