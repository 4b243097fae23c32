"""linear_logprobs against its full-logits definition: forward and backward, odd shapes, per-dtype tolerances,
gradcheck (fp64), opcheck, the first-use check's fallback, the O(chunk * V) memory bound, and CUDA (gpu)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest

# torch is part of the test environment (.venv, the train extra): its absence is a failure, not a skip.
import torch  # noqa: E402

from ogrpo.errors import OgrpoError  # noqa: E402
from ogrpo.kernels.linear_logprobs import op, reference  # noqa: E402
from ogrpo.kernels.linear_logprobs import linear_logprobs, linear_logprobs_naive  # noqa: E402

# (N, H, V, chunk): a single row; V and H not multiples of 8/16; N not a multiple of the chunk (short last chunk);
# a chunk larger than N.
SHAPES = [(1, 8, 17, 4), (37, 29, 1001, 8), (50, 64, 523, 7), (6, 33, 129, 64)]
# bf16/fp16: the logits matmul runs in the input dtype (as on the GPU), so logits carry bf16's 8-bit mantissa
# (|z| ~ 3 -> rounding ~ 0.01); the reference rounds nothing. Grads compare by relative norm.
TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (4e-3, 4e-3)}


@pytest.fixture(autouse=True)
def _fresh_status():
    op.reset()
    yield
    op.reset()


def _inputs(n, hid, vocab, dtype, seed=0, batch_shape=None):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hid, generator=gen)
    w = torch.randn(vocab, hid, generator=gen) / hid ** 0.5 * 2  # logits of order 1-3, like a trained head
    t = torch.randint(0, vocab, (n,), generator=gen)
    if batch_shape:
        h, t = h.view(*batch_shape, hid), t.view(*batch_shape)
    return h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_(), t


def _grads(fn, h, w, t, temp, seed=1):
    logp, ent = fn(h, w, t, temp)
    gen = torch.Generator().manual_seed(seed)
    # drawn on the CPU generator, then moved: the same weights for a CUDA run as for the CPU reference
    g1, g2 = (torch.randn(t.shape, generator=gen).to(t.device) for _ in range(2))
    gh, gw = torch.autograd.grad((logp * g1).sum() + (ent * g2).sum(), (h, w))
    return logp, ent, gh, gw


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("impl", ["compiled", "reference"])
def test_forward_and_backward_match_the_full_logits_definition(impl, shape, dtype):
    n, hid, vocab, chunk = shape
    h, w, t = _inputs(n, hid, vocab, dtype)
    temp = 0.7
    got = _grads(lambda *a: linear_logprobs(*a, chunk_size=chunk, impl=impl), h, w, t, temp)
    want = _grads(linear_logprobs_naive, h, w, t, temp)
    atol, rtol = TOL[dtype]
    assert got[0].dtype == torch.float32 and got[0].shape == (n,)
    torch.testing.assert_close(got[0], want[0], atol=atol * 4, rtol=rtol)  # log p ~ -log V: a few units
    torch.testing.assert_close(got[1], want[1], atol=atol * 4, rtol=rtol)
    assert got[2].dtype == dtype and got[3].dtype == dtype
    assert _rel(got[2], want[2]) < rtol and _rel(got[3], want[3]) < rtol
    if impl == "compiled":
        assert op.STATUS["cpu"]["impl"] == "compiled", op.STATUS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_with_only_one_upstream_gradient_match_the_definition(dtype):
    """The CPU kernel skips the entropy (or log-prob) term of a row whose upstream gradient is zero, as in GRPO
    without an entropy bonus; mixed rows check each specialisation against the definition, and a loss on
    log-probs alone (entropy unused: its gradient arrives as None) must match too."""
    n, hid, vocab, chunk = 24, 29, 1001, 7
    h, w, t = _inputs(n, hid, vocab, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    g_logp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    g_logp[0::4] = 0      # entropy term only
    g_ent[1::4] = 0       # log-prob term only
    g_logp[2::4] = 0
    g_ent[2::4] = 0       # no gradient at all (a masked token)
    atol, rtol = TOL[dtype]
    losses = {"mixed": lambda lp, en: (lp * g_logp).sum() + (en * g_ent).sum(), "logp only": lambda lp, en: lp.sum()}
    for name, loss in losses.items():
        got = torch.autograd.grad(loss(*linear_logprobs(h, w, t, 0.8, chunk_size=chunk, impl="compiled")), (h, w))
        want = torch.autograd.grad(loss(*linear_logprobs_naive(h, w, t, 0.8)), (h, w))
        assert _rel(got[0], want[0]) < rtol and _rel(got[1], want[1]) < rtol, name
        if name == "mixed":  # a row with no upstream gradient contributes exactly nothing
            assert got[0][2::4].abs().max().item() == 0
    assert op.STATUS["cpu"]["impl"] == "compiled", op.STATUS


def test_batched_input_and_temperature():
    h, w, t = _inputs(2 * 9, 24, 301, torch.float32, batch_shape=(2, 9))
    for temp in (1.0, 0.35, 2.5):
        logp, ent, gh, gw = _grads(lambda *a: linear_logprobs(*a, chunk_size=5), h, w, t, temp)
        want = _grads(linear_logprobs_naive, h, w, t, temp)
        assert logp.shape == (2, 9) and ent.shape == (2, 9) and gh.shape == h.shape
        torch.testing.assert_close(logp, want[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ent, want[1], atol=1e-4, rtol=1e-4)
        assert _rel(gh, want[2]) < 1e-4 and _rel(gw, want[3]) < 1e-4
    # a lower temperature sharpens the distribution: the entropy must drop
    assert (linear_logprobs(h, w, t, 0.35)[1] < linear_logprobs(h, w, t, 2.5)[1]).all()


def test_weight_may_be_a_non_contiguous_view_and_only_one_input_needs_grad():
    """ZeRO-3 hands over a gathered parameter and tied heads may be views: no layout assumption may break."""
    h, w, t = _inputs(23, 40, 211, torch.float32)
    storage = torch.randn(40, 211)  # W^T stored, W seen through .t(): strides (1, 211)
    storage.copy_(w.detach().t())
    w_view = storage.t().requires_grad_()
    assert not w_view.is_contiguous()
    logp, ent = linear_logprobs(h, w_view, t, 0.9, chunk_size=6)
    want = linear_logprobs_naive(h, w, t, 0.9)
    torch.testing.assert_close(logp, want[0], atol=1e-4, rtol=1e-4)
    (gw,) = torch.autograd.grad(logp.sum() + ent.sum(), (w_view,))
    (gw_ref,) = torch.autograd.grad(want[0].sum() + want[1].sum(), (w,))
    assert _rel(gw, gw_ref) < 1e-4
    # hidden only (a frozen head)
    hd = h.detach().requires_grad_()
    logp, _ = linear_logprobs(hd, w.detach(), t, chunk_size=4)
    logp.sum().backward()
    assert hd.grad is not None and torch.isfinite(hd.grad).all()


def test_gradcheck_fp64():
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(7, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(11, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    t = torch.randint(0, 11, (7,), generator=gen)
    for impl in ("compiled", "reference"):
        assert torch.autograd.gradcheck(lambda a, b: linear_logprobs(a, b, t, 0.8, chunk_size=3, impl=impl), (h, w))
    assert op.STATUS["cpu"]["impl"] == "compiled"


def test_opcheck():
    h, w, t = _inputs(13, 24, 97, torch.float32)
    for keep in (True, False):
        torch.library.opcheck(op.linear_logprobs_fwd, (h, w, t, 0.7, 5, keep))
        torch.library.opcheck(op.linear_logprobs_fwd, (h.detach(), w.detach(), t, 1.0, 64, keep))
    lse = torch.randn(13)
    args = (h.detach(), w.detach(), t, lse, torch.rand(13), torch.randn(13), torch.randn(13), 0.7, 5)
    torch.library.opcheck(op.linear_logprobs_bwd, (*args, True, True))
    torch.library.opcheck(op.linear_logprobs_bwd, (*args, False, True))


@pytest.mark.parametrize("n, chunk, max_rows", [(13, 5, 4096), (15, 5, 4096), (4, 5, 4096), (5, 5, 4096),
                                                (1, 3, 4096), (13, 2, 4), (12, 3, 4), (13, 5, 13), (7, 1, 2)])
def test_backward_starts_from_the_forwards_last_tile(n, chunk, max_rows):
    """With grad on, the CPU kernel keeps its last (full) tile of logits and the backward turns them into that
    tile's gradient instead of recomputing them: the same gradients, one GEMM fewer, no extra tile held. Tiles are
    up to max_rows tokens by as many vocabulary columns as chunk x V elements allow (several of each here)."""
    vocab = 97
    h, w, t = _inputs(n, 24, vocab, torch.float64)
    ext = op._select(h.device)
    logp, ent, lse, kept = op._compiled_forward(ext, h.detach(), w.detach(), t, 0.7, chunk, True, max_rows=max_rows)
    rows = min(n, max_rows)
    cols = min(vocab, chunk * vocab // rows)
    assert kept.numel() == rows * cols <= chunk * vocab
    # the kept tile is the last rows' logits over the last columns (tiles run short-first: the last is a full one)
    torch.testing.assert_close(kept.view(rows, cols), (h[-rows:] @ w[-cols:].T).detach())
    assert op._compiled_forward(ext, h.detach(), w.detach(), t, 0.7, chunk, False, max_rows=max_rows)[3].numel() == 0
    want_fwd = linear_logprobs_naive(h, w, t, 0.7)
    torch.testing.assert_close(logp, want_fwd[0].detach())
    torch.testing.assert_close(ent, want_fwd[1].detach())
    g_lp, g_en = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    args = (ext, h.detach(), w.detach(), t, lse, ent, g_lp, g_en, 0.7, chunk, True, True)
    want = op._compiled_backward(*args, op._nothing_kept(h), max_rows=max_rows)  # every tile recomputed
    got = op._compiled_backward(*args, kept, max_rows=max_rows)
    naive = torch.autograd.grad((want_fwd[0] * g_lp).sum() + (want_fwd[1] * g_en).sum(), (h, w))
    for a, b, c in zip(got, want, naive):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, c)
    # a kept buffer that does not match the call is refused, not silently used
    with pytest.raises(RuntimeError, match="kept logits do not belong"):
        op._compiled_backward(*args, torch.zeros(2 * vocab, dtype=torch.float64), max_rows=max_rows)


def test_training_uses_the_kept_chunk_once_and_a_second_backward_recomputes():
    h, w, t = _inputs(13, 24, 97, torch.float32)
    weights = torch.linspace(-1, 1, 13)
    used = op.KEPT_USED["count"]
    logp, ent = linear_logprobs(h, w, t, 0.7, chunk_size=5, impl="compiled")
    loss = (logp * weights).sum() + ent.sum()
    first = torch.autograd.grad(loss, (h, w), retain_graph=True)
    assert op.KEPT_USED["count"] == used + 1 and not op._KEPT
    second = torch.autograd.grad(loss, (h, w))
    assert op.KEPT_USED["count"] == used + 1
    naive_logp, naive_ent = linear_logprobs_naive(h, w, t, 0.7)
    naive = torch.autograd.grad((naive_logp * weights).sum() + naive_ent.sum(), (h, w))
    for a, b, c in zip(first, second, naive):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, c, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # scoring only (old policy, reference model): nothing kept
        linear_logprobs(h, w, t, 0.7, chunk_size=5, impl="compiled")
    assert not op._KEPT
    linear_logprobs(h, w, t, 0.7, chunk_size=5, impl="compiled")  # a graph that never runs backward
    linear_logprobs(h, w, t, 0.7, chunk_size=5, impl="compiled")
    assert len(op._KEPT) == 1  # one slot: the first call's chunk was let go


def test_a_mismatch_on_first_use_falls_back_to_the_reference_once(monkeypatch):
    real = op._compiled_forward

    def wrong(*args, **kwargs):
        logp, ent, lse, kept = real(*args, **kwargs)
        return logp + 1e-2, ent, lse, kept  # a subtly wrong kernel

    monkeypatch.setattr(op, "_compiled_forward", wrong)
    h, w, t = _inputs(9, 16, 77, torch.float32)
    with pytest.warns(UserWarning, match="logp differs from the reference") as record:
        logp, _ = linear_logprobs(h, w, t, chunk_size=4)
    assert len([r for r in record if "linear_logprobs" in str(r.message)]) == 1
    assert op.STATUS["cpu"]["impl"] == "reference" and "logp differs" in op.STATUS["cpu"]["reason"]
    assert op.implementation("cpu")["impl"] == "reference"
    torch.testing.assert_close(logp, linear_logprobs_naive(h, w, t)[0], atol=1e-5, rtol=1e-5)  # still right
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided once: no second warning
        linear_logprobs(h, w, t, chunk_size=4)[0].sum().backward()
    with pytest.raises(OgrpoError, match="impl='compiled' is not available on cpu"):
        linear_logprobs(h, w, t, impl="compiled")


def test_no_compiler_falls_back_with_the_reason(monkeypatch):
    def no_build(device_type):
        raise RuntimeError("Error building extension: c++: not found")

    monkeypatch.setattr(op, "_load", no_build)
    h, w, t = _inputs(5, 8, 31, torch.float32)
    with pytest.warns(UserWarning, match="could not be built"):
        logp, _ = linear_logprobs(h, w, t)
    assert op.STATUS["cpu"] == {"impl": "reference", "reason": op.STATUS["cpu"]["reason"]}
    assert "c++: not found" in op.STATUS["cpu"]["reason"]
    torch.testing.assert_close(logp, linear_logprobs_naive(h, w, t)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs, needle", [
    ({"impl": "fast"}, "impl must be one of"),
    ({"temperature": 0.0}, "temperature must be > 0"),
    ({"chunk_size": -1}, "chunk_size must be >= 1"),
])
def test_bad_arguments_are_one_line_errors(kwargs, needle):
    h, w, t = _inputs(4, 8, 16, torch.float32)
    with pytest.raises(OgrpoError, match=needle):
        linear_logprobs(h, w, t, **kwargs)


def test_bad_tensors_are_one_line_errors():
    h, w, t = _inputs(4, 8, 16, torch.float32)
    with pytest.raises(OgrpoError, match="shapes do not match"):
        linear_logprobs(h, w[:, :7], t)
    with pytest.raises(OgrpoError, match="targets must be int64"):
        linear_logprobs(h, w, t.int())
    with pytest.raises(OgrpoError, match="must share a dtype"):
        linear_logprobs(h, w.double(), t)


def test_default_chunk_keeps_one_chunk_of_fp32_logits_under_256_mib():
    for vocab in (151_936, 32_000, 384, 10_000_000):
        chunk = reference.default_chunk_size(vocab)
        assert chunk >= 1 and (chunk * vocab * 4 <= 192 << 20 or chunk == 1)
    assert reference.default_chunk_size(151_936) == 331  # Qwen2's vocabulary: 331 rows x 151,936 x 4 B < 192 MiB


_MEMORY_SCRIPT = textwrap.dedent("""
    import torch
    from ogrpo.kernels.linear_logprobs import linear_logprobs, linear_logprobs_naive
    torch.set_num_threads(2)

    def status_kib(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])

    def phase_peak_mib(fn):
        # Linux resets the peak RSS (VmHWM) to the current RSS on "5" > clear_refs: each phase gets its own
        # high-water mark, whatever an earlier phase (build, first-use check) touched.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = status_kib("VmRSS")
        fn()
        return (status_kib("VmHWM") - before) / 1024

    n, hid, vocab = 2048, 64, 16384   # full fp32 logits: 2048 * 16384 * 4 B = 128 MiB
    h = torch.randn(n, hid, requires_grad=True)
    w = (torch.randn(vocab, hid) / 8).requires_grad_()
    t = torch.randint(0, vocab, (n,))
    logp, ent = linear_logprobs(h[:8], w, t[:8], chunk_size=32)   # build/load, first-use check, BLAS threads
    (logp.sum() + ent.sum()).backward()
    w.grad = h.grad = None

    def chunked():
        logp, ent = linear_logprobs(h, w, t, chunk_size=64)       # one chunk: 64 * 16384 * 4 B = 4 MiB
        (logp.sum() + ent.sum()).backward()

    def full():
        with torch.no_grad():
            linear_logprobs_naive(h, w, t)                         # control: the full logits, forward only

    c = phase_peak_mib(chunked)
    w.grad = h.grad = None
    print(c, phase_peak_mib(full))
