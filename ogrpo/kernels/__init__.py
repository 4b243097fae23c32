"""O-GRPO's own kernels, one folder per op (Liger-Kernel's layout): the op's Python face (`op.py`), C++/CUDA
sources (`csrc/`), a PyTorch reference (`reference.py`); tests in tests/kernels/, benchmarks in ogrpo/bench/.

The compiled parts are optional at import time: every op has a PyTorch reference it falls back to, and the
choice (and why) is recorded so a run's manifest says which implementation ran; the load -> first-use check ->
fallback decision is written once, in `guarded.py`, for every op.
"""
