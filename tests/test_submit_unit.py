"""The Slurm backend's pure parts (sbatch parameters, srun lines, resource split, option parsing) and its
pre-submit checks against stand-in Slurm tools on PATH. The real cluster is in tests/slurm/."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from ogrpo.errors import OgrpoError
from ogrpo.jobspec import JobSpec, Step
from ogrpo.launch import slurm as sl
from ogrpo.launch.slurm.sbatch import sbatch_lines
from ogrpo.render import sbatch_script


def spec(job_dir="/jobs/a", nodes_trainer=(0,)) -> JobSpec:
    return JobSpec(name="t", job_dir=job_dir, steps=[
        Step("server", [0], [0], 1, ["ogrpo", "serve", "--host", "{server_host}", "--port", "{server_port}"]),
        Step("trainer", list(nodes_trainer), [1, 2], len(nodes_trainer),
             ["accelerate", "launch", "--machine_rank", "{node_rank}", "--main_process_ip", "{rendezvous_host}",
              "--main_process_port", "{rendezvous_port}", "--output-dir", "{job_dir}/run"]),
    ])


@pytest.mark.parametrize("text,minutes", [
    ("90", 90), (45, 45), ("30:30", 31), ("01:30:00", 90), ("2-00", 2880), ("1-02:03", 1563), ("0:0:59", 1),
])
def test_parse_time(text, minutes):
    assert sl.parse_time(text) == minutes


@pytest.mark.parametrize("bad", ["soon", "1h", "0", "-5"])
def test_parse_time_rejects(bad):
    with pytest.raises(OgrpoError, match="--time"):
        sl.parse_time(bad)


def test_passthrough():
    assert sl.parse_passthrough(["mem=64G", "constraint=a40|a100", "exclusive", "mail_type=END"]) == {
        "mem": "64G", "constraint": "a40|a100", "exclusive": True, "mail-type": "END"}
    with pytest.raises(OgrpoError, match="KEY=VALUE"):
        sl.parse_passthrough(["=x"])


def test_sbatch_lines():
    opts = sl.SlurmOptions(partition="gpu", time_min=120, account="lab", qos="high", gpus_per_node=3,
                           cpus_per_task=24, extra={"mail-type": "END"}, signal_delay_s=10)
    lines = sbatch_lines(spec(), opts)
    for line in ["#SBATCH --partition=gpu", "#SBATCH --time=02:00:00", "#SBATCH --account=lab", "#SBATCH --qos=high",
                 "#SBATCH --gres=gpu:3", "#SBATCH --cpus-per-task=24", "#SBATCH --requeue",
                 "#SBATCH --open-mode=append",
                 "#SBATCH --chdir=/jobs/a", "#SBATCH --output=/jobs/a/logs/slurm-%j.out", "#SBATCH --nodes=1",
                 "#SBATCH --ntasks-per-node=1", "#SBATCH --mail-type=END"]:
        assert line in lines, line
    # the warning goes to the batch step only, never earlier than Slurm's 30 s check interval allows
    assert "#SBATCH --signal=B:USR2@30" in lines
    # no host-memory figure on the steps (a JobSpec built by hand): no --mem, the cluster's default applies
    assert not [x for x in lines if x.startswith("#SBATCH --mem")]
    script = sbatch_script(spec(), opts)
    # python replaces the batch shell so that the B: signal reaches the supervisor's handler
    assert 'exec "${OGRPO_PYTHON:-$RENDERED_PYTHON}" -m ogrpo.launch.slurm supervise "$JOB_DIR"' in script
    assert "--max-requeues 3" in script and "--signal-delay 30" in script
    assert not [x for x in script.splitlines() if x.startswith("srun")]  # steps are started by the supervisor


def test_sbatch_memory_is_the_steps_need_on_the_busiest_node():
    s = spec(nodes_trainer=(1, 2))
    s.steps[0].host_mem_gib, s.steps[1].host_mem_gib = 12.0, 30.5
    assert sl.job_mem_gib(s) == 31  # the trainer's nodes need more than the server's: --mem is per node
    assert "#SBATCH --mem=31G" in sbatch_lines(s, sl.SlurmOptions())
    one = spec()
    one.steps[0].host_mem_gib, one.steps[1].host_mem_gib = 12.0, 30.5
    assert sl.job_mem_gib(one) == 43  # both on node 0
    # the site's own rule replaces ours
    assert "#SBATCH --mem=64G" in sbatch_lines(one, sl.SlurmOptions(extra={"mem": "64G"}))
    assert not [x for x in sbatch_lines(one, sl.SlurmOptions(mem_per_gpu="40G")) if x.startswith("#SBATCH --mem=")]


def test_passthrough_refuses_what_the_job_mechanics_own():
    with pytest.raises(OgrpoError, match="--slurm signal: set by O-GRPO"):
        sl.parse_passthrough(["signal=USR1@60"])


def test_passthrough_replaces_rather_than_duplicates():
    opts = sl.SlurmOptions(gpus_per_node=3, cpus_per_task=24,
                           extra={"cpus-per-task": "8", "time": "01:00:00", "gpus": "a40:3", "constraint": "ib"})
    text = sbatch_lines(spec(), opts)
    assert "#SBATCH --cpus-per-task=8" in text and "#SBATCH --time=01:00:00" in text
    assert "#SBATCH --gpus=a40:3" in text and "#SBATCH --constraint=ib" in text
    for flag in ("--cpus-per-task", "--time", "--gres"):
        assert sum(line.startswith(f"#SBATCH {flag}") for line in text) == (0 if flag == "--gres" else 1)


def test_step_resources_split_shared_nodes():
    steps = spec().steps
    # 1 server GPU, 2 trainer GPUs on one 24-CPU node: 8 + 16 CPUs, memory likewise
    assert sl.step_resources(steps, 24, 96000) == {"server": (8, 32000), "trainer": (16, 64000)}
    # never zero, even on a 2-CPU test node
    assert sl.step_resources(steps, 2, None) == {"server": (1, None), "trainer": (1, None)}
    # steps on different nodes do not share
    assert sl.step_resources(spec(nodes_trainer=(1, 2)).steps, 24, None) == {"server": (24, None),
                                                                             "trainer": (24, None)}
    # with host-memory figures, memory follows them: 10 + 30 GiB of a 40000 MB job
    steps = spec().steps
    steps[0].host_mem_gib, steps[1].host_mem_gib = 10.0, 30.0
    assert sl.step_resources(steps, 24, 40000) == {"server": (8, 10000), "trainer": (16, 30000)}


def test_srun_lines_multi_node():
    s = spec(nodes_trainer=(1, 2))
    hosts = ["n0", "n1", "n2"]
    ports = {"server": 23702, "rendezvous": 23703, "group": 23704}
    # the server binds the address Slurm knows for its node (NodeAddr), not a name or `hostname -I` guess
    values = sl.placeholder_values(s, hosts, ports, {"n0": "10.0.0.1", "n1": "10.0.0.2", "n2": "10.0.0.3"})
    assert values == {"server_host": "10.0.0.1", "server_port": 23702, "rendezvous_host": "10.0.0.2",
                      "rendezvous_port": 23703, "group_port": 23704, "job_dir": "/jobs/a"}
    trainer = sl.srun_argv(s.steps[1], job_dir="/jobs/a", hosts=hosts, values=values, cpus=8, mem_mb=1000)
    cut = trainer.index("--")
    assert trainer[:cut][:3] == ["srun", "--exact", "--job-name=trainer"]
    for opt in ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=n1,n2", "--gres=gpu:2",
                "--cpus-per-task=8", "--mem=1000M", "--unbuffered", "--kill-on-bad-exit=1"]:
        assert opt in trainer[:cut], opt
    # {node_rank} stays for the wrapper inside each task; the rest is filled
    assert trainer[cut + 1:] == ["accelerate", "launch", "--machine_rank", "{node_rank}",
                                 "--main_process_ip", "10.0.0.2",
                                 "--main_process_port", "23703", "--output-dir", "/jobs/a/run"]
    server = sl.srun_argv(s.steps[0], job_dir="/jobs/a", hosts=hosts, values=values, cpus=8, mem_mb=None)
    assert "--gres=gpu:1" in server and "--nodelist=n0" in server and server[-2:] == ["--port", "23702"]


def test_cpu_steps_ask_for_no_gpus():
    s = JobSpec(name="c", job_dir="/j", steps=[Step("trainer", [0], [], 1, ["true"])])
    argv = sl.srun_argv(s.steps[0], job_dir="/j", hosts=["h"], values={}, cpus=2, mem_mb=None)
    assert "--gres=none" in argv


# -- pre-submit checks against stand-in tools -----------------------------------------------------------------


def _tool(directory, name, body):
    p = directory / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """sinfo: partitions debug* and gpu, nodes with 3 A40s, 16 CPUs and 64000 MB (FAKE_NODE_MB); sacctmgr: account lab;
    sbatch --test-only: logs its arguments, fails when asked for more than 3 GPUs per node; sbatch --parsable
    FILE: keeps a copy of FILE (what Slurm would run) and its environment's OGRPO_PYTHON, prints job id 4242."""
    log = tmp_path / "sbatch.log"
    _tool(tmp_path, "sinfo", 'case "$*" in *"%P %G"*) echo "debug* gpu:a40:3(S:0)"; echo "gpu gpu:a40:3(S:0)";; '
                             '*%P*) echo "debug*"; echo gpu;; *%G*) echo "gpu:a40:3(S:0)";; '
                             '*%c*) echo 16;; *%m*) echo ${FAKE_NODE_MB:-64000};; esac')
    _tool(tmp_path, "sacctmgr", "echo lab")
    _tool(tmp_path, "sbatch", f'echo "$*" >> {log}; case "$*" in *gres=gpu:[4-9]*) '
                              'echo "sbatch: error: Requested node configuration is not available" >&2; exit 1;; '
                              f'--parsable*) cp "$2" {tmp_path}/submitted.sbatch; '
                              f'echo "$OGRPO_PYTHON" > {tmp_path}/submitted.python; echo 4242;; esac')
    for t in ("srun", "squeue"):
        _tool(tmp_path, t, "exit 0")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the job index `submit` appends to
    return log


