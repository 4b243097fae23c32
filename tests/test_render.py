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
from ogrpo.jobspec import build_jobspec, fill
from ogrpo.plan import plan_from_config
from ogrpo.planner.types import Precision, Strategy
from ogrpo.planner.types import Plan
from ogrpo.render import deepspeed_config, render_job, write_job

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
    # the steps as the supervisor runs them, for the reader
    assert "--multi_gpu" in files["job.sbatch"] and "OMP_NUM_THREADS=1" in files["job.sbatch"]


def test_sbatch_is_the_supervised_job(basic_recipe):
    plan, spec, files = _render(basic_recipe, "3xA40")
    text = files["job.sbatch"]
    lines = text.splitlines()
    assert "0.0.0.0" not in text and "hostname -I" not in text
    assert text.count("#SBATCH --nodes=") == 1 and "#SBATCH --gres=gpu:a40:3" in lines  # one typed allocation
    # checkpoint before the time limit, requeue, one log across attempts
    for line in ("#SBATCH --signal=B:USR2@90", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 "#SBATCH --output=/jobs/x/logs/slurm-%j.out", "#SBATCH --chdir=/jobs/x"):
        assert line in lines, line
    # host memory per node: the server's and the trainer's figures (ogrpo.planner.host_memory) added up
    mem = sum(s.host_mem_gib for s in spec.steps)
    assert mem > 0 and f"#SBATCH --mem={int(mem)}G" in lines
    # the body is the supervisor, nothing else: no step runs from bash (submitit's rendering marks its jobs with
    # SUBMITIT_EXECUTOR, which nothing of O-GRPO reads)
    body = [ln for ln in lines if ln and not ln.startswith("#")]
    assert body == ["set -euo pipefail", "JOB_DIR=/jobs/x", 'cd "$JOB_DIR"', f"RENDERED_PYTHON={sys.executable}",
                    "export SUBMITIT_EXECUTOR=slurm",
                    'exec "${OGRPO_PYTHON:-$RENDERED_PYTHON}" -m ogrpo.launch.slurm supervise "$JOB_DIR" \\',
                    "  --max-requeues 3 \\", "  --signal-delay 90"]


def test_sbatch_carries_the_container(write_recipe):
    recipe = write_recipe("model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct\nogrpo:\n  container: /img/ogrpo.sif\n")
    _, _, files = _render(recipe, "3xA40")
    # the supervisor wraps each step for the runtime it finds on the node (ogrpo.launch.containers)
    assert files["job.sbatch"].splitlines()[-1] == "  --container /img/ogrpo.sif"


def test_multi_node_trainer_gets_per_node_rank(basic_recipe):
    _, spec, files = _render(basic_recipe, "3x4xA40", "Qwen/Qwen2.5-7B-Instruct")
    t = spec.step("trainer")
    assert t.nodes == [1, 2] and t.ntasks == 2
    # {node_rank} is filled inside each srun task by the step wrapper (SLURM_NODEID)
    assert "--machine_rank" in t.argv and "{node_rank}" in t.argv
    assert "#SBATCH --nodes=3" in files["job.sbatch"]


def test_jobspec_contract(basic_recipe, tiny_recipe):
    rc = load_run_config(basic_recipe)
    spec = build_jobspec(plan_from_config(rc, gpus="3xA40"), rc, "/j")
    server, trainer = spec.steps
    assert server.argv == ["ogrpo", "serve", "--config", "{job_dir}/run.yaml", "--host", "{server_host}", "--port",
                           "{server_port}"]
    assert server.gpus == [0] and trainer.gpus == [1, 2]
    assert trainer.argv[:4] == ["accelerate", "launch", "--config_file", "{job_dir}/accelerate.yaml"]
    # TRL's weight-sync group port is the job's own, not TRL's fixed 51216 (GRPOConfig override through --set)
    assert trainer.argv[-4:] == ["--vllm-url", "http://{server_host}:{server_port}", "--set",
                                 "vllm_group_port={group_port}"]
    filled = fill(trainer.argv, {"job_dir": "/j", "server_host": "10.0.0.1", "server_port": 20003,
                                 "rendezvous_host": "10.0.0.1", "rendezvous_port": 20004, "group_port": 20005})
    assert "/j/run.yaml" in filled and "http://10.0.0.1:20003" in filled and "20004" in filled
    assert "vllm_group_port=20005" in filled
    from ogrpo.train import parse_overrides

    assert parse_overrides(["vllm_group_port=20005"]) == {"vllm_group_port": 20005}  # an int, as GRPOConfig wants
    # Colocated: only a trainer step, no --vllm-url.
    rc1 = load_run_config(tiny_recipe)
    one = build_jobspec(plan_from_config(rc1, gpus="cpu"), rc1, "/j")
    assert [s.role for s in one.steps] == ["trainer"] and "--vllm-url" not in one.steps[0].argv
    two = build_jobspec(plan_from_config(rc1, gpus="3xcpu"), rc1, "/j")
    assert "--multi_gpu" in two.step("trainer").argv and two.step("trainer").env["OMP_NUM_THREADS"] == "1"
    assert json.loads(json.dumps(two.to_dict()))["steps"][0]["role"] == "server"


