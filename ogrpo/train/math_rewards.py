"""Answer-checking rewards with open-r1's meaning: answers parsed and verified symbolically by `math-verify`.

The parse settings are open-r1's (src/open_r1/rewards.py): the gold solution is parsed as math-verify's default
(LaTeX, then a plain expression, so both `\\boxed{\\frac12}` and `0.5` golds work, as in open-r1's HEAD and TRL
1.16), the completion only from LaTeX with `\\boxed{}` tried first and no anchor-less guessing, so an answer
written without `\\boxed{}`/`$...$` does not count. One answer setting serves all three rewards (open-r1's
length/cosine use `boxed=True` instead of "all": the same result unless a completion has several boxes).
A gold answer that does not parse gives None: TRL then leaves the sample out of that reward's mean instead of
scoring it, which is what open-r1 does.

math_verify costs ~0.3 s to import, so it is imported on first use, never at plan time.
"""

from __future__ import annotations

import math
import threading
from functools import lru_cache


def completion_text(completion) -> str:
    """The text of one completion: a string, or the content of a conversational completion's last message."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


@lru_cache(maxsize=1)
def _configs():
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    gold = [LatexExtractionConfig(), ExprExtractionConfig()]
    answer = [LatexExtractionConfig(
        # open-r1's settings minus `equations=True`, which latex2sympy2_extended 1.11 ignores (the parser handles
        # equations now) and warns about on every construction.
        normalization_config=NormalizationConfig(nits=False, malformed_operators=False, basic_latex=True,
                                                 boxed="all", units=True),
        boxed_match_priority=0,  # \boxed{} before any other LaTeX in the completion
        try_extract_without_anchor=False,
    )]
    return gold, answer


def _timeouts() -> tuple[int | None, int | None]:
    # math_verify times out with signal.alarm, which only the main thread may set; TRL can call reward functions
    # from a worker thread, where the timeout must be off or math_verify raises.
    if threading.current_thread() is threading.main_thread():
        return 10, 5
    import logging

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return None, None


def check_answers(completions, solution) -> list[bool | None]:
    """Per completion: True/False when its answer does / does not equal the gold one, None if gold is unparsable."""
    from math_verify import parse, verify

    gold_cfg, answer_cfg = _configs()
    parse_timeout, verify_timeout = _timeouts()
    out: list[bool | None] = []
    for completion, sol in zip(completions, solution, strict=True):
        gold = parse(str(sol), extraction_config=gold_cfg, extraction_mode="first_match",
                     parsing_timeout=parse_timeout)
        if not gold:
            out.append(None)
            continue
        answer = parse(completion_text(completion), extraction_config=answer_cfg, extraction_mode="first_match",
                       parsing_timeout=parse_timeout)
        try:
            out.append(bool(verify(gold, answer, timeout_seconds=verify_timeout)))
        except Exception:  # sympy can fail on odd expressions; open-r1 skips the sample then
            out.append(None)
    return out


def accuracy_reward(completions, solution, **kwargs) -> list[float | None]:
    """1.0 when the completion's answer is mathematically equal to `solution`, 0.0 if not, None to skip."""
    return [None if ok is None else float(ok) for ok in check_answers(completions, solution)]


def len_reward(completions, solution, **kwargs) -> list[float]:
    """Kimi 1.5's length reward (open-r1's `length`): lambda = 0.5 - (len - min) / (max - min) over the group's
    character lengths; correct answers get lambda, wrong ones min(0, lambda); all 0 when every length is equal.
    An unparsable gold counts as correct (open-r1: "treat as correct to avoid penalizing")."""
    texts = [completion_text(c) for c in completions]
    correct = [ok is not False for ok in check_answers(completions, solution)]
    lengths = [len(t) for t in texts]
    lo, hi = min(lengths, default=0), max(lengths, default=0)
    if hi == lo:
        return [0.0] * len(texts)
    out = []
    for n, ok in zip(lengths, correct):
        lam = 0.5 - (n - lo) / (hi - lo)
        out.append(float(lam if ok else min(0.0, lam)))
    return out


def get_cosine_scaled_reward(min_value_wrong: float = 0.0, max_value_wrong: float = -0.5,
                             min_value_correct: float = 0.5, max_value_correct: float = 1.0, max_len: int = 1000):
    """open-r1's cosine-scaled reward: short correct answers earn most, long wrong ones are punished least.

    reward = lo + (hi - lo) * (1 + cos(pi * len / max_len)) / 2 with (lo, hi) = (min_correct, max_correct) for a
    correct answer and (max_wrong, min_wrong) for a wrong one; an unparsable gold gives 1.0 (open-r1 skips it
    that way). Defaults are open-r1's GRPOScriptArguments defaults (cosine_*)."""

    def cosine_scaled_reward(completions, solution, **kwargs) -> list[float]:
        out = []
        for completion, ok in zip(completions, check_answers(completions, solution)):
            if ok is None:
                out.append(1.0)
                continue
            cosine = math.cos(len(completion_text(completion)) / max_len * math.pi)
            lo, hi = (min_value_correct, max_value_correct) if ok else (max_value_wrong, min_value_wrong)
            out.append(float(lo + 0.5 * (hi - lo) * (1.0 + cosine)))
        return out

    return cosine_scaled_reward
