"""TRL's weight push under DeepSpeed ZeRO-3 served from one gather per step (ogrpo.overlap.zero3_push says why).

TRL's push (`VLLMGeneration.sync_weights`) streams `self._iter_named_params()`, which gathers each ZeRO-3
parameter through `self._dist.gather_params([param])` (trl.distributed.DistributedBackend, around DeepSpeed's
GatheredParameters) and names it with `self._fix_param_name_to_vllm(name)`; the names and shapes it sends are
kept in `self._weight_metadata` after the first push. `install` replaces `_iter_named_params` on the one
VLLMGeneration instance (layer `zero3_push` of ogrpo.patches.trl_vllm_wraps) and counts TRL's own gathers by
swapping `_dist.gather_params` on that instance's backend while TRL's iterator runs. TRL 1.9 (the images' line)
has no per-parameter iterator: there the patch never applies (`not_applicable`; ogrpo.overlap.zero3_push.why_not).
"""

from __future__ import annotations

from typing import Callable, Iterator

from ogrpo import compat
from ogrpo.patches import trl_vllm_wraps
from ogrpo.patches.target import moved, problems_of, resolve, trl_generation_module

NAME = "trl_zero3_push"
LIBRARY = "trl"


def not_applicable() -> str | None:
    """TRL 1.9's push has no per-parameter iterator: the patch never applies on that line."""
    import trl

    if compat.server_flavor(trl.__version__) == compat.TRL_VLLM_SERVE:
        return "this TRL line's push has no per-parameter iterator to replace (the patch never applies)"
    return None


def check() -> None:
    gen = trl_generation_module(NAME)
    problems = problems_of({"trl.distributed:DistributedBackend.gather_params": ("params",),
                            "trl.distributed:DistributedBackend.is_zero3": None,
                            f"{gen}:VLLMGeneration._iter_named_params": ("self",),
                            f"{gen}:VLLMGeneration._fix_param_name_to_vllm": ("name",)})
    if not problems:
        import inspect

        if "self._weight_metadata" not in inspect.getsource(resolve(f"{gen}:VLLMGeneration.sync_weights")):
            problems.append("VLLMGeneration.sync_weights no longer keeps `self._weight_metadata` (the names the "
                            "first push fixes, which the gathered copy must match)")
    if problems:
        raise moved(NAME, LIBRARY, problems)


def applies(vg) -> bool:
    """This VLLMGeneration's push has the per-parameter iterator and name mapping the patch replaces and reads."""
    return hasattr(vg, "_iter_named_params") and hasattr(vg, "_fix_param_name_to_vllm")


def is_zero3(vg) -> bool:
    return bool(getattr(getattr(vg, "_dist", None), "is_zero3", False))


def vllm_name(vg, name: str) -> str:
    """The name vLLM knows a trainer parameter by (TRL's mapping, which its own push applies)."""
    return vg._fix_param_name_to_vllm(name)


def install(vg, snapshot: Callable[[], list | None], on_gather: Callable[[], None]) -> Callable:
    """Once TRL's first push has fixed the weight metadata, `vg._iter_named_params` yields the `(vLLM name,
    tensor, device)` list `snapshot()` returns when that is not None (and runs no collective; an empty list on
    ranks that hold no copy), else TRL's own iterator, calling `on_gather()` per parameter TRL gathers.
    Returns `gather(param)`: TRL's gather context for one parameter, for the caller's own single gather."""
    check()
    dist = vg._dist
    gather_params = dist.gather_params

    def counted_gather(params):
        on_gather()
        return gather_params(params)

    def make(original_iter):
        def iter_named_params() -> Iterator:
            params = snapshot() if vg._weight_metadata is not None else None
            if params is not None:
                # each tensor goes back to the device the push sends from (the NCCL group on a GPU) one at a time
                yield from ((name, t.to(device, non_blocking=True)) for name, t, device in params)
                return
            dist.gather_params = counted_gather
            try:
                yield from original_iter()
            finally:
                dist.gather_params = gather_params

        return iter_named_params

    trl_vllm_wraps.wrap(vg, "_iter_named_params", "zero3_push", make, kind="vllm_generation")
    return lambda param: gather_params([param])
