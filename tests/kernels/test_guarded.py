"""ogrpo.kernels.guarded: the load -> first-use check -> fallback decision both ops share (no compiler needed)."""

from __future__ import annotations

import warnings

import pytest

from ogrpo.kernels.guarded import COMPILED_REASON, Guarded


class _Calls:
    def __init__(self, load_result=None, load_error=None, problem=None, verify_error=None):
        self.loads, self.verifies = [], []
        self.load_result, self.load_error = load_result if load_result is not None else object(), load_error
        self.problem, self.verify_error = problem, verify_error

    def load(self, kind):
        self.loads.append(kind)
        if self.load_error:
            raise self.load_error
        return self.load_result

    def verify(self, ext, device):
        self.verifies.append((ext, device))
        if self.verify_error:
            raise self.verify_error
        return self.problem


def test_a_verified_extension_is_kept_and_decided_once_per_device_type():
    calls = _Calls()
    guard = Guarded("op", calls.load, calls.verify)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        assert guard.extension("cpu") is calls.load_result
        assert guard.extension("cpu") is calls.load_result
    assert calls.loads == ["cpu"] and calls.verifies == [(calls.load_result, "cpu")]
    assert guard.status == {"cpu": {"impl": "compiled", "reason": COMPILED_REASON}}


@pytest.mark.parametrize("calls, reason", [
    (_Calls(load_error=RuntimeError("Error building extension\n\nc++: not found\n")),
     "extension could not be built: c++: not found"),
    (_Calls(problem="logp differs"), "compiled kernel disagrees with the reference: logp differs"),
    (_Calls(verify_error=ValueError("bad shape")),
     "compiled kernel disagrees with the reference: the first-use check raised ValueError: bad shape"),
])
def test_a_failure_falls_back_to_the_reference_with_one_warning(calls, reason):
    guard = Guarded("op", calls.load, calls.verify)
    with pytest.warns(UserWarning, match="ogrpo op on cpu: .*; using the PyTorch reference"):
        assert guard.extension("cpu") is None
    assert guard.status == {"cpu": {"impl": "reference", "reason": reason}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process and device type
        assert guard.extension("cpu") is None
    assert calls.loads == ["cpu"]
    guard.reset()
    assert guard.status == {}
    with pytest.warns(UserWarning):
        guard.extension("cpu")
    assert calls.loads == ["cpu", "cpu"]  # reset forgets the decision


def test_a_device_type_without_a_kernel_never_loads():
    calls = _Calls()
    guard = Guarded("op", calls.load, calls.verify)
    with pytest.warns(UserWarning, match="no compiled kernel for device type 'mps'"):
        assert guard.extension("mps") is None
    assert calls.loads == [] and guard.status["mps"]["impl"] == "reference"


def test_the_check_runs_on_the_device_it_was_given():
    class Device:  # a torch.device's shape: the decision is per type, the check runs on the device itself
        type = "cuda"

    calls = _Calls()
    guard = Guarded("op", calls.load, calls.verify)
    device = Device()
    guard.extension(device)
    assert calls.loads == ["cuda"] and calls.verifies == [(calls.load_result, device)]
    assert set(guard.status) == {"cuda"}


def test_both_ops_decide_through_it():
    pytest.importorskip("torch")
    from ogrpo.kernels.fused_sample import op as fused
    from ogrpo.kernels.linear_logprobs import op as linear

    for op, name in ((fused, "fused_sample"), (linear, "linear_logprobs")):
        assert isinstance(op._GUARD, Guarded) and op._GUARD.op == name
        assert op.STATUS is op._GUARD.status  # the manifest's record is the guard's
