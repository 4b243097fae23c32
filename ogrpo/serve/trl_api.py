"""`trl vllm-serve` (TRL 1.9 line, the GPU images) as `ogrpo serve` runs it: TRL's routes, parser and `main`, except
that every route but `/health/` answers only requests carrying the job's key (ogrpo.serve.auth; TRL's server has
no middleware option, so the guard goes around every Starlette app this process builds), and that concurrent
`/generate/` requests are generated together, each answered when it is done (ogrpo.serve.trl_stream).

Run as `python -m ogrpo.serve.trl_api ARGS` with the arguments of `python -m trl.scripts.vllm_serve`.
"""

from __future__ import annotations

from ogrpo.serve import trl_stream


def main(argv: list[str] | None = None) -> None:
    trl_stream.serve("ogrpo.serve.trl_api", argv=argv)


if __name__ == "__main__":
    main()
