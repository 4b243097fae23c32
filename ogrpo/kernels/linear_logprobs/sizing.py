"""How big one chunk of logits is: shared by the op and the planner's memory model (no torch import)."""

from __future__ import annotations

# One chunk of fp32 logits is at most this many bytes (256 MiB: at V = 151,936 that is 441 rows).
CHUNK_BYTES = 256 << 20


def default_chunk_size(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * max(1, vocab)))


def peak_logits_bytes(tokens: int, vocab: int, chunk_size: int | None = None) -> int:
    """The op's logits working set: one chunk of fp32 logits and, in backward, its in-place gradient plus the
    matmul output it is computed from (2 chunk-sized fp32 buffers)."""
    rows = min(max(1, tokens), chunk_size or default_chunk_size(vocab))
    return 2 * rows * vocab * 4