def test_preflight_accepts_and_fits_cpus_to_the_nodes(fake_slurm):
    opts = sl.SlurmOptions(partition="gpu", account="lab", gpus_per_node=3, cpus_per_task=24)
    assert sl.preflight(spec(), opts).cpus_per_task == 16  # 8 per GPU by default, but the nodes have 16
    assert "--test-only --nodes=1 --ntasks-per-node=1 --cpus-per-task=16 --gres=gpu:3" in fake_slurm.read_text()
    assert "--partition=gpu --account=lab" in fake_slurm.read_text()
    # a count the site set (ogrpo.cpus_per_gpu) is left for sbatch to accept or refuse
    site = sl.SlurmOptions(gpus_per_node=3, cpus_per_task=24, cpus_from_config=True)
    assert sl.preflight(spec(), site).cpus_per_task == 24


@pytest.mark.parametrize("opts,match", [
    (dict(partition="nope"), "unknown partition 'nope': use one of debug, gpu"),
    (dict(account="other"), "unknown account 'other' for this user: use one of lab"),
    (dict(gpus_per_node=4), "4 GPUs per node requested but nodes of this cluster have at most 3"),
])
def test_preflight_rejects(fake_slurm, opts, match):
    with pytest.raises(OgrpoError, match=match):
        sl.preflight(spec(), sl.SlurmOptions(**opts))
    assert not fake_slurm.exists()  # refused before even asking sbatch


