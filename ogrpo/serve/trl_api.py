"""`trl vllm-serve` (TRL 1.9 line, the GPU images) as `ogrpo serve` runs it: unchanged, except that every route but
`/health/` answers only requests carrying the job's key (ogrpo.serve.auth). TRL's server has no middleware option,
so the guard goes around every Starlette app this process builds.

Run as `python -m ogrpo.serve.trl_api ARGS` with the arguments of `python -m trl.scripts.vllm_serve`.
"""

from __future__ import annotations

import runpy
import sys


def main() -> None:
    from ogrpo.serve.auth import install_starlette_guard

    install_starlette_guard()
    sys.argv[0] = "trl.scripts.vllm_serve"
    runpy.run_module("trl.scripts.vllm_serve", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
