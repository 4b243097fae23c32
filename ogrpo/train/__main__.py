"""`python -m ogrpo.train --config RUN.yaml --output-dir DIR [--vllm-url URL] [--resume auto]`.

What a job's trainer step runs under `accelerate launch -m ogrpo.train`; same as `ogrpo train`.
"""

from __future__ import annotations

import argparse
import sys

from ogrpo.errors import OgrpoError
from ogrpo.launch.cpu_slots import pin_from_env
from ogrpo.train import parse_overrides
from ogrpo.trainer import quiet


def main(argv: list[str] | None = None) -> int:
    quiet.install()  # first: libraries print from their imports on (ogrpo/trainer/quiet.py)

    pin_from_env()  # a CPU plan's trainer keeps off the server's cores, threads started later included

    ap = argparse.ArgumentParser(prog="python -m ogrpo.train", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="run config YAML or a built-in recipe name (tiny)")
    ap.add_argument("--output-dir", default=None, help="run directory (default: runs/<config>-<time>)")
    ap.add_argument("--vllm-url", default=None, help="vLLM server base URL (server mode)")
    ap.add_argument("--resume", default=None, help="'auto' (last complete checkpoint) or a checkpoint dir")
    ap.add_argument("--gpus", default=None, help="plan for these GPUs when the config carries no plan")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a run-config key (repeatable)")
    ns = ap.parse_args(argv)
    try:
        # inside the try: the import's OgrpoError (a missing stack) is one line too
        from ogrpo.trainer.assembly import leave_process_group, train

        train(ns.config, output_dir=ns.output_dir, vllm_url=ns.vllm_url, resume=ns.resume,
              overrides=parse_overrides(ns.overrides), gpus=ns.gpus, own_process=True)
        leave_process_group()
    except OgrpoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
