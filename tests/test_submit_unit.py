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


def test_executor_parameters_and_sbatch_text():
    opts = sl.SlurmOptions(partition="gpu", time_min=120, account="lab", qos="high", gpus_per_node=3,
                           cpus_per_task=24, extra={"mem": "64G", "requeue": True}, signal_delay_s=10)
    params = sl.executor_parameters(spec(), opts)
    assert params["use_srun"] is False and params["nodes"] == 1 and params["gpus_per_node"] == 3
    # the warning goes to the batch step only, never earlier than Slurm's 30 s check interval allows
    assert params["signal_delay_s"] == 30 and params["additional_parameters"]["signal"] == "B:USR2@30"
    text = sl.sbatch_text(spec(), opts, "/jobs/a/submitit")
    for line in ["#SBATCH --partition=gpu", "#SBATCH --time=120", "#SBATCH --account=lab", "#SBATCH --qos=high",
                 "#SBATCH --gpus-per-node=3", "#SBATCH --cpus-per-task=24", "#SBATCH --mem=64G",
                 "#SBATCH --requeue", "#SBATCH --signal=B:USR2@30", "#SBATCH --chdir=/jobs/a",
                 "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1"]:
        assert line in text.splitlines(), line
    # python replaces the batch shell so that the B: signal reaches submitit's handler
    assert f"exec {sys.executable} -u -m submitit.core._submit /jobs/a/submitit" in text
    assert "srun" not in text  # steps are started by the supervisor, not by the script


def test_passthrough_replaces_rather_than_duplicates():
    opts = sl.SlurmOptions(gpus_per_node=3, cpus_per_task=24,
                           extra={"cpus-per-task": "8", "time": "01:00:00", "gres": "gpu:a40:3", "constraint": "ib"})
    text = sl.sbatch_text(spec(), opts, "/jobs/a/submitit").splitlines()
    assert "#SBATCH --cpus-per-task=8" in text and "#SBATCH --time=60" in text
    assert "#SBATCH --gres=gpu:a40:3" in text and "#SBATCH --constraint=ib" in text
    for flag in ("--cpus-per-task", "--time", "--gpus-per-node"):
        assert sum(line.startswith(f"#SBATCH {flag}") for line in text) == (0 if flag == "--gpus-per-node" else 1)


def test_step_resources_split_shared_nodes():
    steps = spec().steps
    # 1 server GPU, 2 trainer GPUs on one 24-CPU node: 8 + 16 CPUs, memory likewise
    assert sl.step_resources(steps, 24, 96000) == {"server": (8, 32000), "trainer": (16, 64000)}
    # never zero, even on a 2-CPU test node
    assert sl.step_resources(steps, 2, None) == {"server": (1, None), "trainer": (1, None)}
    # steps on different nodes do not share
    assert sl.step_resources(spec(nodes_trainer=(1, 2)).steps, 24, None) == {"server": (24, None),
                                                                             "trainer": (24, None)}


def test_srun_lines_multi_node():
    s = spec(nodes_trainer=(1, 2))
    hosts = ["n0", "n1", "n2"]
    values = sl.placeholder_values(s, hosts, job_id=1234)
    assert values == {"server_host": "n0", "server_port": 23702, "rendezvous_host": "n1",
                      "rendezvous_port": 23703, "job_dir": "/jobs/a"}
    trainer = sl.srun_argv(s.steps[1], job_dir="/jobs/a", hosts=hosts, values=values, cpus=8, mem_mb=1000)
    cut = trainer.index("--")
    assert trainer[:cut][:3] == ["srun", "--exact", "--job-name=trainer"]
    for opt in ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=n1,n2", "--gres=gpu:2",
                "--cpus-per-task=8", "--mem=1000M", "--unbuffered", "--kill-on-bad-exit=1"]:
        assert opt in trainer[:cut], opt
    # {node_rank} stays for the wrapper inside each task; the rest is filled
    assert trainer[cut + 1:] == ["accelerate", "launch", "--machine_rank", "{node_rank}", "--main_process_ip", "n1",
                                 "--main_process_port", "23703", "--output-dir", "/jobs/a/run"]
    server = sl.srun_argv(s.steps[0], job_dir="/jobs/a", hosts=hosts, values=values, cpus=8, mem_mb=None)
    assert "--gres=gpu:1" in server and "--nodelist=n0" in server and server[-2:] == ["--port", "23702"]


def test_cpu_steps_ask_for_no_gpus():
    s = JobSpec(name="c", job_dir="/j", steps=[Step("trainer", [0], [], 1, ["true"])])
    argv = sl.srun_argv(s.steps[0], job_dir="/j", hosts=["h"], values={}, cpus=2, mem_mb=None)
    assert "--gres=none" in argv


def test_supervisor_pickles_without_processes():
    import pickle

    sup = sl.SlurmSupervisor(spec(), sl.SlurmOptions(max_requeues=2))
    sup._sup = lambda: None  # stands for the running Supervisor (open files, processes): not picklable
    sup._preempting = True
    back = pickle.loads(pickle.dumps(sup))
    assert back._sup is None and not back._preempting
    assert back.opts.max_requeues == 2 and back.spec.steps[1].role == "trainer"


# -- pre-submit checks against stand-in tools -----------------------------------------------------------------


