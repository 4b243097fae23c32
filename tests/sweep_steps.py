"""Stand-ins for the two entry points a job's steps call by name, so that a sweep's points run in seconds.

Everything up to a step's own process is the product, unchanged: `ogrpo sweep` plans every point, writes the
sweep directory and the job array (or runs the local launch path), and the supervisor of each point starts its
steps with their ports. Only `ogrpo serve` and `accelerate launch`, first on PATH (`env()`), are stand-ins
(as in tests/slurm/fake_gpus.py), and each records what it was given:

server (`ogrpo serve --config JOB/run.yaml --host H --port P`): answers GET /health with 200 until killed;
    records JOB/stand-ins/server-<pid>.json (port, host, SLURM_JOB_ID).
trainer (`accelerate launch ... --config JOB/run.yaml --output-dir JOB/run ...`): counts run.yaml's max_steps
    steps of STEP_S seconds, logging a loss and a reward per step to run/metrics.jsonl as the trainer does (the
    reward is 0.2 + (learning_rate * 10 + beta) * step, at most 1), its progress in run/toy_ckpt.json after every step;
    on SIGTERM/USR2 saves and exits 75 (EXIT_PREEMPTED); a requeued attempt resumes from the saved step. Writes
    run/manifest.json's status (running, preempted, finished) as the real trainer does, and records each attempt
    (start step, times, ports it was given, SLURM_JOB_ID and restart count) in run/toy_ckpt.json.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import signal
import sys
import time
from pathlib import Path

STEP_S = float(os.environ.get("SWEEP_TOY_STEP_S", "1.0"))


@functools.cache
def env() -> dict[str, str]:
    """The environment for `ogrpo sweep` (sbatch exports it to the tasks, srun to the steps)."""
    from stand_ins import path_env  # here, not at the top: the stand-ins run this file as a script

    return path_env(__file__, "ogrpo-sweep-steps-")


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _write(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data) + "\n")
    os.replace(tmp, path)


def server(args: list[str]) -> None:
    job_dir = Path(_arg(args, "--config")).parent
    port, host = int(_arg(args, "--port")), _arg(args, "--host")
    rec_dir = job_dir / "stand-ins"
    rec_dir.mkdir(exist_ok=True)
    _write(rec_dir / f"server-{os.getpid()}.json", {"port": port, "host": host, "pid": os.getpid(),
                                                    "slurm_job_id": os.environ.get("SLURM_JOB_ID")})

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path.rstrip("/") == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    http.server.HTTPServer(("0.0.0.0", port), Health).serve_forever()


def trainer(args: list[str]) -> None:
    import yaml

    cfg = yaml.safe_load(Path(_arg(args, "--config")).read_text())
    run = Path(_arg(args, "--output-dir"))
    run.mkdir(parents=True, exist_ok=True)
    total, lr, beta = int(cfg["max_steps"]), float(cfg["learning_rate"]), float(cfg.get("beta") or 0.0)
    ckpt = run / "toy_ckpt.json"
    state = json.loads(ckpt.read_text()) if ckpt.exists() else {"step": 0, "attempts": []}
    attempt = {"start": state["step"], "t0": time.time(), "pid": os.getpid(),
               "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
               "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
               "vllm_url": _arg(args, "--vllm-url") if "--vllm-url" in args else None,
               "rendezvous_port": int(_arg(args, "--main_process_port"))}
    state["attempts"].append(attempt)
    manifest = run / "manifest.json"

    def status(word: str) -> None:  # with the resolved config, as the trainer's manifest (`ogrpo reproduce`)
        _write(manifest, {"status": word, "config": cfg, "seed": cfg.get("seed")})

    status("running")
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
    signal.signal(signal.SIGUSR2, lambda s, f: stop.append(s))
    _write(ckpt, state)
    print(f"resume at {state['step']}", flush=True)
    while state["step"] < total:
        deadline = time.monotonic() + STEP_S
        while time.monotonic() < deadline and not stop:
            time.sleep(0.05)
        if stop:
            attempt["t1"] = time.time()
            _write(ckpt, state)
            status("preempted")
            print(f"signal {stop[0]}: saved at {state['step']}", flush=True)
            sys.exit(75)
        state["step"] += 1
        reward = min(1.0, 0.2 + (lr * 10 + beta) * state["step"])
        with (run / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": state["step"], "loss": 1.0 / state["step"], "reward": reward}) + "\n")
        _write(ckpt, state)
    attempt["t1"] = time.time()
    _write(ckpt, state)
    status("finished")
    print(f"done {state['step']}", flush=True)


def main(tool: str, args: list[str]) -> None:
    if tool == "ogrpo" and args[:1] == ["serve"]:
        server(args)
    elif tool == "accelerate" and args[:1] == ["launch"]:
        trainer(args)
    else:  # any other use of the entry point is not a step: the real one, unchanged
        real = str(Path(sys.executable).parent / tool)
        os.execv(real, [real, *args])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
