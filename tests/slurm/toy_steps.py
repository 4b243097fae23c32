"""Stand-ins for `ogrpo serve` and the trainer, so the Slurm mechanics are tested in seconds.

server PORT:            answers GET /health with 200 until killed.
trainer JOB_DIR TOTAL:  counts TOTAL one-second "steps"; keeps its progress in JOB_DIR/toy_ckpt.json
                        (write-then-rename, like ogrpo.trainer.preemption); on USR2/SIGTERM saves and exits with
                        75 (EXIT_PREEMPTED); a requeued run resumes from the saved count.
"""

import http.server
import json
import os
import signal
import sys
import time


def server(port: int) -> None:
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path in ("/health", "/health/") else 404)  # vLLM, trl vllm-serve
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("0.0.0.0", port), Health).serve_forever()


def trainer(job_dir: str, total: int) -> None:
    ckpt = os.path.join(job_dir, "toy_ckpt.json")
    state = json.load(open(ckpt)) if os.path.exists(ckpt) else {"step": 0, "attempts": []}
    state["attempts"].append({"start": state["step"], "cvd": os.environ.get("CUDA_VISIBLE_DEVICES")})
    stop: list[str] = []
    signal.signal(signal.SIGUSR2, lambda s, f: stop.append("USR2"))
    signal.signal(signal.SIGTERM, lambda s, f: stop.append("TERM"))

    def save() -> None:
        with open(ckpt + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(ckpt + ".tmp", ckpt)

    print(f"resume at {state['step']}", flush=True)
    while state["step"] < total:
        time.sleep(1)
        state["step"] += 1
        if stop:
            save()
            print(f"{stop[0]}: saved at {state['step']}", flush=True)
            sys.exit(75)
        if state["step"] % 5 == 0:
            save()
    save()
    print(f"done {state['step']}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "server":
        server(int(sys.argv[2]))
    else:
        trainer(sys.argv[2], int(sys.argv[3]))
