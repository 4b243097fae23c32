"""The benchmarks' GRPO task: a reward every path (plain TRL, O-GRPO's plans, a TRL server run) scores alike."""

from __future__ import annotations


def token_reward(completions, **kwargs) -> list[float]:
    """Share of even-numbered tokens ("t2", "t4", ...) in each completion: dense, cheap, learnable."""
    out = []
    for text in completions:
        toks = str(text).split()
        out.append(sum(1 for t in toks if t[1:].isdigit() and int(t[1:]) % 2 == 0) / max(1, len(toks)))
    return out
