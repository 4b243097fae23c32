"""Plain PyTorch versions of linear_logprobs (any device): the definition the compiled kernels are tested against.

- `linear_logprobs_naive`: the whole [N, V] logits at once, autograd does the rest. Only for tests.
- `linear_logprobs_reference`: the same per token chunk, autograd through each chunk (the public reference).
- `forward_chunks` / `backward_chunks`: the explicit forward and backward the compiled kernels implement,
  chunk by chunk, never holding more than one chunk of logits. The custom op falls back to these when the
  extension cannot be built or fails its first-use check, so a fallback keeps the O(chunk * V) memory bound.

Math (z = logits / T, p = softmax(z), lse = logsumexp(z)):
  logp_t = z_t - lse,  H = -sum_j p_j log p_j = lse - sum_j p_j z_j.
  dlogp_t/dz_j = onehot_j - p_j,  dH/dz_j = -p_j (log p_j + H),  dz/dlogits = 1/T.
"""

from __future__ import annotations

import torch

from ogrpo.kernels.linear_logprobs.sizing import CHUNK_BYTES, default_chunk_size  # noqa: F401  (re-exported)


def _flatten(hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)


def linear_logprobs_naive(hidden, weight, targets, temperature: float = 1.0):
    """Full-logits definition in fp32 math: (logprobs, entropy), shaped like `targets`."""
    h, t = _flatten(hidden, targets)
    acc = math_dtype(hidden.dtype)
    logits = (h.to(acc) @ weight.to(acc).t()) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    out = logp.gather(1, t.unsqueeze(1)).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    return out.view(targets.shape), ent.view(targets.shape)


def linear_logprobs_reference(hidden, weight, targets, temperature: float = 1.0, *, chunk_size: int | None = None):
    """Chunked over tokens, fp32 math, differentiable w.r.t. hidden and weight through autograd."""
    h, t = _flatten(hidden, targets)
    chunk = chunk_size or default_chunk_size(weight.shape[0])
    acc = math_dtype(hidden.dtype)
    w = weight.to(acc)
    logps, ents = [], []
    for start in range(0, h.shape[0], chunk):
        logits = (h[start:start + chunk].to(acc) @ w.t()) / temperature
        logp = torch.log_softmax(logits, dim=-1)
        logps.append(logp.gather(1, t[start:start + chunk].unsqueeze(1)).squeeze(1))
        ents.append(-(logp.exp() * logp).sum(-1))
    if not logps:  # zero tokens: keep the graph connected so backward still runs
        empty = (h.to(acc) @ w.t()).sum(-1)
        return empty.view(targets.shape), empty.view(targets.shape)
    return torch.cat(logps).view(targets.shape), torch.cat(ents).view(targets.shape)


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 row math and outputs, fp64 for fp64 inputs (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_logits(h_chunk: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # The matmul runs in the inputs' dtype (the vendor BLAS accumulates in fp32); the row math is fp32.
    return (h_chunk @ weight.t()).to(math_dtype(h_chunk.dtype))


def forward_chunks(hidden, weight, targets, temperature: float, chunk_size: int):
    """hidden [N, H], weight [V, H], targets [N] -> (logp [N], entropy [N], lse [N]), all fp32."""
    n = hidden.shape[0]
    logp = torch.empty(n, dtype=math_dtype(hidden.dtype), device=hidden.device)
    ent = torch.empty_like(logp)
    lse = torch.empty_like(logp)
    for start in range(0, n, chunk_size):
        end = min(n, start + chunk_size)
        z = _chunk_logits(hidden[start:end], weight).div_(temperature)
        chunk_lse = torch.logsumexp(z, dim=-1)
        p = torch.softmax(z, dim=-1)
        lse[start:end] = chunk_lse
        logp[start:end] = z.gather(1, targets[start:end].unsqueeze(1)).squeeze(1) - chunk_lse
        ent[start:end] = chunk_lse - (p * z).sum(-1)
    return logp, ent, lse


def backward_chunks(hidden, weight, targets, lse, ent, grad_logp, grad_ent, temperature: float, chunk_size: int,
                    need_hidden: bool = True, need_weight: bool = True):
    """Gradients w.r.t. hidden and weight (in their dtypes), recomputing one chunk of logits at a time."""
    n = hidden.shape[0]
    grad_h = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    acc = math_dtype(hidden.dtype)
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight else None
    for start in range(0, n, chunk_size):
        end = min(n, start + chunk_size)
        h = hidden[start:end]
        logp_all = _chunk_logits(h, weight).div_(temperature).sub_(lse[start:end, None])
        p = logp_all.exp()
        g_logp, g_ent = grad_logp[start:end, None].to(p.dtype), grad_ent[start:end, None].to(p.dtype)
        # dL/dz = g_logp * (onehot - p) - g_ent * p * (log p + H), then / T for the raw logits
        dz = -(g_logp * p) - g_ent * p * (logp_all + ent[start:end, None])
        dz.scatter_add_(1, targets[start:end, None], g_logp)
        dz.div_(temperature)
        if need_hidden:
            grad_h[start:end] = (dz.to(weight.dtype) @ weight).to(hidden.dtype)
        if need_weight:
            grad_w.add_(dz.t() @ h.to(acc))
    return grad_h, (grad_w.to(weight.dtype) if need_weight else weight.new_empty(0))
