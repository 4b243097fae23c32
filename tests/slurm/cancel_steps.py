"""A stand-in trainer worker for the cancel tests, started under a real `accelerate launch`.

worker JOB_DIR: records its pid and parent (JOB_DIR/worker.json) and a run manifest saying "running", as the
trainer's rank 0 does; on SIGTERM it records why it came (ogrpo.launch.stopping, what the real trainer asks) in
JOB_DIR/worker-sigterm.json, then carries on as a trainer stuck in a long step would: only SIGKILL ends it.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

from ogrpo.launch import stopping


def worker(job_dir: str) -> None:
    job, since = Path(job_dir), time.time()
    run = job / "run"
    run.mkdir(parents=True, exist_ok=True)
    (run / "manifest.json").write_text(json.dumps({"status": "running"}) + "\n")

    def on_term(signum, frame):
        reason = stopping.sigterm_reason(run, since)
        print(f"worker: SIGTERM ({reason}); still busy", flush=True)
        (job / "worker-sigterm.json").write_text(json.dumps({"reason": reason}) + "\n")

    signal.signal(signal.SIGTERM, on_term)
    (job / "worker.json").write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid()}) + "\n")
    print("worker: running", flush=True)
    while True:
        time.sleep(0.5)


if __name__ == "__main__":
    worker(sys.argv[2])
