"""The `ogrpo::linear_logprobs_fwd` / `_bwd` custom ops: autograd, fake tensors, per-device kernels, fallback.

Each device's kernel is the compiled extension when it builds and passes its first-use check, else the chunked
PyTorch math of reference.py (`forward_chunks` / `backward_chunks`, the same O(chunk * V) memory bound). The
decision is made once per process and device, warned once, and kept in `STATUS` for the run manifest.

The ops take the lm_head weight as a plain tensor: under DeepSpeed ZeRO-3 the caller gathers it for the forward;
the backward gathers it again (`gathered`) because ZeRO-3 re-partitions it in between.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from ogrpo.errors import OgrpoError
from ogrpo.kernels import _build
from ogrpo.kernels.guarded import Guarded
from ogrpo.kernels.linear_logprobs import reference
from ogrpo.kernels.linear_logprobs.sizing import MAX_TILE_ROWS

IMPLS = ("auto", "reference", "compiled")


# --- compiled extension, verified on first use ------------------------------------------------------------------


def _load(device_type: str):
    return _build.load_extension("linear_logprobs", cuda=device_type == "cuda")


def _compiled_forward(ext, hidden, weight, targets, temperature, chunk_size, keep_last=False,
                      max_rows=MAX_TILE_ROWS):
    return ext.forward(hidden, weight, targets, temperature, chunk_size, keep_last, max_rows)


def _compiled_backward(ext, *args, max_rows=MAX_TILE_ROWS):
    return ext.backward(*args, max_rows)


# dtype -> (rtol, atol) of the first-use check. fp16 keeps dlogits in fp16 (the reference in fp32): ~1e-3.
_VERIFY_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2)}


def _verify(ext, device: torch.device) -> str | None:
    """Compare the compiled op with the reference on a small odd-shaped input; None if they agree."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    n, hid, vocab, temp = 13, 24, 97, 0.7  # nothing a multiple of 8
    # (chunk, max_rows): the CPU kernel's tiles as 1 token chunk x 3 vocabulary blocks, then 4 x 3, each with short
    # first ones; the CUDA kernels' token chunks (5, then 2 rows)
    tilings = ((5, MAX_TILE_ROWS), (2, 4))
    h = torch.randn(n, hid, generator=gen)
    w = torch.randn(vocab, hid, generator=gen).div_(hid ** 0.5)
    t = torch.randint(0, vocab, (n,), generator=gen).to(device)
    g_lp, g_en = torch.randn(n, generator=gen).to(device), torch.randn(n, generator=gen).to(device)
    # TF32 (GRPOConfig tf32=True on Ampere) would round the two sides' matmuls differently: check exact fp32.
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for (dtype, (rtol, atol)), (chunk, rows) in itertools.product(_VERIFY_TOL.items(), tilings):
            hd, wd = h.to(device, dtype), w.to(device, dtype)
            # the backward starts from the forward's kept last tile, as in training
            got = list(_compiled_forward(ext, hd, wd, t, temp, chunk, True, max_rows=rows))
            kept = got.pop()
            want = list(reference.forward_chunks(hd, wd, t, temp, chunk))
            got += list(_compiled_backward(ext, hd, wd, t, want[2], want[1], g_lp, g_en, temp, chunk, True, True,
                                           kept, max_rows=rows))
            want += list(reference.backward_chunks(hd, wd, t, want[2], want[1], g_lp, g_en, temp, chunk))
            for name, a, b in zip(("logp", "entropy", "lse", "grad_hidden", "grad_weight"), got, want):
                if a.shape != b.shape or a.dtype != b.dtype:
                    return f"first-use check ({dtype}): {name} is {a.dtype}{tuple(a.shape)}, want " \
                           f"{b.dtype}{tuple(b.shape)}"
                if not torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol):
                    err = (a.float() - b.float()).abs().max().item()
                    return f"first-use check ({dtype}): {name} differs from the reference (max abs err {err:.3g})"
    except Exception as exc:  # noqa: BLE001 - any failure of the compiled op means "do not trust it"
        return f"first-use check raised {type(exc).__name__}: {exc}"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return None


# `_load`/`_verify` looked up per call: a test replaces them on this module
_GUARD = Guarded("linear_logprobs", lambda kind: _load(kind), lambda ext, device: _verify(ext, device))
# device type -> {"impl": "compiled" | "reference", "reason": str}; written once per device per process
STATUS = _GUARD.status


def _select(device: torch.device):
    """The extension to run on `device`, or None for the reference (ogrpo.kernels.guarded: decided once per
    device type, warned once, recorded in STATUS)."""
    return _GUARD.extension(device)


def reset() -> None:
    """Forget the per-device decisions (tests; a process normally decides once)."""
    _GUARD.reset()