def _with_strategy(recipe, gpus, strategy):
    """The plan for `gpus` with the trainer strategy set: what render writes for a strategy, whichever one the
    planner picks for this shape today."""
    rc = load_run_config(recipe)
    p = plan_from_config(rc, gpus=gpus).to_dict()
    p["trainer"]["strategy"] = strategy
    p = Plan.from_dict(p)
    return p, render_job(p, rc, build_jobspec(p, rc, "/jobs/x"))


def test_deepspeed_fp16_block_on_v100(basic_recipe):
    p, files = _with_strategy(basic_recipe, "4xV100-32G", "zero2")
    assert p.precision is Precision.FP16  # V100: no bf16
    ds = json.loads(files["deepspeed.json"])
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                          "hysteresis": 2, "min_loss_scale": 1}
    assert ds["bf16"] == {"enabled": False}
    p, files = _with_strategy(basic_recipe, "3xA40", "ddp")
    assert deepspeed_config(p) is None and "deepspeed.json" not in files  # DDP: no deepspeed.json


def test_offload_config(basic_recipe):
    _, files = _with_strategy(basic_recipe, "1xA40", "zero3_offload")
    ds = json.loads(files["deepspeed.json"])
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu" and ds["optimizer"]["type"] == "AdamW"


@pytest.mark.parametrize("gpus, model", CASES + [("3xcpu", None)])
def test_accelerate_reads_the_config(basic_recipe, tiny_recipe, tmp_path, gpus, model):
    """accelerate's own loader parses what we render (and DeepSpeed plans leave mixed_precision to the JSON)."""
    from accelerate.commands.config.config_args import load_config_from_file

    recipe = tiny_recipe if "cpu" in gpus else basic_recipe
    plan, spec, files = _render(recipe, gpus, model, job_dir=str(tmp_path))
    (tmp_path / "accelerate.yaml").write_text(files["accelerate.yaml"])
    cfg = load_config_from_file(str(tmp_path / "accelerate.yaml"))
    assert cfg.num_processes == plan.trainer.num_processes
    assert cfg.num_machines == len(plan.trainer.nodes)
    if plan.trainer.strategy is not Strategy.DDP:
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
    # a directory the file system refuses although access() lets root through (/proc): one line, nothing left
    with pytest.raises(OgrpoError, match=r"-o /proc/ogrpo-job: cannot write"):
        write_job(files, "/proc/ogrpo-job")


def _examples():
    rows = []
    for line in (EXAMPLES / "examples.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            rows.append(tuple(line.split()))
    return rows


@pytest.mark.parametrize("name, gpus, recipe", _examples())
def test_examples_are_what_render_produces(tmp_path, run_cli, name, gpus, recipe, monkeypatch):
    """slurm/examples/<name> equals `ogrpo render` output (run slurm/examples/regen.sh after intended changes)."""
    monkeypatch.setenv("SLURM_CONF", "/nonexistent")  # as regen.sh: no test cluster's KillWait in the examples
    monkeypatch.setenv("OGRPO_PYTHON", "/shared/ogrpo/.venv/bin/python")  # as regen.sh: the cluster's venv
    out = tmp_path / name
    run_cli("render", "--gpus", gpus, "--config", f"slurm/examples/recipes/{recipe}", "-o", str(out),
            "--job-dir", f"/shared/ogrpo-jobs/{name}", check_rc=0)
    golden = EXAMPLES / name
    produced = sorted(p.name for p in out.iterdir() if p.is_file())
    assert produced == sorted(p.name for p in golden.iterdir() if p.is_file())
    for fname in produced:
        assert (out / fname).read_text() == (golden / fname).read_text(), f"{name}/{fname} differs: run regen.sh"


# --- the rendered job.sbatch, executed with stand-ins for srun/scontrol and the two entry points ----------
# The real supervisor runs (ogrpo.launch.slurm supervise); only Slurm's tools and the heavy entry points are
# stand-ins. tests/slurm/test_slurm_job_sbatch.py runs the same file under the real test cluster.

FAKE_SRUN = """#!/bin/bash
# Stand-in for srun: drop the step options, run the command as one task. Slurm signals every process of a step
# (its proctrack container), not only the task: the stand-in passes a TERM to its whole session (the supervisor
# starts it in one of its own), or a trainer's child would outlive the step it was stopped with.
while [[ $# -gt 0 && "$1" == --* ]]; do shift; done
echo "$*" >> "$FAKE_DIR/srun.calls"
export SLURM_PROCID=0 SLURM_NODEID=0
"$@" &
child=$!
trap 'trap "" TERM INT; pkill -TERM -s $$' TERM INT
wait $child
rc=$?
while kill -0 $child 2>/dev/null; do wait $child; rc=$?; done
exit $rc
"""

FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") echo localhost ;;
  "show node") echo "NodeName=localhost Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=localhost State=IDLE" ;;
  *) echo "$*" >> "$FAKE_DIR/scontrol.calls" ;;