def test_preflight_refuses_more_host_memory_than_the_nodes_have(fake_slurm, monkeypatch):
    monkeypatch.setenv("FAKE_NODE_MB", "16000")
    s = spec()
    s.steps[0].host_mem_gib, s.steps[1].host_mem_gib = 6.0, 11.0
    with pytest.raises(OgrpoError) as err:
        sl.preflight(s, sl.SlurmOptions(partition="gpu", gpus_per_node=3))
    # 6 + 11 = 17 GiB on node 0 > 16000 MB = 15.6 GiB
    assert str(err.value).startswith("the plan needs 17 GiB of host RAM per node (server 6 GiB + trainer 11 GiB) "
                                     "but nodes of partition gpu have at most 15.6 GiB (sinfo -o %m: 16000 MB)")
    assert not fake_slurm.exists()
    s.steps[1].host_mem_gib = 9.0  # 15 GiB fits
    sl.preflight(s, sl.SlurmOptions(partition="gpu", gpus_per_node=3))
    assert "--mem=15G" in fake_slurm.read_text()


def test_plan_is_refused_on_small_nodes_through_the_cli(fake_slurm, tmp_path, monkeypatch):
    """3xA40 with a 1.5B model: two DDP processes loading fp32 weights plus the server, more than 16000 MB."""
    monkeypatch.setenv("FAKE_NODE_MB", "16000")
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model_name_or_path: Qwen/Qwen2.5-1.5B-Instruct\ndataset_name: trl-lib/tldr\n"
                   "reward_funcs: [accuracy]\n")
    out = subprocess.run([sys.executable, "-m", "ogrpo", "submit", "--gpus", "3xA40", "--config", str(cfg),
                          "-o", str(tmp_path / "job")], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]  # after the plan's warnings, one line naming the numbers
    assert "GiB of host RAM per node (server " in last and "at most 15.6 GiB" in last, out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "job").exists()


