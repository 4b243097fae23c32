"""Rendering: job.sbatch (bash -n, shellcheck, the job's rules), accelerate/deepspeed configs, run.yaml,
manifest, atomic writes, and the golden examples in slurm/examples/."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ogrpo.config import load_run_config
from ogrpo.errors import OgrpoError
from ogrpo.jobspec import build_jobspec, fill, slurm_ports
from ogrpo.plan import plan_from_config
from ogrpo.render import accelerate_config, deepspeed_config, render_job, write_job

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "slurm" / "examples"
SHELLCHECK = shutil.which("shellcheck") or str(Path(sys.executable).with_name("shellcheck"))

CASES = [("3xA40", None), ("4xV100-32G", None), ("2x8xA100-80G", "Qwen/Qwen2.5-7B-Instruct"), ("1xA40", None),
         ("2x4xV100-16G", "Qwen/Qwen2.5-0.5B-Instruct")]


def _render(recipe, gpus, model=None, job_dir="/jobs/x"):
    rc = load_run_config(recipe)
    plan = plan_from_config(rc, gpus=gpus, model=model)
    spec = build_jobspec(plan, rc, job_dir)
    return plan, spec, render_job(plan, rc, spec)


@pytest.mark.parametrize("gpus, model", CASES)
def test_sbatch_passes_bash_n_and_shellcheck(basic_recipe, tmp_path, gpus, model):
    _, _, files = _render(basic_recipe, gpus, model)
    script = tmp_path / "job.sbatch"
    script.write_text(files["job.sbatch"])
    subprocess.run(["bash", "-n", str(script)], check=True)
    sc = subprocess.run([SHELLCHECK, "-S", "info", str(script)], capture_output=True, text=True)
    assert sc.returncode == 0, sc.stdout


def test_cpu_sbatch_passes_shellcheck(tiny_recipe, tmp_path):
    _, spec, files = _render(tiny_recipe, "3xcpu")
    script = tmp_path / "job.sbatch"
    script.write_text(files["job.sbatch"])
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert subprocess.run([SHELLCHECK, str(script)], capture_output=True).returncode == 0
    assert "--gres" not in files["job.sbatch"]
    assert "--multi_gpu" in files["job.sbatch"] and "env OMP_NUM_THREADS=1" in files["job.sbatch"]


def test_sbatch_follows_the_job_rules(basic_recipe):
    plan, spec, files = _render(basic_recipe, "3xA40")
    text = files["job.sbatch"]
    assert "0.0.0.0" not in text
    assert text.count("#SBATCH --nodes=") == 1 and "#SBATCH --gres=gpu:3" in text  # one allocation
    assert text.count("srun --exact") == 0  # options one per line
    assert text.count("srun \\\n  --exact") == 2
    server, trainer = text.index("ogrpo serve"), text.index("accelerate launch")
    health = text.index("/health")
    assert server < health < trainer  # server, wait for health, then the trainer
    assert "--gres=gpu:1" in text[:server] and "--gres=gpu:2" in text[health:]
    assert 'kill -0 "$SERVER_PID"' in text  # the wait loop and the watchdog notice a dead server
    assert "trap cleanup EXIT" in text and 'exit "$rc"' in text
    assert "SERVER_PORT=$((20000 + (SLURM_JOB_ID % 10000) * 3))" in text
    assert "NCCL_P2P_DISABLE=1" in text
    assert '--vllm-url "http://$SERVER_HOST:$SERVER_PORT"' in text


def test_bash_ports_equal_python_ports():
    for job_id in (1, 9999, 10000, 123456, 987654321):
        out = subprocess.run(["bash", "-c", f"SLURM_JOB_ID={job_id}; SERVER_PORT=$((20000 + (SLURM_JOB_ID % 10000) "
                                            "* 3)); echo $SERVER_PORT $((SERVER_PORT + 1))"],
                             capture_output=True, text=True, check=True).stdout.split()
        assert tuple(map(int, out)) == slurm_ports(job_id)


def test_multi_node_trainer_gets_per_node_rank(basic_recipe):
    _, spec, files = _render(basic_recipe, "3x4xA40", "Qwen/Qwen2.5-7B-Instruct")
    t = spec.step("trainer")
    assert t.nodes == [1, 2] and t.ntasks == 2
    assert "--machine_rank" in t.argv and "{node_rank}" in t.argv
    assert '--machine_rank "$SLURM_PROCID"' in files["job.sbatch"]
    assert "--ntasks-per-node=1" in files["job.sbatch"]


def test_jobspec_contract(basic_recipe, tiny_recipe):
    rc = load_run_config(basic_recipe)
    spec = build_jobspec(plan_from_config(rc, gpus="3xA40"), rc, "/j")
    server, trainer = spec.steps
    assert server.argv == ["ogrpo", "serve", "--config", "{job_dir}/run.yaml", "--host", "{server_host}", "--port",
                           "{server_port}"]
    assert server.gpus == [0] and trainer.gpus == [1, 2]
    assert trainer.argv[:4] == ["accelerate", "launch", "--config_file", "{job_dir}/accelerate.yaml"]
    assert trainer.argv[-2:] == ["--vllm-url", "http://{server_host}:{server_port}"]
    filled = fill(trainer.argv, {"job_dir": "/j", "server_host": "10.0.0.1", "server_port": 20003,
                                 "rendezvous_host": "10.0.0.1", "rendezvous_port": 20004})
    assert "/j/run.yaml" in filled and "http://10.0.0.1:20003" in filled and "20004" in filled
    # Colocated: only a trainer step, no --vllm-url.
    rc1 = load_run_config(tiny_recipe)
    one = build_jobspec(plan_from_config(rc1, gpus="cpu"), rc1, "/j")
    assert [s.role for s in one.steps] == ["trainer"] and "--vllm-url" not in one.steps[0].argv
    two = build_jobspec(plan_from_config(rc1, gpus="3xcpu"), rc1, "/j")
    assert "--multi_gpu" in two.step("trainer").argv and two.step("trainer").env["OMP_NUM_THREADS"] == "1"
    assert json.loads(json.dumps(two.to_dict()))["steps"][0]["role"] == "server"


def test_deepspeed_fp16_block_on_v100(basic_recipe):
    plan, _, files = _render(basic_recipe, "4xV100-32G")
    ds = json.loads(files["deepspeed.json"])
    assert plan.trainer["strategy"] == "zero2" and ds["zero_optimization"]["stage"] == 2
    assert ds["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                          "hysteresis": 2, "min_loss_scale": 1}
    assert ds["bf16"] == {"enabled": False}
    assert deepspeed_config(_render(basic_recipe, "3xA40")[0]) is None  # DDP: no deepspeed.json
    assert "deepspeed.json" not in _render(basic_recipe, "3xA40")[2]


def test_offload_config(basic_recipe):
    plan, _, files = _render(basic_recipe, "1xA40")
    assert plan.trainer["strategy"] == "zero3_offload"
    ds = json.loads(files["deepspeed.json"])
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu" and ds["optimizer"]["type"] == "AdamW"


@pytest.mark.parametrize("gpus, model", CASES + [("3xcpu", None)])
def test_accelerate_reads_the_config(basic_recipe, tiny_recipe, tmp_path, gpus, model):
    """accelerate's own loader parses what we render (and DeepSpeed plans leave mixed_precision to the JSON)."""
    from accelerate.commands.config.config_args import load_config_from_file

    recipe = tiny_recipe if "cpu" in gpus else basic_recipe
    plan, spec, files = _render(recipe, gpus, model, job_dir=str(tmp_path))
    (tmp_path / "accelerate.yaml").write_text(files["accelerate.yaml"])
    cfg = load_config_from_file(str(tmp_path / "accelerate.yaml"))
    assert cfg.num_processes == plan.trainer["num_processes"]
    assert cfg.num_machines == len(plan.trainer["nodes"])
    if plan.trainer["strategy"] != "ddp":
        assert cfg.distributed_type.value == "DEEPSPEED" and cfg.mixed_precision is None
    if "cpu" in gpus:
        assert cfg.use_cpu and cfg.distributed_type.value == "MULTI_GPU"