esac
"""

FAKE_OGRPO = """#!{python}
# Stand-in for `ogrpo serve`: a /health (vLLM) and /health/ (trl vllm-serve) endpoint; FAKE_SERVER=die exits at once,
# die_later 1 s after its first health check.
import http.server, os, sys, threading, time
args = sys.argv[1:]
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])
open(os.path.join(os.environ["FAKE_DIR"], "server.pid"), "w").write(str(os.getpid()))
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
sleep "${FAKE_TRAIN_S:-0}" &
child=$!
trap 'kill $child; exit 143' TERM
wait $child
exit "${FAKE_TRAIN_RC:-0}"
"""


def _stand_ins(tmp_path) -> Path:
    """srun, scontrol, ogrpo and accelerate stand-ins in one directory, for the front of PATH."""
    fake = tmp_path / "fake"
    fake.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL),
                       ("ogrpo", FAKE_OGRPO.format(python=sys.executable)), ("accelerate", FAKE_ACCELERATE)):
        (fake / name).write_text(text)
        (fake / name).chmod(0o755)
    return fake


def _run_sbatch(tmp_path, files, job_id=4242, **env):
    import os

    fake = _stand_ins(tmp_path)
    job = tmp_path / "job"
    write_job(files, job)
    # the supervisor puts its own Python's bin dir on PATH unless there already: after the stand-ins
    path = f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}"
    full_env = dict(os.environ, PATH=path, FAKE_DIR=str(fake), OGRPO_PYTHON=sys.executable,
                    SLURM_JOB_ID=str(job_id), SLURM_JOB_NODELIST="localhost", SLURM_CPUS_PER_TASK="4", **env)
    proc = subprocess.run(["bash", str(job / "job.sbatch")], env=full_env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    return proc, fake, job


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.parametrize("train_rc", [0, 3])
def test_sbatch_runs_the_steps_and_returns_the_trainers_code(basic_recipe, tmp_path, train_rc):
    _, spec, files = _render(basic_recipe, "3xA40", job_dir=str(tmp_path / "job"))
    proc, fake, job = _run_sbatch(tmp_path, files, FAKE_TRAIN_RC=str(train_rc), FAKE_TRAIN_S="1")
    assert proc.returncode == train_rc, proc.stdout + proc.stderr
    assert "server healthy" in proc.stdout
    ports = json.loads((job / "run" / "ports.json").read_text())
    assert ports["job_id"] == 4242 and ports["server_host"] == "127.0.0.1"  # NodeAddr, from scontrol
    assert len({ports["server"], ports["rendezvous"], ports["group"]}) == 3
    assert all(10000 <= ports[k] < 32768 for k in ("server", "rendezvous", "group"))  # below the ephemeral range
    argv = (fake / "trainer.argv").read_text().split()
    assert f"http://127.0.0.1:{ports['server']}" in argv and str(ports["rendezvous"]) in argv
    assert f"vllm_group_port={ports['group']}" in argv and f"{job}/run.yaml" in argv
    assert not _alive(int((fake / "server.pid").read_text()))  # the server was stopped with the job
    calls = (fake / "srun.calls").read_text().splitlines()
    assert {c.split(" -- ", 1)[1].split()[0] for c in calls} == {"ogrpo", "accelerate"}
    assert json.loads((job / "slurm" / "result.json").read_text())["rc"] == train_rc
    assert json.loads((job / "slurm" / "attempt-0.json").read_text())["ports"]["server"] == ports["server"]


@pytest.mark.slow
def test_sbatch_fails_fast_when_server_dies_before_health(basic_recipe, tmp_path):
    _, _, files = _render(basic_recipe, "3xA40", job_dir=str(tmp_path / "job"))
    proc, fake, job = _run_sbatch(tmp_path, files, FAKE_SERVER="die", FAKE_TRAIN_S="60")
    assert proc.returncode == 1 and "server exited with code 7 before becoming healthy" in proc.stdout
    assert "trainer stopped" in proc.stdout


@pytest.mark.slow
def test_sbatch_stops_trainer_when_server_dies(basic_recipe, tmp_path):
    _, _, files = _render(basic_recipe, "3xA40", job_dir=str(tmp_path / "job"))
    proc, fake, _ = _run_sbatch(tmp_path, files, FAKE_SERVER="die_later", FAKE_TRAIN_S="60")
    assert proc.returncode == 1 and "server exited with code 9 mid-run" in proc.stdout


def test_requeued_attempt_reuses_its_ports(basic_recipe, tmp_path):
    """A requeued job (same id, next attempt) finds the ports it recorded in run/ports.json."""
    _, _, files = _render(basic_recipe, "3xA40", job_dir=str(tmp_path / "job"))
    recorded = {"job_id": 4242, "server": 20101, "rendezvous": 20102, "group": 20103}
    (tmp_path / "job" / "run").mkdir(parents=True)
    (tmp_path / "job" / "run" / "ports.json").write_text(json.dumps(recorded))
    proc, fake, job = _run_sbatch(tmp_path, files, SLURM_RESTART_COUNT="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ports = json.loads((job / "run" / "ports.json").read_text())
    assert (ports["server"], ports["rendezvous"], ports["group"], ports["attempt"]) == (20101, 20102, 20103, 1)
    assert "http://127.0.0.1:20101" in (fake / "trainer.argv").read_text()


def test_supervise_outside_slurm_is_a_one_line_error(basic_recipe, tmp_path):
    import os

    _, _, files = _render(basic_recipe, "3xA40", job_dir=str(tmp_path / "job"))
    write_job(files, tmp_path / "job")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_JOB")}
    out = subprocess.run(["bash", str(tmp_path / "job" / "job.sbatch")], capture_output=True, text=True,
                         env=dict(env, OGRPO_PYTHON=sys.executable))
    assert out.returncode == 2 and "runs inside a Slurm job" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.integration
def test_cpu_trainer_step_starts_real_gloo_workers(tiny_recipe, tmp_path):
    """The CPU trainer step as rendered (`--multi_gpu` + accelerate.yaml) starts 2 gloo ranks once the trainer
    asks for the CPU (GRPOConfig use_cpu=True, which the plan sets): `--cpu` would silently start one."""
    import os

    plan, spec, files = _render(tiny_recipe, "3xcpu", job_dir=str(tmp_path))
    assert plan.trainer_args.to_dict()["use_cpu"] is True
    (tmp_path / "accelerate.yaml").write_text(files["accelerate.yaml"])
    (tmp_path / "rankprobe.py").write_text(
        "from accelerate import PartialState\n"
        "s = PartialState(cpu=True)  # what TrainingArguments(use_cpu=True) creates\n"
        "import pathlib\n"
        "# one file per rank: two ranks printing to one shared stdout interleave their lines\n"
        "pathlib.Path(f'rank{s.process_index}.txt').write_text(f'{s.process_index} {s.num_processes} {s.backend}')\n")
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
    ranks = sorted(p.read_text().split() for p in tmp_path.glob("rank*.txt"))
    assert ranks == [["0", "2", "gloo"], ["1", "2", "gloo"]], out.stdout + out.stderr[-2000:]


def test_sbatch_by_hand_needs_no_venv_on_path(basic_recipe, tmp_path):
    """`sbatch job.sbatch` from a shell that never activated the venv: the job runs the Python that rendered it
    (before, `python3` on PATH: a Python without ogrpo, and the job died at its first line)."""
    import os

    _, _, files = _render(basic_recipe, "3xA40", job_dir=str(tmp_path / "job"))
    assert f"RENDERED_PYTHON={sys.executable}" in files["job.sbatch"].splitlines()
    fake = _stand_ins(tmp_path)
    job = tmp_path / "job"
    write_job(files, job)
    env = {k: v for k, v in os.environ.items() if k not in ("OGRPO_PYTHON", "VIRTUAL_ENV", "PYTHONPATH")}
    # python3 on this PATH is the system's, without ogrpo; the venv's bin dir comes last (so that the supervisor,
    # which adds its own bin dir unless present, keeps the stand-ins first)
    env.update(PATH=f"{fake}:/usr/bin:/bin:{Path(sys.executable).parent}", FAKE_DIR=str(fake), SLURM_JOB_ID="4243",
               SLURM_JOB_NODELIST="localhost", SLURM_CPUS_PER_TASK="4")
    no_ogrpo = subprocess.run(["python3", "-c", "import ogrpo"], env=env, capture_output=True, text=True, cwd=tmp_path)
    if no_ogrpo.returncode == 0:
        pytest.skip("the system python3 has ogrpo installed: nothing to tell apart")
    proc = subprocess.run(["bash", str(job / "job.sbatch")], env=env, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "trainer finished; server stopped" in proc.stdout and (fake / "trainer.argv").exists()
    pid = fake / "server.pid"
    assert not pid.exists() or not _alive(int(pid.read_text()))  # nothing outlives the job
    # OGRPO_PYTHON still wins: a Python that does not exist fails the job at once, naming it
    env["OGRPO_PYTHON"] = str(tmp_path / "no-such-python")
    proc = subprocess.run(["bash", str(job / "job.sbatch")], env=env, capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 127 and "no-such-python" in proc.stderr


def test_no_text_of_the_recipe_becomes_a_command_of_job_sbatch(basic_recipe, write_recipe, tmp_path):
    """A line break in a value would end its `#SBATCH` line or header comment and run the rest as a command of the
    batch script. The recipe's TRL keys that reach the header (W&B keys become WANDB_* for every step) are shown
    escaped; O-GRPO's options that reach it are refused at load with the option's name."""
    attack = "x\necho PWNED; touch /tmp/ogrpo-pwned"
    recipe = write_recipe(basic_recipe.read_text() + f"wandb_project: {json.dumps(attack)}\n", "wandb.yaml")
    _, spec, files = _render(recipe, "3xA40")
    assert spec.env["WANDB_PROJECT"] == attack  # the run gets the value as written
    script = tmp_path / "job.sbatch"
    script.write_text(files["job.sbatch"])
    lines = files["job.sbatch"].splitlines()
    assert any("PWNED" in line for line in lines)
    assert all(line.startswith("#") for line in lines if "PWNED" in line), [x for x in lines if "PWNED" in x]
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert subprocess.run([SHELLCHECK, str(script)], capture_output=True).returncode == 0

    base = load_run_config(basic_recipe)
    for key in ("job_name", "partition", "account", "qos", "mem_per_gpu", "container", "time", "model", "gres_type"):
        recipe = write_recipe(basic_recipe.read_text() + f"ogrpo:\n  {key}: {json.dumps(attack)}\n", f"{key}.yaml")
        with pytest.raises(OgrpoError, match=rf"ogrpo\.{key}: .*control character"):
            load_run_config(recipe)
    recipe = write_recipe(basic_recipe.read_text() + f"ogrpo:\n  env:\n    A: {json.dumps(attack)}\n    B$(id): 1\n",
                          "env.yaml")
    with pytest.raises(OgrpoError) as refused:
        load_run_config(recipe)
    assert "ogrpo.env: 'B$(id)' is not an environment variable name" in str(refused.value)
    assert "ogrpo.env.A: 'x\\necho PWNED" in str(refused.value) and "control character" in str(refused.value)
    for key, value in (("partition", "gpu;id"), ("account", "lab $(id)"), ("qos", "a b"), ("mem_per_gpu", "40G;x")):
        recipe = write_recipe(basic_recipe.read_text() + f"ogrpo:\n  {key}: {json.dumps(value)}\n", f"{key}-2.yaml")
        with pytest.raises(OgrpoError, match=rf"ogrpo\.{key}: .* is not a Slurm"):
            load_run_config(recipe)
    # what sites and users write still loads
    ok = write_recipe(basic_recipe.read_text() + "ogrpo:\n  partition: gpu,gpu-long\n  account: lab_1.x\n"
                      "  qos: high\n  mem_per_gpu: 40G\n  job_name: my run (v2)\n  env:\n    NCCL_DEBUG: INFO\n"
                      "  system_prompt: \"Solve it.\\nThink first.\"\n", "ok.yaml")
    rc = load_run_config(ok)
    assert rc.ogrpo.partition == "gpu,gpu-long" and rc.ogrpo.system_prompt == "Solve it.\nThink first."
    assert base.ogrpo.partition is None