def test_preflight_reports_what_sbatch_refuses(fake_slurm, monkeypatch):
    monkeypatch.setattr(sl, "max_gpus_per_node", lambda partition: None)  # a site whose sinfo shows no GRES
    with pytest.raises(OgrpoError, match="Slurm would not accept this job .*Requested node configuration"):
        sl.preflight(spec(), sl.SlurmOptions(gpus_per_node=5))


def test_no_sbatch_is_a_one_line_error(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "ogrpo", "submit", "--backend", "slurm", "--gpus", "3xA40",
                          "--config", "tiny", "-o", str(tmp_path / "job")], capture_output=True, text=True, env=env)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "sbatch" in out.stderr and "--backend local" in out.stderr
    assert not (tmp_path / "job").exists()


def test_gpu_plan_without_slurm_is_refused_not_run_here(tmp_path):
    # The headline command on a machine without Slurm used to run the A40 plan locally and fail 26 s later.
    env = {**os.environ, "PATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "ogrpo", "submit", "--gpus", "3xA40", "--config", "tiny",
                          "-o", str(tmp_path / "job")], capture_output=True, text=True, env=env)
    assert out.returncode == 2, out.stderr
    assert "no Slurm here" in out.stderr and "--backend local --gpus cpu" in out.stderr
    assert out.stderr.strip().count("\n") == 0
    assert not (tmp_path / "job").exists()


# -- one job.sbatch: what `ogrpo render` writes is what `ogrpo submit --dry-run` shows and `ogrpo submit` runs ----

RUN_CONFIG = ("model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct\ndataset_name: trl-lib/tldr\nreward_funcs: [accuracy]\n"
              "ogrpo:\n  partition: gpu\n  time: '02:00:00'\n  account: lab\n  cpus_per_gpu: 4\n")


