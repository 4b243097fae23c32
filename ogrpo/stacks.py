"""Which TRL ↔ vLLM pairs O-GRPO supports (data; shared by `ogrpo doctor`, the images' self-check and the
lock-file tests, so that what an image pins and what doctor accepts cannot disagree).

Ranges from each TRL release's own vLLM bounds (shared/compat.md). vLLM 0.32 on the CPU build is outside
TRL 1.16's declared range but was verified end to end here (server-mode GRPO, weight sync, log-prob gap).
"""

from __future__ import annotations

# trl minor line -> (min vllm, max vllm) inclusive, as (major, minor, patch)
TRL_VLLM_RANGES: dict[tuple[int, int], tuple[tuple[int, ...], tuple[int, ...]]] = {
    (1, 6): ((0, 12, 0), (0, 19, 0)),
    (1, 7): ((0, 14, 0), (0, 23, 99)),
    (1, 8): ((0, 16, 0), (0, 23, 99)),
    (1, 9): ((0, 17, 0), (0, 25, 1)),
    (1, 16): ((0, 22, 0), (0, 32, 99)),
}


def parse_version(text: str) -> tuple[int, ...]:
    """'0.32.0+cpu' -> (0, 32, 0); non-numeric tails are dropped."""
    parts: list[int] = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts + [0] * (3 - len(parts)))


def supported_pair(trl_version: str, vllm_version: str) -> tuple[bool, str]:
    """(ok, reason) for a TRL/vLLM version pair."""
    trl = parse_version(trl_version)
    vllm = parse_version(vllm_version)
    rng = TRL_VLLM_RANGES.get(trl[:2])
    if rng is None:
        known = ", ".join(f"{a}.{b}" for a, b in sorted(TRL_VLLM_RANGES))
        return False, f"TRL {trl_version} is not a supported line (supported: {known})"
    lo, hi = rng
    if not (lo <= vllm <= hi):
        fmt = lambda v: ".".join(map(str, v))  # noqa: E731
        return False, f"vLLM {vllm_version} is outside TRL {trl_version}'s range {fmt(lo)}–{fmt(hi)}"
    return True, f"TRL {trl_version} + vLLM {vllm_version} is a supported pair"
