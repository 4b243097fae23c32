"""What every patch's `check()` uses: find its target, compare its shape, and fail loudly naming both sides."""

from __future__ import annotations

import importlib
import inspect
from importlib import metadata
from typing import Any, Iterable

from ogrpo.errors import OgrpoError


class PatchTargetMoved(OgrpoError):
    """A library no longer has the shape one of O-GRPO's patches was written against."""


def version(dist: str) -> str:
    for name in (dist, f"{dist}-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def moved(patch: str, dist: str, problems: Iterable[str]) -> PatchTargetMoved:
    """The error a check raises: which patch, which library at which version, what moved, where to fix it."""
    return PatchTargetMoved(f"patch {patch} cannot apply to {dist} {version(dist)}: " + "; ".join(problems)
                            + f" (update ogrpo/patches/{patch.rsplit('.', 1)[-1]}.py)")


def trl_generation_module(patch: str) -> str:
    """The name of TRL's module with VLLMGeneration and VLLMClient (it moved between TRL lines); PatchTargetMoved
    for `patch` where it is gone."""
    # CLI latency: `ogrpo plan`/`render` import this module, not this
    from ogrpo import compat

    try:
        return compat.vllm_generation_module().__name__
    except ImportError as exc:
        raise moved(patch, "trl", [f"TRL's generation module is gone ({exc})"]) from None


def resolve(path: str) -> Any:
    """`pkg.module:Attr.sub` -> the object; raises ImportError/AttributeError as Python does."""
    mod_name, _, attrs = path.partition(":")
    obj = importlib.import_module(mod_name)
    for name in filter(None, attrs.split(".")):
        obj = getattr(obj, name)
    return obj


def problems_of(targets: dict[str, tuple[str, ...] | None]) -> list[str]:
    """For each `module:attr` target: missing -> a problem; with a parameter tuple -> each missing parameter is one.
    The tuple lists parameters the patch passes or reads by name (order not checked)."""
    out = []
    for path, params in targets.items():
        try:
            obj = resolve(path)
        except (ImportError, AttributeError) as exc:
            out.append(f"{path} is gone ({type(exc).__name__}: {exc})")
            continue
        if params:
            try:
                have = inspect.signature(obj).parameters
            except (TypeError, ValueError):
                out.append(f"{path} has no inspectable signature")
                continue
            kinds = {p.kind for p in have.values()}
            if {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds:
                continue  # (*args, **kwargs): takes whatever the patch passes
            out += [f"{path} lost its `{p}` parameter" for p in params if p not in have]
    return out


def require(patch: str, dist: str, targets: dict[str, tuple[str, ...] | None]) -> None:
    problems = problems_of(targets)
    if problems:
        raise moved(patch, dist, problems)
