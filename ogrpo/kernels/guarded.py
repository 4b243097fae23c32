"""One compiled op's extension per device type, trusted only after it matched its PyTorch reference.

Both ops (linear_logprobs, fused_sample) decide the same way: on the first call on a device type, load (or build)
the extension, run the op's first-use check against its reference, and keep the extension only when both
succeed. Otherwise the reference runs from then on: a missing compiler, a broken build or a kernel that
disagrees must never stop a run, nor train on wrong numbers. The decision is made once per process and device
type, warned once, and kept in `status` ({"impl": "compiled" | "reference", "reason"}) for the run manifest.
torch-free: the ops pass in how to load and how to verify.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable

DEVICE_TYPES = ("cpu", "cuda")  # the device types the ops have compiled kernels for
COMPILED_REASON = "built and matched the reference on first use"


class Guarded:
    def __init__(self, op: str, load: Callable[[str], Any], verify: Callable[[Any, Any], str | None]):
        """`load(device_type)` -> the extension (raises when it cannot be built); `verify(ext, device)` -> None
        when `ext` agrees with the reference on `device`, else what differed. Both are looked up per call by
        the op module's lambdas, so a test can replace the module's `_load`."""
        self.op = op
        self._load, self._verify = load, verify
        self.status: dict[str, dict[str, str]] = {}
        self._ext: dict[str, Any] = {}
        self._lock = threading.Lock()

    def extension(self, device) -> Any:
        """The verified extension for `device` (a device type string or a torch.device: the check runs on that
        device), or None when the reference must run there."""
        kind = getattr(device, "type", device)
        with self._lock:
            if kind in self._ext:
                return self._ext[kind]
            ext, reason = self._decide(kind, device)
            if ext is None:
                warnings.warn(f"ogrpo {self.op} on {kind}: {reason}; using the PyTorch reference", stacklevel=4)
                self.status[kind] = {"impl": "reference", "reason": reason}
            else:
                self.status[kind] = {"impl": "compiled", "reason": COMPILED_REASON}
            self._ext[kind] = ext
            return ext

    def _decide(self, kind: str, device) -> tuple[Any, str | None]:
        if kind not in DEVICE_TYPES:
            return None, f"no compiled kernel for device type {kind!r}"
        try:
            ext = self._load(kind)
        except Exception as exc:  # noqa: BLE001 - no compiler, no CUDA toolkit, a build error
            lines = [line for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
            return None, f"extension could not be built: {lines[-1][:300]}"
        try:
            problem = self._verify(ext, device)
        except Exception as exc:  # noqa: BLE001 - any failure of the compiled op means "do not trust it"
            problem = f"the first-use check raised {type(exc).__name__}: {exc}"
        if problem is not None:
            return None, f"compiled kernel disagrees with the reference: {problem}"
        return ext, None

    def reset(self) -> None:
        """Forget the per-device decisions (tests; a process normally decides once)."""
        with self._lock:
            self.status.clear()
            self._ext.clear()
