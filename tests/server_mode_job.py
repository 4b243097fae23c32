"""One real server-mode CPU job that several tests read, started once per session (issue 35: start once, assert
many): a real `ogrpo serve` (vLLM-CPU, cpu_shm weight sync) and two trainer runs (`--vllm-url`) of the same
config one after the other against it (run-a on the fresh server, run-b on a server whose engine-wide generator
run-a advanced), launched and torn down by the local launcher from one JobSpec.

Readers: tests/test_train_server.py (run-a: the trainer entry in server mode, the plan's KV budget, weight pushes,
the stage profile), tests/test_serve_seed.py (run-a and run-b agree: per-request seeds) and
tests/test_prefix_stream.py (then a request asked whole and streamed: STREAM_REPORT). Nothing here is
changed by a test; each reads files only."""

from __future__ import annotations

import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

STEPS = 3
RUNS = ("run-a", "run-b")
VLLM_REPORT = "run-b-vllm.json"  # whether run-b's trainer process had vLLM loaded at its end
STREAM_REPORT = "stream-probe.json"  # tests/stream_probe.py: requests asked whole and streamed


@dataclass(frozen=True)
class ServerModeJob:
    job_dir: Path
    rc: int
    console: str  # what the launcher printed
    plan: dict  # the plan run.yaml carried (what `ogrpo render --gpus cpu` writes)
    survivors: tuple[str, ...]  # pids whose command line names the job directory, after the job ended

    def run(self, name: str) -> Path:
        return self.job_dir / name

    @property
    def logs(self) -> Path:
        return self.job_dir / "run" / "logs"


def _survivors(job_dir: Path) -> tuple[str, ...]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(job_dir).encode() in f.read():
                    found.append(pid)
        except OSError:
            continue
    return tuple(found)


def run_server_mode_job(job_dir: Path) -> ServerModeJob:
    from ogrpo import tiny
    from ogrpo.config import load_run_config
    from ogrpo.jobspec import JobSpec, Step
    from ogrpo.launch.local import run_local_result
    from ogrpo.plan import plan_from_config

    job_dir.mkdir(parents=True)
    rc = load_run_config("tiny", {"dtype": "float32", "max_steps": STEPS, "save_strategy": "no",
                                  "ogrpo": {"use_vllm": True, "max_prompt_length": 32}})
    plan = plan_from_config(rc, gpus="cpu", model=str(tiny.ensure_tiny_model())).to_dict()
    run = rc.to_dict()
    run["ogrpo"]["plan"] = plan
    (job_dir / "run.yaml").write_text(yaml.safe_dump(run))
    args = "--config {job_dir}/run.yaml --vllm-url http://{server_host}:{server_port} --output-dir {job_dir}/"
    # run-b through python -m ogrpo.train, reporting whether its process loaded vLLM (VLLM_REPORT)
    report = f"{sys.executable} {Path(__file__).with_name('train_report_vllm.py')} - {{job_dir}}/{VLLM_REPORT} "
    train = {"run-a": "ogrpo train " + args, "run-b": report + args}
    # then one request asked whole and streamed (ogrpo.serve.prefix_stream), the same answer expected
    probe = (f"{sys.executable} {Path(__file__).with_name('stream_probe.py')} http://{{server_host}}:{{server_port}} "
             f"{tiny.ensure_tiny_model()} {{job_dir}}/{STREAM_REPORT}")
    job = JobSpec(name="server-mode", job_dir=str(job_dir), health_timeout_s=300, steps=[
        # Importing TRL (earlier tests in this process did) sets VLLM_LOGGING_LEVEL=ERROR in os.environ, which
        # the server would inherit; INFO shows how vLLM sized its KV cache.
        Step(role="server", nodes=[0], gpus=[], ntasks=1, env={"VLLM_LOGGING_LEVEL": "INFO"},
             argv=["ogrpo", "serve", "--config", "{job_dir}/run.yaml", "--host", "{server_host}",
                   "--port", "{server_port}"]),
        Step(role="trainer", nodes=[0], gpus=[], ntasks=1, env={"OMP_NUM_THREADS": "1"},
             argv=["bash", "-c", " && ".join([*(train[name] + name for name in RUNS), probe])]),
    ])
    out = io.StringIO()
    res = run_local_result(job, out=out)
    return ServerModeJob(job_dir=job_dir, rc=res.rc, console=out.getvalue(), plan=plan,
                         survivors=_survivors(job_dir))