def implementation(device: str | torch.device = "cpu") -> dict[str, str]:
    """Which implementation runs on `device` and why (deciding now if nothing ran there yet)."""
    dev = torch.device(device)
    _select(dev)
    return dict(STATUS[dev.type])


# --- the custom ops ----------------------------------------------------------------------------------------------


def _out_dtype(hidden: Tensor) -> torch.dtype:
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def _nothing_kept(hidden: Tensor) -> Tensor:
    return hidden.new_empty(0)


# The CPU kernel's last tile of logits, handed from a forward to its backward, which starts from them instead of
# recomputing that tile (csrc: one tile's GEMM fewer, no extra memory). Private kernel state, not an op output:
# autograd would have to save it while the backward overwrites it, which breaks a second backward and AOT autograd.
# One slot, keyed by the call's saved tensors: the next forward that keeps replaces it (its backward then
# recomputes), the first backward of the matching call takes it (a second one recomputes). So at most one tile
# outlives a graph that never ran backward, until the next training forward.
_KEPT: dict[tuple, Tensor] = {}
KEPT_USED = {"count": 0}  # backwards that started from a kept chunk (tests, benchmarks)


def _kept_key(hidden: Tensor, lse: Tensor, temperature: float, chunk_size: int) -> tuple:
    return (lse.untyped_storage().data_ptr(), hidden.untyped_storage().data_ptr(), hidden.shape[0],
            float(temperature), int(chunk_size))


@torch.library.custom_op("ogrpo::linear_logprobs_fwd", mutates_args=())
def linear_logprobs_fwd(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                        chunk_size: int, keep_last: bool) -> tuple[Tensor, Tensor, Tensor]:
    """hidden [N,H], weight [V,H], targets [N] -> (logp, entropy, lse) [N]; the generic (any device) kernel.
    keep_last: a backward will follow, so the CPU kernel may keep its last tile of logits for it."""
    return tuple(reference.forward_chunks(hidden, weight, targets, temperature, chunk_size))


@linear_logprobs_fwd.register_fake
def _fwd_fake(hidden, weight, targets, temperature, chunk_size, keep_last):
    out = hidden.new_empty(hidden.shape[:1], dtype=_out_dtype(hidden))
    return out, torch.empty_like(out), torch.empty_like(out)


def _fwd_device(hidden, weight, targets, temperature, chunk_size, keep_last):
    ext = _select(hidden.device)
    if ext is None:
        return tuple(reference.forward_chunks(hidden, weight, targets, temperature, chunk_size))
    if keep_last:
        _KEPT.clear()  # before the new chunk is allocated: never two held
    logp, ent, lse, kept = _compiled_forward(ext, hidden, weight, targets, temperature, chunk_size, keep_last)
    if kept.numel():
        _KEPT[_kept_key(hidden, lse, temperature, chunk_size)] = kept
    return logp, ent, lse


linear_logprobs_fwd.register_kernel("cpu")(_fwd_device)
linear_logprobs_fwd.register_kernel("cuda")(_fwd_device)


@torch.library.custom_op("ogrpo::linear_logprobs_bwd", mutates_args=())
def linear_logprobs_bwd(hidden: Tensor, weight: Tensor, targets: Tensor, lse: Tensor, entropy: Tensor,
                        grad_logp: Tensor, grad_entropy: Tensor, temperature: float, chunk_size: int,
                        need_hidden: bool, need_weight: bool) -> tuple[Tensor, Tensor]:
    """(grad_hidden [N,H] or [0], grad_weight [V,H] or [0]), recomputing one chunk of logits at a time (the CPU
    kernel: except the tile its forward kept, whose logits become that tile's gradient in place)."""
    return reference.backward_chunks(hidden, weight, targets, lse, entropy, grad_logp, grad_entropy, temperature,
                                     chunk_size, need_hidden, need_weight)


@linear_logprobs_bwd.register_fake
def _bwd_fake(hidden, weight, targets, lse, entropy, grad_logp, grad_entropy, temperature, chunk_size, need_hidden,
              need_weight):
    grad_h = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_hidden else hidden.new_empty(0)
    grad_w = weight.new_empty(weight.shape) if need_weight else weight.new_empty(0)
    return grad_h, grad_w


def _bwd_device(hidden, weight, targets, lse, entropy, grad_logp, grad_entropy, temperature, chunk_size,
                need_hidden, need_weight):
    kept = _KEPT.pop(_kept_key(hidden, lse, temperature, chunk_size), None)
    ext = _select(hidden.device)
    if ext is None:
        return reference.backward_chunks(hidden, weight, targets, lse, entropy, grad_logp, grad_entropy,
                                         temperature, chunk_size, need_hidden, need_weight)
    if kept is None:
        kept = _nothing_kept(hidden)
    else:
        KEPT_USED["count"] += 1
    return tuple(_compiled_backward(ext, hidden, weight, targets, lse, entropy, grad_logp, grad_entropy,
                                    temperature, chunk_size, need_hidden, need_weight, kept))


