"""vLLM's OpenAI server as `ogrpo serve` runs it (TRL 1.16 line): unchanged, except that completions which ask
for token ids only are not detokenized (the patch: ogrpo.patches.vllm_completions).

Every route but the liveness probe answers only the job's own requests: vLLM's `--middleware` option (applied in
each API server process) adds `ogrpo.serve.auth.JobKeyMiddleware`, which reads the key from the environment.

Run as `python -m ogrpo.serve.vllm_api ARGS` with the arguments of `python -m vllm.entrypoints.openai.api_server`.
"""

from __future__ import annotations

import runpy
import sys

from ogrpo.launch import cpu_slots
from ogrpo.patches import vllm_completions
from ogrpo.serve.auth import server_key


GUARD = "ogrpo.serve.auth.JobKeyMiddleware"


def with_guard(argv: list[str]) -> list[str]:
    return argv if GUARD in argv else [*argv, "--middleware", GUARD]


def main() -> None:
    server_key()  # no key, no server: fail here rather than in the API process after the model loaded
    vllm_completions.install()
    cpu_slots.release_frontend()
    sys.argv[:] = ["vllm.entrypoints.openai.api_server", *with_guard(sys.argv[1:])]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
