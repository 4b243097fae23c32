"""Plain-PyTorch fused sampling, any device: transformers 5.19's logits-processor chain, written out.

Order and formulas are those of `transformers.generation.logits_process` (RepetitionPenaltyLogitsProcessor ->
TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper, min_tokens_to_keep=1), which a test checks
against the installed classes:
- penalty: on every token id present in `previous_tokens`, `s < 0 ? s * penalty : s / penalty`, once per id;
  ids outside [0, V) are ignored (transformers drops ids >= V; we also drop negatives, so -1 can pad);
- temperature: `s / temperature`; 0 means greedy: argmax after the penalty (warpers only run when sampling);
- top-k: drop tokens strictly below the k-th largest score (ties with it are kept);
- top-p: drop a token when the probability mass ranked above it is already >= top_p (the highest always stays);
  among tied scores lower ids rank higher (transformers leaves that order to an unstable sort).
"""

from __future__ import annotations

import torch


def penalize(scores: torch.Tensor, previous_tokens: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """`scores` (fp32 [B, V]) with the repetition penalty applied (new tensor)."""
    if penalty == 1.0 or previous_tokens is None or previous_tokens.numel() == 0:
        return scores
    vocab = scores.shape[-1]
    ids = previous_tokens.to(device=scores.device, dtype=torch.long)
    # One spare column absorbs the ignored ids, as transformers' padding column does for ids >= V.
    ids = torch.where((ids < 0) | (ids >= vocab), torch.full_like(ids, vocab), ids)
    padded = torch.nn.functional.pad(scores, (0, 1))
    picked = padded.gather(1, ids)
    picked = torch.where(picked < 0, picked * penalty, picked / penalty)
    return padded.scatter(1, ids, picked)[:, :vocab]


def processed_scores(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                     repetition_penalty: float, previous_tokens: torch.Tensor | None) -> torch.Tensor:
    """Scores after the whole chain (fp32 [B, V], -inf where filtered); for temperature > 0 only."""
    scores = penalize(logits.float(), previous_tokens, repetition_penalty)
    scores = scores / temperature
    vocab = scores.shape[-1]
    if top_k > 0:
        kth = torch.topk(scores, min(top_k, vocab)).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if top_p < 1.0:
        # transformers' unstable torch.sort leaves the order of tied scores open; a stable sort of the reversed
        # row settles it (lower ids rank higher, as in the kernels and argmax): same sets whenever there is no
        # tie at the boundary, and bf16 logits tie often.
        sorted_scores, order = torch.sort(scores.flip(-1), descending=False, stable=True)
        order = vocab - 1 - order
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(1, order, remove), -float("inf"))
    return scores


def fused_sample_reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                           repetition_penalty: float, previous_tokens: torch.Tensor | None,
                           generator: torch.Generator | None) -> torch.Tensor:
    """Next tokens [B] (int64), sampled the way transformers' `_sample` does: softmax + torch.multinomial."""
    if temperature == 0:
        return torch.argmax(penalize(logits.float(), previous_tokens, repetition_penalty), dim=-1)
    probs = processed_scores(logits, temperature, top_k, top_p, repetition_penalty, previous_tokens).softmax(-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token each row's uniform picks: the first id whose cumulative mass exceeds u * total (id order), the
    draw the compiled kernels make. Zero-mass ids are never picked (their cumulative mass does not grow)."""
    cdf = probs.double().cumsum(-1)
    target = uniforms.to(cdf).unsqueeze(1) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return picked.clamp(max=probs.shape[-1] - 1)


def fused_sample_from_uniforms(logits: torch.Tensor, previous_tokens: torch.Tensor | None,
                               uniforms: torch.Tensor, temperature: float, top_k: int, top_p: float,
                               repetition_penalty: float) -> torch.Tensor:
    """The compiled op's contract in PyTorch: the same chain, drawn by inverse CDF with the caller's uniforms."""
    if temperature == 0:
        return torch.argmax(penalize(logits.float(), previous_tokens, repetition_penalty), dim=-1)
    probs = processed_scores(logits, temperature, top_k, top_p, repetition_penalty, previous_tokens).softmax(-1)
    return inverse_cdf(probs, uniforms)