def test_run_yaml_carries_the_plan_and_loads_back(basic_recipe, tmp_path):
    plan, _, files = _render(basic_recipe, "3xA40")
    (tmp_path / "run.yaml").write_text(files["run.yaml"])
    rc = load_run_config(tmp_path / "run.yaml")
    assert rc.plan == json.loads(json.dumps(plan.to_dict()))
    assert rc.ogrpo.gpus == "3xA40" and rc.trl == load_run_config(basic_recipe).trl
    man = json.loads(files["manifest.json"])
    assert man["plan"]["fits"] is True and man["ogrpo_version"] and "job.sbatch" in man["files"]
    assert man["inputs"]["gpus"] == "3xA40"


def test_write_job_is_atomic(tmp_path, basic_recipe):
    _, _, files = _render(basic_recipe, "3xA40")
    out = tmp_path / "job"
    written = write_job(files, out)
    assert sorted(p.name for p in written) == sorted(files)
    assert (out / "logs").is_dir() and (out / "job.sbatch").stat().st_mode & 0o111
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".job.")]  # no temp dir left
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OgrpoError, match="not a directory"):
        write_job(files, blocker)
    assert blocker.read_text() == "x"
    # missing parents are created, like `mkdir -p`
    written = write_job(files, tmp_path / "missing" / "job")
    assert sorted(p.name for p in written) == sorted(files)
    assert not [p for p in (tmp_path / "missing").iterdir() if p.name.startswith(".job.")]