@pytest.mark.slow
def test_render_dry_run_and_submit_are_the_same_job_sbatch(fake_slurm, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(RUN_CONFIG)
    job = tmp_path / "job"

    def ogrpo(*args):
        out = subprocess.run([sys.executable, "-m", "ogrpo", *args], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return out.stdout

    ogrpo("render", "--gpus", "3xA40", "--config", str(cfg), "-o", str(tmp_path / "rendered"), "--job-dir", str(job))
    rendered = (tmp_path / "rendered" / "job.sbatch").read_text()
    shown = ogrpo("submit", "--gpus", "3xA40", "--config", str(cfg), "-o", str(job), "--dry-run")
    assert not job.exists()
    head = f"==> {job}/job.sbatch (submitted with: sbatch job.sbatch) <==\n"
    assert shown.split(head, 1)[1].split("==> steps")[0] == rendered
    out = ogrpo("submit", "--gpus", "3xA40", "--config", str(cfg), "-o", str(job))
    assert out.startswith("submitted job 4242\n")
    # byte for byte: the file sbatch was given, the file in the job directory, the file `render` wrote
    assert (tmp_path / "submitted.sbatch").read_bytes() == rendered.encode() == (job / "job.sbatch").read_bytes()
    assert (job / "slurm" / "job_id").read_text() == "4242\n"
    assert (tmp_path / "submitted.python").read_text().strip() == sys.executable
    for line in ("#SBATCH --gres=gpu:a40:3", "#SBATCH --cpus-per-task=12", "#SBATCH --partition=gpu",
                 "#SBATCH --account=lab", "#SBATCH --time=02:00:00", "#SBATCH --signal=B:USR2@90",
                 "#SBATCH --requeue"):
        assert line in rendered.splitlines(), line
    # every step of the job's spec is in it, as the reader's summary
    assert "#   server: (nodes [0], GPUs [0]" in rendered and "#   trainer: (nodes [0], GPUs [1, 2]" in rendered


def test_commands_fill_every_placeholder(tmp_path):
    from ogrpo.config import load_run_config
    from ogrpo.jobspec import build_jobspec
    from ogrpo.plan import plan_from_config

    cfg = tmp_path / "run.yaml"
    cfg.write_text(RUN_CONFIG)
    rc = load_run_config(str(cfg), {"ogrpo": {"gpus": "3xA40"}})
    spec = build_jobspec(plan_from_config(rc), rc, "/jobs/x")
    ports = {"server": 11000, "rendezvous": 11001, "group": 11002}
    cmds = sl.SlurmSupervisor(spec).commands(["node-a"], ports, 24, 40000, {"node-a": "10.1.1.1"})
    trainer = cmds["trainer"][cmds["trainer"].index("--") + 1:]
    assert not [a for a in trainer if "{" in a]
    assert "http://10.1.1.1:11000" in trainer and "vllm_group_port=11002" in trainer
    assert trainer[trainer.index("--main_process_port") + 1] == "11001"
    assert "--mem=" in " ".join(cmds["server"]) and "--gres=gpu:1" in cmds["server"]


def test_local_backend_dry_run(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ogrpo", "submit", "--backend", "local", "--config", "tiny",
                          "--dry-run", "-o", str(tmp_path / "job")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"would run locally in {tmp_path / 'job'}" in out.stdout and "trainer: accelerate launch" in out.stdout
    assert not (tmp_path / "job").exists()


def test_bad_backend_and_passthrough_are_one_line_errors(tmp_path):
    for args, needle in [(["--backend", "k8s"], "--backend 'k8s': use slurm or local"),
                         (["--backend", "slurm", "--dry-run", "--slurm", "=1"], "expected KEY=VALUE"),
                         (["--backend", "slurm", "--dry-run", "--time", "soon"], "--time 'soon'")]:
        out = subprocess.run([sys.executable, "-m", "ogrpo", "submit", "--config", "tiny", *args],
                             capture_output=True, text=True)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and needle in out.stderr, out.stderr


# -- ports of a Slurm job --------------------------------------------------------------------------------------


def test_slurm_ports_are_below_the_ephemeral_range_and_distinct():
    from ogrpo.launch import ports as pt

    seen = {}
    for job_id in range(1, 7334):  # any 7333 consecutive ids (SLURM_SLOTS): no two jobs share a port
        ports = pt.slurm_ports(job_id)
        assert all(10000 <= p < 32768 for p in ports.values()), (job_id, ports)
        for p in ports.values():
            assert p not in seen, (job_id, seen.get(p))
            seen[p] = job_id
    # the old rule (20000 + id % 10000 * 3) gave ids 10000 apart the same ports; neighbours are spread out
    assert pt.slurm_ports(123)["server"] != pt.slurm_ports(10123)["server"]
    assert abs(pt.slurm_ports(124)["server"] - pt.slurm_ports(123)["server"]) > 100


def test_taken_ports_are_skipped_and_claims_released(tmp_path, monkeypatch):
    import socket

    from ogrpo.launch import ports as pt

    monkeypatch.setattr(pt, "LOCK_DIR", tmp_path / "locks")
    job_id = 4242
    first = pt.slurm_ports(job_id)
    with socket.socket() as s:  # something else listens on the job's rendezvous port
        s.bind(("", first["rendezvous"]))
        s.listen()
        got = pt.pick_slurm_ports(job_id)
    assert got == pt.slot_ports(pt.slurm_slot(job_id) + 1) and first["rendezvous"] not in got.values()
    # claimed for this process: a second job that lands on the same slot at the same moment moves on
    again = pt.pick_slurm_ports(job_id, is_free=lambda p: True)
    assert again == first and not set(again.values()) & set(got.values())
    pt.release_ports([*got.values(), *again.values()])
    assert not list((tmp_path / "locks").iterdir())
    # recorded ports of an earlier attempt come first while free
    rec = {"server": 20101, "rendezvous": 20102, "group": 20103}
    assert pt.pick_slurm_ports(job_id, rec, is_free=lambda p: True) == rec
    assert pt.pick_slurm_ports(job_id, rec, is_free=lambda p: p != 20102) == pt.slurm_ports(job_id)


def test_node_addr_is_what_slurm_knows(tmp_path, monkeypatch):
    _tool(tmp_path, "scontrol", 'echo "NodeName=gpu07 Arch=x86_64 CoresPerSocket=32 NodeAddr=10.3.0.7 '
                                'NodeHostName=gpu07 Version=22.05.8"')
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert sl.node_addr("gpu07") == "10.3.0.7"
    _tool(tmp_path, "scontrol", "exit 1")  # not known: the node name itself
    assert sl.node_addr("gpu07") == "gpu07"


# -- host memory per step ----------------------------------------------------------------------------------------


def _plan(gpus, model="Qwen/Qwen2.5-1.5B-Instruct", **ogrpo):
    from ogrpo.config import load_run_config
    from ogrpo.plan import plan_from_config

    rc = load_run_config("slurm/examples/recipes/qwen2.5-1.5b-math.yaml", {"ogrpo": ogrpo} if ogrpo else None)
    return plan_from_config(rc, gpus=gpus, model=model).to_dict()


def test_host_memory_counts_offload_and_the_load_dtype():
    import copy

    from ogrpo.planner import host_memory as hm
    from ogrpo.planner.types import Plan

    P = 1543714304  # Qwen2.5-1.5B parameters
    GiB = 2**30
    ddp = _plan("3xA40")
    assert ddp["trainer"]["strategy"] == "ddp" and ddp["trainer"]["num_processes"] == 2
    ddp["trainer_args"]["model_init_kwargs"]["dtype"] = "float32"
    # two DDP processes, each loading fp32 weights (4·P) on the host; the server: 4 + 2 per GPU + bf16 weights;
    # +10 %, rounded up
    assert hm.step_host_gib(Plan.from_dict(ddp)) == {"trainer": float(-(-(2 * (3 + 4 * P / GiB)) * 1.1 // 1)),
                                     "server": float(-(-(4 + 2 + 2 * P / GiB) * 1.1 // 1))}
    offload = _plan("3xA40", strategy="zero3_offload")
    assert offload["trainer"]["strategy"] == "zero3_offload"
    assert offload["trainer_args"]["model_init_kwargs"]["dtype"] == "bfloat16"
    # per process: runtime 3 GiB + its ZeRO-3 shard of the bf16 weights (2·P/2) + what DeepSpeed 0.19.8 keeps on
    # the host once the optimizer is offloaded (the trainer estimate's host_terms): fp32 master weights and Adam
    # moments (12·P/2), fp32 gradients (4·P/2) and the half gradient partition (2·P/2), pinned in host RAM
    host = offload["trainer"]["memory_terms"]["host_terms"]
    assert sum(host.values()) == pytest.approx(18 * P / 2 / GiB, abs=0.01)
    want = -(-(2 * (3 + 2 * P / 2 / GiB + sum(host.values()))) * 1.1 // 1)
    assert hm.step_host_gib(Plan.from_dict(offload))["trainer"] == want > hm.step_host_gib(Plan.from_dict(ddp))["trainer"]
    # one-step under ZeRO-3: rank 0 also holds the push's host copy of the full weights (bf16 plan: 2·P)
    one_step = copy.deepcopy(offload)
    one_step["settings"] = [s for s in one_step["settings"] if s["name"] != "overlap"]
    one_step["settings"].append({"name": "overlap", "value": "one-step", "reason": "test"})
    assert one_step["precision"] == "bf16"
    want = -(-(2 * (3 + 2 * P / 2 / GiB + sum(host.values())) + 2 * P / GiB) * 1.1 // 1)
    assert hm.step_host_gib(Plan.from_dict(one_step))["trainer"] == want


def test_a_control_character_in_an_sbatch_value_is_refused():
    """`--slurm KEY=VALUE` on the command line, or SlurmOptions built by a program: a line break would end the
    `#SBATCH` line and run the rest as a command of the batch script."""
    with pytest.raises(OgrpoError, match=r"--slurm mem=1\\necho x: the value holds a control character"):
        sl.parse_passthrough(["mem=1\necho x"])
    for opts in (sl.SlurmOptions(job_name="a\necho x"), sl.SlurmOptions(partition="gpu\r"),
                 sl.SlurmOptions(extra={"constraint": "a40\x00"})):
        with pytest.raises(OgrpoError, match="holds a control character"):
            sbatch_lines(spec(), opts)
