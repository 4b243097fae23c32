"""One home for dtype names: plan precision (fp32/bf16/fp16), torch names, vLLM `--dtype`, GRPOConfig flags.

The plan speaks "fp32"/"bf16"/"fp16"; torch, checkpoints and vLLM speak "float32"/"bfloat16"/"float16" (vLLM
also takes "half"/"float"); GRPOConfig has two booleans, `bf16` and `fp16`. Every translation goes through here.
Pure: no torch import.
"""

from __future__ import annotations

from typing import Any

from ogrpo.errors import OgrpoError

PRECISIONS = ("fp32", "bf16", "fp16")
TORCH_NAMES = ("float32", "bfloat16", "float16")

_TO_TORCH = {"fp32": "float32", "float32": "float32", "float": "float32",
             "bf16": "bfloat16", "bfloat16": "bfloat16",
             "fp16": "float16", "float16": "float16", "half": "float16"}
_TO_PRECISION = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# vLLM's own spelling for --dtype; it accepts "float16" too, "half" is what its docs and error messages use.
_TO_VLLM = {"float32": "float32", "bfloat16": "bfloat16", "float16": "half"}
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP16_MAX = 65504.0  # the largest finite fp16 value: activations past it overflow to inf


def _text(value: Any) -> str:
    return str(value).strip().removeprefix("torch.").lower()


def torch_name(value: Any, allow_auto: bool = False) -> str:
    """"float32" | "bfloat16" | "float16" for any spelling (fp16, half, torch.bfloat16, ...); "auto" if allowed."""
    text = _text(value)
    if allow_auto and text == "auto":
        return "auto"
    if text not in _TO_TORCH:
        raise OgrpoError(f"unknown dtype {value!r}; use one of {', '.join(PRECISIONS)}")
    return _TO_TORCH[text]


def precision(value: Any) -> str:
    """"fp32" | "bf16" | "fp16" for any spelling."""
    return _TO_PRECISION[torch_name(value)]


def vllm_name(value: Any) -> str:
    """vLLM's `--dtype` word for any spelling ("auto" passes through)."""
    name = torch_name(value, allow_auto=True)
    return name if name == "auto" else _TO_VLLM[name]


def nbytes(value: Any, default: float | None = None) -> float:
    """Bytes per element; `default` for "auto"/unknown when given, else an error."""
    try:
        return BYTES[torch_name(value)]
    except OgrpoError:
        if default is None:
            raise
        return default


def trainer_flags(value: Any) -> dict[str, bool]:
    """GRPOConfig's {"bf16": ..., "fp16": ...} for a precision (fp32: both off)."""
    p = precision(value)
    return {"bf16": p == "bf16", "fp16": p == "fp16"}


def from_trainer_flags(flags: Any) -> str | None:
    """The torch name GRPOConfig-style flags ask for (a dict or an object with .bf16/.fp16), None when neither."""
    get = flags.get if isinstance(flags, dict) else (lambda k: getattr(flags, k, None))
    if get("fp16"):
        return "float16"
    if get("bf16"):
        return "bfloat16"
    return None
