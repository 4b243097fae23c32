"""The one job.sbatch on the real test cluster: `ogrpo render`'s file submitted with plain `sbatch` runs like
`ogrpo submit`, `ogrpo submit` runs byte for byte the file `render` writes, and two jobs whose servers share the
node run side by side on their own ports.

The entry points are stand-ins on PATH (tests/slurm/toy_steps.py behind `ogrpo serve` and `accelerate launch`),
so each job takes seconds; everything else is the product: the rendered script, the supervisor, srun steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import TOY, ogrpo, read_json, sacct_state, wait_for, wait_gone

pytestmark = pytest.mark.slurm

CONFIG = """model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct
dataset_name: trl-lib/tldr
reward_funcs: [accuracy]
per_device_train_batch_size: 4
num_generations: 4
max_completion_length: 128
ogrpo:
  cpus_per_gpu: 1
  account: ogrpo
  partition: debug
  time: '00:10:00'
"""

# `ogrpo serve ... --port P` → the toy server on P; `accelerate launch ... --set vllm_group_port=G` → records its
# argv, holds G the way TRL's trainer holds its weight-sync group (a listening socket on the node), and counts
# TOY_STEPS steps in the job dir.
FAKE_OGRPO = """#!{python}
import os, sys
args = sys.argv[1:]
assert args[0] == "serve", args
os.execv(sys.executable, [sys.executable, {toy!r}, "server", args[args.index("--port") + 1]])
"""
FAKE_ACCELERATE = """#!{python}
import json, os, runpy, socket, sys
args = sys.argv[1:]
job_dir = os.getcwd()  # the steps run in the job dir (#SBATCH --chdir)
group = int(next(a.split("=", 1)[1] for a in args if a.startswith("vllm_group_port=")))
with open(os.path.join(job_dir, "trainer.argv.json"), "w") as f:
    json.dump(args, f)
