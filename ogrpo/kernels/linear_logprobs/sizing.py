"""How big one chunk of logits is: shared by the op and the planner's memory model (no torch import)."""

from __future__ import annotations

# One chunk of fp32 logits is at most this many bytes (192 MiB: at V = 151,936 that is 331 rows). Sized so that
# at 1k tokens the op's whole working set (chunk, BLAS buffers) and the [V, H] head gradient every path returns
# stay below half of TRL 1.9.2's full-logits peak with a margin (256 MiB measured 0.50x; 192 MiB 0.47x, 2% slower).
CHUNK_BYTES = 192 << 20


# The CPU kernel's tiles are at most this many tokens tall (and as wide in the vocabulary as one chunk allows):
# the BLAS runs 10-20% faster on 1-4k rows against a vocabulary block than on a few hundred against the whole head.
MAX_TILE_ROWS = 4096


def default_chunk_size(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * max(1, vocab)))


def peak_logits_bytes(tokens: int, vocab: int, chunk_size: int | None = None) -> int:
    """The op's logits working set: one chunk of fp32 logits and, in backward, its in-place gradient plus the
    matmul output it is computed from (2 chunk-sized fp32 buffers)."""
    rows = min(max(1, tokens), chunk_size or default_chunk_size(vocab))
    return 2 * rows * vocab * 4