""")


@pytest.mark.slow
def test_peak_memory_is_one_chunk_not_the_full_logits(tmp_path):
    """Peak resident memory of each phase, measured with Linux's resettable high-water mark.

    glibc's mmap threshold is pinned at 1 MiB: by default it grows to 32 MiB after the first large free, and
    freed chunks then stay in the heap, so RSS would count allocator slack (measured: 47 MiB instead of 7)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    proc = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    chunked, full = map(float, proc.stdout.split()[-2:])
    # the control must show the logits (128 MiB, ~4 copies in log_softmax + entropy), else the measurement is
    # blind and proves nothing
    assert full >= 100, (chunked, full)
    # chunked (measured 7 MiB idle): grads of h and W (0.5 + 4 MiB) and one 4 MiB chunk of logits at a time;
    # the bound leaves room for per-thread allocator arenas on a loaded machine, and stays far below one copy
    # of the full logits (128 MiB)
    assert chunked < 48, (chunked, full)


# --- CUDA (run where a GPU is; reported as skipped elsewhere) ----------------------------------------------------

CUDA_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES + [(300, 128, 32_003, 97)], ids=lambda s: "x".join(map(str, s)))
def test_cuda_matches_the_definition(shape, dtype):
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("bf16 needs sm_80+ (V100 runs fp16/fp32)")
    n, hid, vocab, chunk = shape
    h, w, t = _inputs(n, hid, vocab, dtype)
    h, w, t = (h.detach().cuda().requires_grad_(), w.detach().cuda().requires_grad_(), t.cuda())
    got = _grads(lambda *a: linear_logprobs(*a, chunk_size=chunk, impl="compiled"), h, w, t, 0.7)
    want = _grads(linear_logprobs_naive, h, w, t, 0.7)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got[0], want[0], atol=atol * 4, rtol=rtol)
    torch.testing.assert_close(got[1], want[1], atol=atol * 4, rtol=rtol)
    assert _rel(got[2], want[2]) < rtol and _rel(got[3], want[3]) < rtol
    assert op.implementation("cuda")["impl"] == "compiled"


@pytest.mark.gpu
def test_cuda_opcheck():
    h, w, t = _inputs(13, 24, 97, torch.float32)
    h, w, t = h.detach().cuda().requires_grad_(), w.detach().cuda().requires_grad_(), t.cuda()
    torch.library.opcheck(op.linear_logprobs_fwd, (h, w, t, 0.7, 5, True))
