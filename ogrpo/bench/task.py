"""The benchmarks' GRPO task: a reward every path (plain TRL, O-GRPO's plans, a TRL server run) scores alike."""

from __future__ import annotations


def token_reward(completions, **kwargs) -> list[float]:
    """Share of vowels among each completion's letters (the bench models' tokens are letter strings): dense,
    cheap, learnable."""
    out = []
    for text in completions:
        letters = [c for c in str(text).lower() if "a" <= c <= "z"]
        out.append(sum(1 for c in letters if c in "aeiou") / max(1, len(letters)))
    return out