def _tool(directory, name, body):
    p = directory / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """sinfo: partitions debug* and gpu, nodes with 3 A40s and 16 CPUs; sacctmgr: account lab;
    sbatch --test-only: logs its arguments, fails when asked for more than 3 GPUs per node."""
    log = tmp_path / "sbatch.log"
    _tool(tmp_path, "sinfo", 'case "$*" in *%P*) echo "debug*"; echo gpu;; *%G*) echo "gpu:a40:3(S:0)";; '
                             '*%c*) echo 16;; esac')
    _tool(tmp_path, "sacctmgr", "echo lab")
    _tool(tmp_path, "sbatch", f'echo "$*" >> {log}; case "$*" in *gpus-per-node=[4-9]*) '
                              'echo "sbatch: error: Requested node configuration is not available" >&2; exit 1;; esac')
    for t in ("srun", "squeue"):
        _tool(tmp_path, t, "exit 0")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    return log


def test_preflight_accepts_and_fills_cpus(fake_slurm):
    opts = sl.SlurmOptions(partition="gpu", account="lab", gpus_per_node=3)
    params = sl.preflight(spec(), opts)
    assert params["cpus_per_task"] == 12  # 4 per GPU, within the 16 the nodes have
    assert "--test-only --partition=gpu --account=lab" in fake_slurm.read_text()
    assert "--gpus-per-node=3" in fake_slurm.read_text()


@pytest.mark.parametrize("opts,match", [
    (dict(partition="nope"), "unknown partition 'nope': use one of debug, gpu"),
    (dict(account="other"), "unknown account 'other' for this user: use one of lab"),
    (dict(gpus_per_node=4), "4 GPUs per node requested but nodes of this cluster have at most 3"),
])
def test_preflight_rejects(fake_slurm, opts, match):
    with pytest.raises(OgrpoError, match=match):
        sl.preflight(spec(), sl.SlurmOptions(**opts))
    assert not fake_slurm.exists()  # refused before even asking sbatch


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


# -- what `ogrpo render` writes and what `ogrpo submit` sends describe the same job ----------------------------

BASH_VARS = {'"$JOB_DIR': '"{job_dir}', "$JOB_DIR": "{job_dir}", "$SERVER_HOST": "{server_host}",
             "$SERVER_PORT": "{server_port}", "$RENDEZVOUS_HOST": "{rendezvous_host}",
             "$RENDEZVOUS_PORT": "{rendezvous_port}"}


def rendered_steps(sbatch: str) -> dict[str, dict]:
    """role → {nodes, gpus, argv} from the srun lines of a rendered job.sbatch (bash variables back to the
    JobSpec placeholders)."""
    import shlex

    text = sbatch.replace("\\\n", " ")
    steps = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("srun "):
            continue
        for var, ph in BASH_VARS.items():
            line = line.replace(var, ph)
        tokens = shlex.split(line.rstrip("&").strip())
        opts = {}
        i = 1
        while tokens[i].startswith("--"):
            key, _, value = tokens[i][2:].partition("=")
            opts[key] = value
            i += 1
        if tokens[i] == "env":
            i += 1
            while "=" in tokens[i]:
                i += 1
        role = opts["output"].rsplit("/", 1)[-1].removesuffix(".log")
        gres = opts.get("gres", "gpu:0")
        steps[role] = {"nodes": int(opts["nodes"]), "gpus": int(gres.split(":")[-1]), "argv": tokens[i:]}
    return steps


def submitted_steps(commands: dict[str, list[str]]) -> dict[str, dict]:
    out = {}
    for role, argv in commands.items():
        cut = argv.index("--")
        opts = dict(a[2:].partition("=")[::2] for a in argv[:cut] if a.startswith("--"))
        gres = opts.get("gres", "none")
        # the command after the per-step wrapper (python -m ogrpo.launch.slurm step ... --)
        out[role] = {"nodes": int(opts["nodes"]), "gpus": 0 if gres == "none" else int(gres.split(":")[-1]),
                     "argv": argv[cut + 1:]}
    return out


def test_render_and_submit_describe_the_same_job(tmp_path):
    from ogrpo.config import load_run_config
    from ogrpo.jobspec import build_jobspec, fill
    from ogrpo.plan import plan_from_config
    from ogrpo.render import job_sbatch

    cfg = tmp_path / "run.yaml"
    cfg.write_text("model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct\ndataset_name: trl-lib/tldr\n"
                   "reward_funcs: [accuracy]\nogrpo:\n  partition: gpu\n  time: '02:00:00'\n  account: lab\n")
    rc = load_run_config(str(cfg), {"ogrpo": {"gpus": "3xA40"}})
    plan = plan_from_config(rc)
    job_dir = str(tmp_path / "job")
    spec = build_jobspec(plan, rc, job_dir)
    rendered = job_sbatch(plan, rc, spec)
    opts = sl.options_for(plan.to_dict(), rc)
    sup = sl.SlurmSupervisor(spec, opts)
    hosts = ["node-a"]
    values = sl.placeholder_values(spec, hosts, job_id=77)
    sent = submitted_steps(sup.commands(hosts, 77, 24, None))
    expected = {role: {**st, "argv": fill(st["argv"], values)} for role, st in rendered_steps(rendered).items()}
    assert sent == expected
    assert set(sent) == {"server", "trainer"} and sent["server"]["gpus"] + sent["trainer"]["gpus"] == 3
    # the allocation: same nodes, GPUs per node, partition, account and time limit
    header = sl.sbatch_text(spec, opts, f"{job_dir}/submitit").splitlines()
    for rendered_line, sent_line in [("#SBATCH --nodes=1", "#SBATCH --nodes=1"),
                                     ("#SBATCH --gres=gpu:3", "#SBATCH --gpus-per-node=3"),
                                     ("#SBATCH --partition=gpu", "#SBATCH --partition=gpu"),
                                     ("#SBATCH --account=lab", "#SBATCH --account=lab"),
                                     ("#SBATCH --time=02:00:00", "#SBATCH --time=120")]:
        assert rendered_line in rendered.splitlines(), rendered_line
        assert sent_line in header, sent_line


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