linear_logprobs_bwd.register_kernel("cpu")(_bwd_device)
linear_logprobs_bwd.register_kernel("cuda")(_bwd_device)


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, temperature, chunk_size, _keep_last = inputs
    _, entropy, lse = output
    ctx.save_for_backward(hidden, weight, targets, lse, entropy)
    ctx.weight_param = weight  # ZeRO-3: the parameter object, to gather again in backward
    ctx.temperature, ctx.chunk_size = temperature, chunk_size


def _backward(ctx, grad_logp, grad_entropy, _grad_lse):
    hidden, weight, targets, lse, entropy = ctx.saved_tensors
    need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_hidden or need_weight):
        return None, None, None, None, None, None
    grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp
    grad_entropy = torch.zeros_like(lse) if grad_entropy is None else grad_entropy
    with gathered(ctx.weight_param):
        grad_h, grad_w = linear_logprobs_bwd(hidden, weight, targets, lse, entropy, grad_logp.contiguous(),
                                             grad_entropy.contiguous(), ctx.temperature, ctx.chunk_size,
                                             need_hidden, need_weight)
    return (grad_h if need_hidden else None), (grad_w if need_weight else None), None, None, None, None


linear_logprobs_fwd.register_autograd(_backward, setup_context=_setup_context)


def gathered(weight):
    """ZeRO-3 gathers a partitioned parameter only inside its module's forward; the backward reads it directly."""
    from contextlib import nullcontext

    if not hasattr(weight, "ds_status"):
        return nullcontext()
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if weight.ds_status == ZeroParamStatus.AVAILABLE:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([weight])


# --- public face -------------------------------------------------------------------------------------------------


def linear_logprobs(hidden: Tensor, lm_head_weight: Tensor, targets: Tensor, temperature: float = 1.0, *,
                    chunk_size: int | None = None, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """Per-token log-prob of `targets` and entropy under softmax(hidden @ W^T / T), without the full logits.

    hidden [N, H] (or [B, T, H]), lm_head_weight [V, H] (any strides: a ZeRO-3 gathered or transposed view is
    fine), targets [N] (or [B, T]) int64 -> (logprobs, entropy), fp32 (fp64 for fp64 inputs), shaped like
    targets. Differentiable w.r.t. hidden and lm_head_weight. `chunk_size` tokens are scored at a time (default:
    one chunk of fp32 logits <= 192 MiB). impl: "auto" (compiled if it builds and checks out, else the PyTorch
    fallback), "reference" (plain autograd PyTorch), "compiled" (the extension or an error).
    """
    if impl not in IMPLS:
        raise OgrpoError(f"linear_logprobs impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if not temperature > 0:
        raise OgrpoError(f"linear_logprobs temperature must be > 0, got {temperature}")
    if hidden.shape[:-1] != targets.shape or lm_head_weight.dim() != 2 or hidden.shape[-1] != lm_head_weight.shape[1]:
        raise OgrpoError(f"linear_logprobs shapes do not match: hidden {tuple(hidden.shape)}, lm_head_weight "
                         f"{tuple(lm_head_weight.shape)}, targets {tuple(targets.shape)} "
                         "(want [..., H], [V, H], [...])")
    if targets.dtype != torch.int64:
        raise OgrpoError(f"linear_logprobs targets must be int64, got {targets.dtype}")
    if hidden.dtype != lm_head_weight.dtype:
        raise OgrpoError(f"linear_logprobs hidden ({hidden.dtype}) and lm_head_weight ({lm_head_weight.dtype}) "
                         "must share a dtype; cast one of them")
    chunk = int(chunk_size or reference.default_chunk_size(lm_head_weight.shape[0]))
    if chunk < 1:
        raise OgrpoError(f"linear_logprobs chunk_size must be >= 1, got {chunk_size}")
    if impl == "reference":
        return reference.linear_logprobs_reference(hidden, lm_head_weight, targets, temperature, chunk_size=chunk)
    if impl == "compiled" and _select(hidden.device) is None:
        raise OgrpoError(f"linear_logprobs impl='compiled' is not available on {hidden.device.type}: "
                         f"{STATUS[hidden.device.type]['reason']}")
    h = hidden.reshape(-1, hidden.shape[-1])
    # keep the last tile's logits only when a backward will come to use them
    keep = torch.is_grad_enabled() and (h.requires_grad or lm_head_weight.requires_grad)
    logp, ent, _ = linear_logprobs_fwd(h, lm_head_weight, targets.reshape(-1), float(temperature), chunk, keep)
    return logp.view(targets.shape), ent.view(targets.shape)
