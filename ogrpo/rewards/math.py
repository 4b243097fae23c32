"""Answer-checking rewards with open-r1's meaning: answers parsed and verified symbolically by `math-verify`
(accuracy, length, cosine, and the zero-math-code branch's think_accuracy).

The parse settings are open-r1's (src/open_r1/rewards.py): the gold solution is parsed as math-verify's default
(LaTeX, then a plain expression, so both `\\boxed{\\frac12}` and `0.5` golds work, as in open-r1's HEAD and TRL
1.16), the completion only from LaTeX with `\\boxed{}` tried first and no anchor-less guessing, so an answer
written without `\\boxed{}`/`$...$` does not count. One answer setting serves them all (open-r1's
length/cosine use `boxed=True` instead of "all": the same result unless a completion has several boxes).
A gold answer that does not parse gives None: TRL then leaves the sample out of that reward's mean instead of
scoring it, which is what open-r1 does.

Parsing and verification run in worker processes (ogrpo/rewards/bounded.py), each completion under a hard time
limit, wherever the reward is called from: math-verify's own timeout is a signal.alarm, off outside the main
thread (TRL may call rewards from a worker thread) and unable to interrupt C code, and a `\\frac` nested 10,000
deep ran for minutes without it. Inside a worker (its main thread) math-verify's alarms still give open-r1's
behaviour: a parse that times out extracts nothing, so the answer is wrong. A completion that runs past
MATH_TIMEOUT_S, or kills its worker, also scores as wrong (0, not skipped: skipping would let a model
escape its score by writing pathological answers) and is counted in `math/timeout_frac`; the worker is replaced.

math_verify costs ~0.3 s to import (with sympy, seconds on a loaded node): the workers import it once when they
start, never at plan time and never in the trainer process.
"""

from __future__ import annotations

import math
import os
import threading
from functools import lru_cache

from ogrpo.rewards.formats import after_last_think

# math-verify's (and open-r1's) own limits, enforced by its alarms inside a worker.
PARSE_TIMEOUT_S, VERIFY_TIMEOUT_S = 5, 5
# The hard limit per completion: the gold parse (cached per worker), the answer parse and the verification,
# each normally stopped by an alarm first; the worker is killed when C code ignores the alarm.
MATH_TIMEOUT_S = 15.0
# A worker's address space: a pathological expression ends in MemoryError (a wrong answer), not in the node's
# OOM killer picking the trainer. An interpreter with sympy maps ~0.3 GiB.
WORKER_MEMORY_BYTES = 4 * 1024**3

_pool = None
_pool_lock = threading.Lock()


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


# --- worker side (a fresh interpreter started by BoundedPool) --------------------------------------------------


def warm_worker() -> None:
    """Imports and settings once per worker, before it takes completions (so they never count against one)."""
    import logging
    import resource

    import math_verify  # noqa: F401

    _configs()
    # math-verify logs every timeout with the whole completion (megabytes of `\frac`); the count is reported
    # as a metric instead.
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = WORKER_MEMORY_BYTES if hard == resource.RLIM_INFINITY else min(hard, WORKER_MEMORY_BYTES)
    if soft == resource.RLIM_INFINITY or soft > cap:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


@lru_cache(maxsize=4096)
def _gold(solution: str):
    """A group's completions share their gold answer: parsed once per worker."""
    from math_verify import parse

    return parse(solution, extraction_config=_configs()[0], extraction_mode="first_match",
                 parsing_timeout=PARSE_TIMEOUT_S)


def check_one(pair) -> bool | None:
    """[completion text, gold] -> True/False, None when the gold does not parse or sympy fails (open-r1 skips)."""
    from math_verify import parse, verify

    text, solution = pair
    gold = _gold(solution)
    if not gold:
        return None
    answer = parse(text, extraction_config=_configs()[1], extraction_mode="first_match",
                   parsing_timeout=PARSE_TIMEOUT_S)
    try:
        return bool(verify(gold, answer, timeout_seconds=VERIFY_TIMEOUT_S))
    except Exception:  # sympy can fail on odd expressions; open-r1 skips the sample then
        return None


# --- trainer side ----------------------------------------------------------------------------------------------


def math_pool():
    """The trainer process's workers (at most 4, fewer on a smaller CPU allocation), started on first use."""
    global _pool
    # Not at the top: the workers import this module under `python -m ogrpo.rewards.bounded`, which would load
    # bounded.py a second time there.
    from ogrpo.rewards.bounded import BoundedPool

    with _pool_lock:
        if _pool is None:
            workers = min(4, len(os.sched_getaffinity(0)))
            _pool = BoundedPool("ogrpo.rewards.math:check_one", workers=workers, timeout_s=MATH_TIMEOUT_S,
                                init="ogrpo.rewards.math:warm_worker")
        return _pool


def check_answers(completions, solution, *, pool=None, log_metric=None) -> list[bool | None]:
    """Per completion: True/False when its answer does / does not equal the gold one, None if gold is unparsable.
    One round trip to the workers for the whole batch; a completion past the time limit is False."""
    # not at the top: see math_pool
    from ogrpo.rewards.bounded import FAILED, TIMED_OUT

    pairs = [[completion_text(c), str(s)] for c, s in zip(completions, solution, strict=True)]
    got = (pool or math_pool()).map(pairs)
    stopped = sum(r is TIMED_OUT or r is FAILED for r in got)
    if callable(log_metric) and pairs:  # TRL passes log_metric: shown next to rewards/<name>/mean
        log_metric("math/timeout_frac", stopped / len(pairs))
    return [False if (r is TIMED_OUT or r is FAILED) else r for r in got]


def accuracy_reward(completions, solution, **kwargs) -> list[float | None]:
    """1.0 when the completion's answer is mathematically equal to `solution`, 0.0 if not, None to skip."""
    oks = check_answers(completions, solution, log_metric=kwargs.get("log_metric"))
    return [None if ok is None else float(ok) for ok in oks]


def think_accuracy_reward(completions, solution, **kwargs) -> list[float | None]:
    """open-r1's `think_accuracy` (branch zero-math-code): `accuracy` on the text after the completion's last
    `</think>`, stripped, so an answer inside the reasoning does not count; no `</think>` scores 0.0 (nothing to
    extract). Same parse settings, None for an unparsable gold, and worker pool as `accuracy`."""
    answers = [after_last_think(completion_text(c)) for c in completions]
    oks = check_answers(answers, solution, log_metric=kwargs.get("log_metric"))
    return [None if ok is None else float(ok) for ok in oks]


def len_reward(completions, solution, **kwargs) -> list[float]:
    """Kimi 1.5's length reward (open-r1's `length`): lambda = 0.5 - (len - min) / (max - min) over the group's
    character lengths; correct answers get lambda, wrong ones min(0, lambda); all 0 when every length is equal.
    An unparsable gold counts as correct (open-r1: "treat as correct to avoid penalizing")."""
    texts = [completion_text(c) for c in completions]
    oks = check_answers(completions, solution, log_metric=kwargs.get("log_metric"))
    correct = [ok is not False for ok in oks]
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
        oks = check_answers(completions, solution, log_metric=kwargs.get("log_metric"))
        for completion, ok in zip(completions, oks):
            if ok is None:
                out.append(1.0)
                continue
            cosine = math.cos(len(completion_text(completion)) / max_len * math.pi)
            lo, hi = (min_value_correct, max_value_correct) if ok else (max_value_wrong, min_value_wrong)
            out.append(float(lo + 0.5 * (hi - lo) * (1.0 + cosine)))
        return out

    return cosine_scaled_reward
