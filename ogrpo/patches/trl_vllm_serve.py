"""TRL's `vllm-serve` script (TRL 1.9 line) with another vLLM `LLM` class in its engine workers (for
ogrpo.serve.trl_serve_cpu: the CPU weight-sync extension), its routes, parser and `main` unchanged.

TRL's `main` starts one worker process per data-parallel rank from the module's `llm_worker`, which imports `LLM`
from vllm when it runs: `install` swaps that module-level `llm_worker` for one that first replaces `vllm.LLM` in
the worker process and hands the worker's end of its pipe to `on_worker` (ogrpo.serve.trl_stream answers on
it), then runs TRL's.
"""

from __future__ import annotations

from ogrpo import compat
from ogrpo.patches.target import require

NAME = "trl_vllm_serve"
LIBRARY = "trl"

_TRL_LLM_WORKER = None
_WRAP_LLM = None
_ON_WORKER = None


def check() -> None:
    import trl

    targets: dict = {"trl.scripts.vllm_serve:make_parser": None, "trl.scripts.vllm_serve:main": ("script_args",),
                     "vllm:LLM.reset_prefix_cache": None, "vllm:LLM.collective_rpc": None}
    if compat.server_flavor(trl.__version__) == compat.TRL_VLLM_SERVE:  # the only line that runs this script
        targets["trl.scripts.vllm_serve:llm_worker"] = None
    require(NAME, LIBRARY, targets)


def _llm_worker(*args, **kwargs):
    import vllm

    # TRL's workers are forked (multiprocessing's default on Linux): they inherit the state install() set
    vllm.LLM = _WRAP_LLM(vllm.LLM)
    if _ON_WORKER is not None:  # TRL's llm_worker(script_args, data_parallel_rank, master_port, connection)
        _ON_WORKER(kwargs.get("connection", args[3] if len(args) > 3 else None))
    return _TRL_LLM_WORKER(*args, **kwargs)


def install(wrap_llm, on_worker=None) -> None:
    """Engine workers of `trl.scripts.vllm_serve.main` build `wrap_llm(vllm.LLM)` instead of vLLM's `LLM`, after
    `on_worker(connection)` with the worker's end of its pipe. Call before that `main`; a second call replaces
    both, never wraps TRL's worker twice."""
    global _TRL_LLM_WORKER, _WRAP_LLM, _ON_WORKER
    check()
    require(NAME, LIBRARY, {"trl.scripts.vllm_serve:llm_worker": None})  # check() asks it of the 1.9 line only
    from trl.scripts import vllm_serve

    _TRL_LLM_WORKER = _TRL_LLM_WORKER or vllm_serve.llm_worker
    _WRAP_LLM, _ON_WORKER = wrap_llm, on_worker
    vllm_serve.llm_worker = _llm_worker