def _examples():
    rows = []
    for line in (EXAMPLES / "examples.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            rows.append(tuple(line.split()))
    return rows


@pytest.mark.parametrize("name, gpus, recipe", _examples())
def test_examples_are_what_render_produces(tmp_path, run_cli, name, gpus, recipe):
    """slurm/examples/<name> equals `ogrpo render` output (run slurm/examples/regen.sh after intended changes)."""
    out = tmp_path / name
    run_cli("render", "--gpus", gpus, "--config", f"slurm/examples/recipes/{recipe}", "-o", str(out),
            "--job-dir", f"/shared/ogrpo-jobs/{name}", check_rc=0)
    golden = EXAMPLES / name
    produced = sorted(p.name for p in out.iterdir() if p.is_file())
    assert produced == sorted(p.name for p in golden.iterdir() if p.is_file())
    for fname in produced:
        assert (out / fname).read_text() == (golden / fname).read_text(), f"{name}/{fname} differs: run regen.sh"


# --- the rendered job.sbatch, executed with stand-ins for srun/scontrol and the two entry points ----------

FAKE_SRUN = """#!/bin/bash
# Stand-in for srun: drop the step options, honour --output, run the command as one task.
out=/dev/null
while [[ $# -gt 0 && "$1" == --* ]]; do
  case "$1" in --output=*) out="${1#--output=}";; esac
  shift
done
echo "$*" >> "$FAKE_DIR/srun.calls"
export SLURM_PROCID=0
exec "$@" >>"$out" 2>&1
"""

FAKE_SCONTROL = """#!/bin/bash
echo localhost
"""

FAKE_OGRPO = """#!{python}
# Stand-in for `ogrpo serve`: a /health (vLLM) and /health/ (trl vllm-serve) endpoint; FAKE_SERVER=die exits at once, die_later 1 s after its
# first health check.
import http.server, os, sys, threading, time
args = sys.argv[1:]
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
open(os.path.join(os.environ["FAKE_DIR"], "server.pid"), "w").write(str(os.getpid()))
open(os.path.join(os.environ["FAKE_DIR"], "server.devices"), "w").write(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
mode = os.environ.get("FAKE_SERVER", "ok")
if mode == "die":
    sys.exit(7)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path in ("/health", "/health/") else 404)
        self.end_headers()
        if mode == "die_later" and self.path in ("/health", "/health/") and not timers:
            timers.append(threading.Timer(1.0, lambda: os._exit(9)))  # dies after it was seen healthy
            timers[0].start()
    def log_message(self, *a):
        pass
timers = []
srv = http.server.HTTPServer((host, port), H)
srv.serve_forever()
"""

FAKE_ACCELERATE = """#!/bin/bash
echo "$@" > "$FAKE_DIR/trainer.argv"
echo "${CUDA_VISIBLE_DEVICES:-}" > "$FAKE_DIR/trainer.devices"
sleep "${FAKE_TRAIN_S:-0}" &
child=$!
trap 'kill $child; exit 143' TERM
wait $child
exit "${FAKE_TRAIN_RC:-0}"
"""


def _run_sbatch(tmp_path, files, **env):
    import os
    import socket

    fake = tmp_path / "fake"
    fake.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL),
                       ("ogrpo", FAKE_OGRPO.format(python=sys.executable)), ("accelerate", FAKE_ACCELERATE)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    job = tmp_path / "job"
    write_job(files, job)
    with socket.socket() as s:  # a job id whose derived port is free here
        for job_id in range(4242, 9999, 7):
            try:
                s.bind(("127.0.0.1", slurm_ports(job_id)[0]))
                break
            except OSError:
                continue
    full_env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", FAKE_DIR=str(fake), OGRPO_JOB_DIR=str(job),
                    SLURM_JOB_ID=str(job_id), SLURM_JOB_NODELIST="localhost", OGRPO_SERVER_HOST="127.0.0.1",
                    OGRPO_HEALTH_POLL_S="0.2", OGRPO_WATCH_POLL_S="0.2", **env)
    proc = subprocess.run(["bash", str(job / "job.sbatch")], env=full_env, capture_output=True, text=True,
                          timeout=120)
    return proc, fake, job, job_id


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.parametrize("train_rc", [0, 3])
def test_sbatch_runs_server_then_trainer_and_returns_its_code(basic_recipe, tmp_path, train_rc):
    _, _, files = _render(basic_recipe, "3xA40")
    proc, fake, job, job_id = _run_sbatch(tmp_path, files, FAKE_TRAIN_RC=str(train_rc), FAKE_TRAIN_S="0.5")
    assert proc.returncode == train_rc, proc.stderr
    assert "server healthy" in proc.stdout
    port = slurm_ports(job_id)[0]
    argv = (fake / "trainer.argv").read_text().split()
    assert f"http://127.0.0.1:{port}" in argv and str(port + 1) in argv
    assert f"{job}/run.yaml" in argv
    assert not _alive(int((fake / "server.pid").read_text()))  # the trap stopped the server
    calls = (fake / "srun.calls").read_text().splitlines()
    assert calls[0].startswith("env VLLM_SERVER_DEV_MODE=1 ogrpo serve") and "accelerate launch" in calls[1]