hold = socket.socket()
hold.bind(("127.0.0.1", group))  # fails if another job on the node holds the same group port
hold.listen()
sys.argv = [{toy!r}, "trainer", job_dir, os.environ.get("TOY_STEPS", "3")]
runpy.run_path({toy!r}, run_name="__main__")
"""


@pytest.fixture
def fake_entry_points(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("ogrpo", FAKE_OGRPO), ("accelerate", FAKE_ACCELERATE)):
        (bin_dir / name).write_text(text.format(python=sys.executable, toy=TOY))
        (bin_dir / name).chmod(0o755)
    # before the venv's real ones; the venv's bin next, so that the script's `python3` is this Python and the
    # supervisor does not put its own bin dir in front of the stand-ins
    path = f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    return {**os.environ, "PATH": path}


def render(cfg: Path, out: Path, job_dir: Path, gpus: str = "2xA40") -> bytes:
    ogrpo("render", "--gpus", gpus, "--config", str(cfg), "-o", str(out), "--job-dir", str(job_dir), check=True)
    return (out / "job.sbatch").read_bytes()


def sbatch(script: Path, env: dict) -> str:
    env = {k: v for k, v in env.items() if k != "OGRPO_PYTHON"}  # by hand: nothing but the user's PATH
    out = subprocess.run(["sbatch", "--parsable", str(script)], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().split(";")[0]


def batch_script(job_id: str) -> bytes:
    """The script Slurm stored for the job: what it ran, as Slurm has it."""
    out = subprocess.run(["scontrol", "write", "batch_script", job_id, "-"], capture_output=True, check=True)
    return out.stdout


def test_plain_sbatch_of_the_rendered_job_runs_like_submit(slurm_cluster, tmp_path, fake_entry_points):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG)
    job_dir = tmp_path / "job"
    rendered = render(cfg, job_dir, job_dir)
    job = sbatch(job_dir / "job.sbatch", fake_entry_points)
    wait_gone(job, 180)
    assert batch_script(job) == rendered
    log = (job_dir / "logs" / f"slurm-{job}.out").read_text()
    assert sacct_state(job) == "COMPLETED", log
    assert "server healthy" in log and "trainer finished" in log
    assert read_json(job_dir / "slurm" / "result.json")["rc"] == 0
    ports = read_json(job_dir / "run" / "ports.json")
    argv = json.loads((job_dir / "trainer.argv.json").read_text())
    # NodeAddr of the test node: 127.0.0.1, or the host end of node2's veth in the two-node cluster
    assert ports["server_host"] in ("127.0.0.1", os.environ.get("OGRPO_SLURM_SUBNET", "10.213.0") + ".1")
    assert f"http://{ports['server_host']}:{ports['server']}" in argv
    assert argv[argv.index("--main_process_port") + 1] == str(ports["rendezvous"])
    assert f"vllm_group_port={ports['group']}" in argv
    # the steps got their own devices and the memory the plan asked for
    server = read_json(job_dir / "run" / "roles" / "server.step.json")["cuda_visible_devices"]
    trainer = read_json(job_dir / "run" / "roles" / "trainer.step.json")["cuda_visible_devices"]
    assert server and trainer and set(server.split(",")).isdisjoint(trainer.split(","))
    mem = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job, "-o", "ReqMem"], capture_output=True,
                         text=True).stdout.split()
    want = int(sum(s["host_mem_gib"] for s in read_json(job_dir / "manifest.json")["jobspec"]["steps"]))
    assert mem and mem[0] in (f"{want}G", f"{want * 1024}M"), mem
    # status, logs by run directory: the supervisor recorded the job id itself
    info = json.loads(ogrpo("status", str(job_dir), "--json", check=True).stdout)
    assert info["job_id"] == job and info["state"] == "COMPLETED" and info["attempts"] == 1
    assert "done 3" in ogrpo("logs", str(job_dir), "--role", "trainer", check=True).stdout


def test_submit_runs_the_file_render_writes(slurm_cluster, tmp_path, fake_entry_points):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG)
    job_dir = tmp_path / "job"
    rendered = render(cfg, tmp_path / "rendered", job_dir)
    out = ogrpo("submit", "--gpus", "2xA40", "--config", str(cfg), "-o", str(job_dir), env=fake_entry_points,
                check=True)
    job = out.stdout.splitlines()[0].split()[-1]
    assert batch_script(job) == rendered == (job_dir / "job.sbatch").read_bytes()
    wait_gone(job, 180)
    assert sacct_state(job) == "COMPLETED", (job_dir / "logs" / f"slurm-{job}.out").read_text()


def toy_job(tmp_path: Path, name: str, steps: int):
    """A toy job rendered by the product's renderer: a 1-GPU server and a CPU trainer, 2 CPUs, 1 GiB each."""
    from ogrpo.jobspec import JobSpec, Step
    from ogrpo.launch.slurm.sbatch import SlurmOptions
    from ogrpo.launch.slurm import preflight

    job_dir = tmp_path / name
    spec = JobSpec(name=name, job_dir=str(job_dir), health_timeout_s=60, steps=[
        Step("server", [0], [0], 1, ["ogrpo", "serve", "--host", "{server_host}", "--port", "{server_port}"],
             host_mem_gib=0.5),
        Step("trainer", [0], [], 1, ["accelerate", "launch", "--main_process_port", "{rendezvous_port}",
                                     "--set", "vllm_group_port={group_port}"], env={"TOY_STEPS": str(steps)},
             host_mem_gib=0.5),
    ])
    opts = SlurmOptions(gpus_per_node=1, cpus_per_task=2, time_min=10, job_name=name)
    return spec, preflight(spec, opts)


def test_two_jobs_share_the_node_on_their_own_ports(slurm_cluster, tmp_path, fake_entry_points, monkeypatch):
    from ogrpo.launch.executor import SlurmExecutor
    from ogrpo.launch.slurm import min_cpus_per_node

    if (min_cpus_per_node(None) or 0) < 4:
        pytest.skip("the test cluster has fewer than 4 CPUs: restart it with tests/slurm/cluster.sh (it configures 8)")
    monkeypatch.setenv("PATH", fake_entry_points["PATH"])
    jobs = []
    for name in ("a", "b"):
        spec, opts = toy_job(tmp_path, name, steps=12)
        jobs.append((SlurmExecutor(opts).submit(spec).job_id, Path(spec.job_dir)))

    def running() -> bool:
        states = subprocess.run(["squeue", "-h", "-j", ",".join(j for j, _ in jobs), "-o", "%T"],
                                capture_output=True, text=True).stdout.split()
        both_training = all((d / "run" / "roles" / "trainer.step.json").exists() for _, d in jobs)
        return states == ["RUNNING", "RUNNING"] and both_training

    wait_for(running, 120, "both jobs running their steps at the same time")
    for job, _ in jobs:
        wait_gone(job, 180)
    for job, d in jobs:
        assert sacct_state(job) == "COMPLETED", (d / "logs" / f"slurm-{job}.out").read_text()
        assert read_json(d / "toy_ckpt.json")["step"] == 12
    (pa, pb) = (read_json(d / "run" / "ports.json") for _, d in jobs)
    assert set((pa["server"], pa["rendezvous"], pa["group"])).isdisjoint((pb["server"], pb["rendezvous"], pb["group"]))
    assert pa["server_host"] == pb["server_host"]  # one node, two servers
