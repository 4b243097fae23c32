"""Reward functions by name: a small built-in registry, or any `package.module:function` import path.

Resolution happens before the run directory is created, so a typo is a one-line error and nothing is written.
Reward functions follow TRL's signature: `f(completions, prompts=..., **dataset_columns) -> list[float | None]`.
"""

from __future__ import annotations

import difflib
import importlib
import re
from typing import Callable

from ogrpo.errors import OgrpoError


def _tiny_letter(completions, **kwargs):
    from ogrpo.tiny import letter_reward

    return letter_reward(completions, **kwargs)


def _text(completion) -> str:
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def length_reward(completions, target_length: int = 64, **kwargs) -> list[float]:
    """1 at `target_length` characters, falling linearly to 0 at twice (or zero) that length."""
    return [max(0.0, 1.0 - abs(len(_text(c)) - target_length) / target_length) for c in completions]


_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def _norm(x) -> str:
    return re.sub(r"\s+", "", str(x)).rstrip(".").lower()


def accuracy_reward(completions, solution=None, answer=None, **kwargs) -> list[float | None]:
    """1 when the completion's final answer (\\boxed{…}, <answer>…</answer>, else the last line) equals the
    dataset's `solution`/`answer` column after whitespace/case normalisation; None where there is no reference."""
    refs = solution if solution is not None else answer
    if refs is None:
        return [None] * len(completions)
    out: list[float | None] = []
    for c, ref in zip(completions, refs):
        text = _text(c)
        m = _BOXED.findall(text) or _ANSWER.findall(text)
        got = m[-1] if m else (text.strip().splitlines() or [""])[-1]
        ref_m = _BOXED.findall(str(ref))
        ref = ref_m[-1] if ref_m else ref
        out.append(None if ref is None else float(_norm(got) == _norm(ref)))
    return out


_FORMAT = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.S)


def format_reward(completions, **kwargs) -> list[float]:
    """1 for `<think>…</think><answer>…</answer>` (open-r1's format), else 0."""
    return [1.0 if _FORMAT.match(_text(c)) else 0.0 for c in completions]


REGISTRY: dict[str, Callable] = {
    "tiny_letter": _tiny_letter,
    "accuracy": accuracy_reward,
    "format": format_reward,
    "length": length_reward,
}


# Names TRL's own `trl grpo` script accepts (trl/scripts/grpo.py), so its recipes run unchanged.
TRL_NAMES = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward")


def _known() -> str:
    return ", ".join([*REGISTRY, *TRL_NAMES])


def _trl_reward(name: str) -> Callable:
    try:
        import trl.rewards as trl_rewards

        return getattr(trl_rewards, name)
    except Exception as exc:  # e.g. accuracy_reward needs math_verify
        raise OgrpoError(f"reward {name!r}: TRL's implementation cannot be loaded ({type(exc).__name__}: {exc}); "
                         "install what it needs (pip install 'trl[math_verify]') or use another reward") from None


def resolve_reward(spec: str) -> Callable:
    """A registry name, one of TRL's reward names, or an import path → the callable.

    Import paths: `package.module:function` (explicit) or TRL's dotted form `package.module.function`.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise OgrpoError(f"reward_funcs: {spec!r} is not a reward name; use one of {_known()} "
                         "or a `package.module:function` path")
    spec = spec.strip()
    if spec in REGISTRY:
        return REGISTRY[spec]
    if spec in TRL_NAMES:
        return _trl_reward(spec)
    if ":" in spec or "." in spec:
        mod_name, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
        try:
            module = importlib.import_module(mod_name)
        except Exception as exc:  # ImportError, or the module's own import-time error
            why = (str(exc).strip().splitlines() or [""])[0]
            raise OgrpoError(f"reward {spec!r}: cannot import module {mod_name!r} ({type(exc).__name__}: {why}); "
                             "check the path and that the module is on PYTHONPATH") from None
        func = module
        for part in attr.split("."):
            func = getattr(func, part, None)
            if func is None:
                raise OgrpoError(f"reward {spec!r}: module {mod_name!r} has no attribute {attr!r}; "
                                 "check the function name after the colon")
        if not callable(func):
            raise OgrpoError(f"reward {spec!r}: {attr!r} is not callable; point at a function")
        return func
    close = difflib.get_close_matches(spec, [*REGISTRY, *TRL_NAMES], n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise OgrpoError(f"unknown reward {spec!r}: {hint}use one of {_known()} or a `package.module:function` path")


def named(func: Callable, name: str) -> Callable:
    """A wrapper carrying `name` as __name__, which TRL uses for the `rewards/<name>/mean` metric."""

    import inspect

    if inspect.iscoroutinefunction(func):  # TRL runs async reward functions concurrently; keep them async
        async def reward(*args, **kwargs):
            return await func(*args, **kwargs)
    else:
        def reward(*args, **kwargs):
            return func(*args, **kwargs)

    reward.__name__ = reward.__qualname__ = re.sub(r"[^A-Za-z0-9_]", "_", name.split(":")[-1])
    reward.__doc__ = func.__doc__
    return reward


def resolve_rewards(specs, weights=None) -> tuple[list[Callable], list[float] | None]:
    """(callables, weights) for TRL; weights must match the number of reward functions."""
    if specs is None or specs == []:
        raise OgrpoError("no reward functions: set reward_funcs in the run config (e.g. [accuracy, format] "
                         "or my_pkg.rewards:score)")
    if isinstance(specs, str):
        specs = [specs]
    funcs = [named(resolve_reward(s), s) for s in specs]
    if weights is not None:
        if len(weights) != len(funcs):
            raise OgrpoError(f"reward_weights has {len(weights)} entries for {len(funcs)} reward functions; "
                             "give one weight per entry of reward_funcs")
        weights = [float(w) for w in weights]
    return funcs, weights