def test_sbatch_fails_fast_when_server_dies_before_health(basic_recipe, tmp_path):
    _, _, files = _render(basic_recipe, "3xA40")
    proc, fake, _, _ = _run_sbatch(tmp_path, files, FAKE_SERVER="die")
    assert proc.returncode == 1 and "exited before it was healthy" in proc.stderr
    assert not (fake / "trainer.argv").exists()  # the trainer never started


def test_sbatch_stops_trainer_when_server_dies(basic_recipe, tmp_path):
    _, _, files = _render(basic_recipe, "3xA40")
    proc, fake, _, _ = _run_sbatch(tmp_path, files, FAKE_SERVER="die_later", FAKE_TRAIN_S="60")
    assert proc.returncode == 1 and "the server step died" in proc.stderr


def _slurm_up() -> bool:
    import os

    os.environ.setdefault("SLURM_CONF", "/tmp/ogrpo-slurm-test/etc/slurm.conf")
    if not shutil.which("sbatch") or not Path(os.environ["SLURM_CONF"]).exists():
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    return out.returncode == 0 and bool(out.stdout.strip())


@pytest.mark.slurm
def test_sbatch_on_the_test_cluster(write_recipe, tmp_path):
    """The rendered job under real Slurm (tests/slurm/cluster.sh: 3 fake A40s): two concurrent `srun --exact`
    steps on disjoint GPUs, the server healthy before the trainer starts, the job's exit code = the trainer's,
    the server step cancelled at the end. The entry points are stand-ins (no GPU here)."""
    import os
    import time

    if not _slurm_up():
        pytest.skip("no test Slurm cluster: run tests/slurm/cluster.sh up")
    recipe = write_recipe("model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct\nper_device_train_batch_size: 4\n"
                          "num_generations: 4\nmax_completion_length: 256\n"
                          "ogrpo:\n  cpus_per_gpu: 1\n  account: ogrpo\n  partition: debug\n  time: '00:05:00'\n")
    _, _, files = _render(recipe, "2xA40", job_dir=str(tmp_path / "job"))
    fake = tmp_path / "fake"
    fake.mkdir()
    for name, text in (("ogrpo", FAKE_OGRPO.format(python=sys.executable)), ("accelerate", FAKE_ACCELERATE)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    write_job(files, tmp_path / "job")
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", FAKE_DIR=str(fake), FAKE_TRAIN_S="2",
               FAKE_TRAIN_RC="5", OGRPO_HEALTH_POLL_S="0.5", OGRPO_WATCH_POLL_S="0.5")
    out = subprocess.run(["sbatch", "--parsable", str(tmp_path / "job" / "job.sbatch")], env=env,
                         capture_output=True, text=True, check=True).stdout.strip()
    job_id = out.split(";")[0]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        q = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout
        if not q.strip():
            break
        time.sleep(1)
    else:
        subprocess.run(["scancel", job_id])
        pytest.fail(f"job {job_id} did not finish in 240 s")
    log = (tmp_path / "job" / "logs" / f"slurm-{job_id}.out").read_text()
    assert "server healthy" in log and "trainer exited with 5" in log, log
    server_dev = (fake / "server.devices").read_text().strip()
    trainer_dev = (fake / "trainer.devices").read_text().strip()
    assert server_dev and trainer_dev and set(server_dev.split(",")).isdisjoint(trainer_dev.split(","))
    # Accounting may lag, and a restarted test cluster reuses job ids: look for this job's record among them.
    codes = subprocess.run(["sacct", "-n", "-X", "-j", job_id, "-o", "ExitCode"], capture_output=True,
                           text=True).stdout.split()
    assert not codes or any(c.startswith("5:") for c in codes), codes


@pytest.mark.integration
def test_cpu_trainer_step_starts_real_gloo_workers(tiny_recipe, tmp_path):
    """The CPU trainer step as rendered (`--multi_gpu` + accelerate.yaml) starts 2 gloo ranks once the trainer
    asks for the CPU (GRPOConfig use_cpu=True, which the plan sets): `--cpu` would silently start one."""
    import os

    plan, spec, files = _render(tiny_recipe, "3xcpu", job_dir=str(tmp_path))
    assert plan.trainer_args["use_cpu"] is True
    (tmp_path / "accelerate.yaml").write_text(files["accelerate.yaml"])
    (tmp_path / "rankprobe.py").write_text(
        "from accelerate import PartialState\n"
        "s = PartialState(cpu=True)  # what TrainingArguments(use_cpu=True) creates\n"
        "print('RANK', s.process_index, s.num_processes, s.backend, flush=True)\n")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = fill(spec.step("trainer").argv, {"job_dir": str(tmp_path), "rendezvous_host": "127.0.0.1",
                                            "rendezvous_port": port, "server_host": "127.0.0.1", "server_port": 1})
    cut = argv.index("-m")
    cmd = [str(Path(sys.executable).with_name("accelerate"))] + argv[1:cut] + ["rankprobe.py"]
    env = dict(os.environ, **spec.step("trainer").env)
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    ranks = sorted(line.split()[1:] for line in out.stdout.splitlines() if line.startswith("RANK"))
    assert ranks == [["0", "2", "gloo"], ["1", "2", "gloo"]], out.stdout + out.stderr[-2000:]
