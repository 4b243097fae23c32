"""A login node as users meet it: no Slurm on PATH, a controller that cannot be reached, a SLURM_CONF naming no file,
and a job-id index shared by two clusters. Every answer is one line (exit 2), never a traceback, and nothing acts
on another cluster's job.

The unreachable controller is real Slurm's client talking to a slurm.conf whose ports nothing listens on
(MessageTimeout=1 bounds its retries: squeue then fails within the 2 s after which slurm_cli probes a slow
command, which is where "job 123 is not known" came from); the other tests use stand-in tools on PATH."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

OGRPO = [sys.executable, "-m", "ogrpo"]


def _ogrpo(*args, env, cwd=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([*OGRPO, *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)


def _one_line(proc: subprocess.CompletedProcess) -> str:
    text = proc.stderr.strip()
    assert "Traceback" not in text and text.count("\n") == 0, text
    return text


def _tool(directory: Path, name: str, body: str) -> None:
    p = directory / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def bare_env(tmp_path):
    """PATH without any Slurm command (nor anything else: the tests run python by its absolute path)."""
    empty = tmp_path / "bin"
    empty.mkdir()
    return {**os.environ, "PATH": str(empty), "XDG_CACHE_HOME": str(tmp_path / "cache")}


def test_no_slurm_installed_status_logs_cancel_are_one_line(bare_env):
    runs = {cmd: subprocess.Popen([*OGRPO, *cmd.split()], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=bare_env)
            for cmd in ("status 123", "status 123 --json", "logs 123", "cancel 123")}
    for cmd, proc in runs.items():
        out, err = proc.communicate(timeout=120)
        line = _one_line(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
        assert proc.returncode == 2, (cmd, err)
        assert "Slurm is not installed here: no sacct on PATH" in line, (cmd, line)
        if cmd.endswith("--json"):
            assert json.loads(out) == {"errors": [line.removeprefix("error: ")], "exit_code": 2}


def test_sweep_of_a_gpu_plan_without_sbatch_is_refused_as_submit_refuses(bare_env, tmp_path):
    # sweep used to run the A40 points here (vLLM and the trainer on a login node); the rule is submit's
    sweep = _ogrpo("sweep", "--gpus", "3xA40", "--config", "tiny", "--seeds", "2", "-o", tmp_path / "sw",
                   env=bare_env)
    submit = _ogrpo("submit", "--gpus", "3xA40", "--config", "tiny", "-o", tmp_path / "job", env=bare_env)
    assert sweep.returncode == submit.returncode == 2, (sweep.stderr, submit.stderr)
    assert _one_line(sweep) == _one_line(submit) and "no Slurm here (`sbatch` is not on PATH)" in sweep.stderr
    assert not (tmp_path / "sw").exists() and not (tmp_path / "job").exists()


def test_no_slurm_configuration_is_named_not_the_job(tmp_path):
    """Slurm's commands installed, but no SLURM_CONF, no /etc/slurm/slurm.conf and no configless controller (the
    real client's DNS SRV lookup fails at once): the line says so, it does not call job 123 unknown."""
    if shutil.which("squeue") is None or shutil.which("sacct") is None:
        pytest.skip("Slurm's client commands are not installed")
    if os.path.isfile("/etc/slurm/slurm.conf"):
        pytest.skip("this machine has a default slurm.conf")
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    for cmd in ("status 123", "cancel 123"):
        proc = _ogrpo(*cmd.split(), env=env)
        line = _one_line(proc)
        assert proc.returncode == 2 and "no Slurm configuration here (no SLURM_CONF" in line, (cmd, line)
        assert "not known" not in line


# -- a controller that cannot be reached ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dead_cluster(tmp_path_factory):
    """SLURM_CONF of a cluster whose controller and slurmdbd do not listen: the test cluster's shape
    (tests/slurm/cluster.sh), ports nobody has, Slurm's retries bounded to 1 s."""
    if shutil.which("squeue") is None or shutil.which("scontrol") is None:
        pytest.skip("Slurm's client commands are not installed")
    port = _free_port()
    conf = tmp_path_factory.mktemp("dead") / "slurm.conf"
    conf.write_text(f"ClusterName=dead\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort={port}\n"
                    "AuthType=auth/munge\nAccountingStorageType=accounting_storage/slurmdbd\n"
                    f"AccountingStorageHost=localhost\nAccountingStoragePort={_free_port()}\nMessageTimeout=1\n"
                    "KillWait=5\nNodeName=localhost CPUs=2 State=UNKNOWN\n"
                    "PartitionName=debug Nodes=localhost Default=YES\n")
    return {**os.environ, "SLURM_CONF": str(conf), "XDG_CACHE_HOME": str(conf.parent / "cache")}


def test_unreachable_controller_is_named_not_the_job(dead_cluster):
    runs = {cmd: subprocess.Popen([*OGRPO, *cmd.split()], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=dead_cluster)
            for cmd in ("status 123", "status 123 --json", "cancel 123")}
    for cmd, proc in runs.items():
        out, err = proc.communicate(timeout=120)
        line = _one_line(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
        assert proc.returncode == 2, (cmd, err)
        assert "cannot reach the Slurm controller" in line and "not known" not in line, (cmd, line)
        if cmd.endswith("--json"):
            assert json.loads(out)["errors"] == [line.removeprefix("error: ")]


def test_render_says_killwait_could_not_be_read_and_what_it_assumed(dead_cluster, tmp_path):
    # a reachable controller with KillWait 5 s changes save_steps 10 -> 1 (tests/test_grace.py); this one cannot
    # say, and render used to keep 10 without a word
    out = _ogrpo("render", "--gpus", "2xcpu", "--config", "tiny", "-o", tmp_path / "job", env=dead_cluster)
    assert out.returncode == 0, out.stderr
    warning = next(ln for ln in out.stderr.splitlines() if "KillWait could not be read" in ln)
    assert "cannot reach the Slurm controller" in warning and "save_steps stays 10" in warning
    import yaml

    assert yaml.safe_load((tmp_path / "job" / "run.yaml").read_text())["save_steps"] == 10
    manifest = json.loads((tmp_path / "job" / "manifest.json").read_text())
    assert any("KillWait could not be read" in w for w in manifest["warnings"])


def test_doctor_says_what_is_wrong_with_a_missing_slurm_conf(tmp_path, monkeypatch, capsys):
    from ogrpo.checks import doctor

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in doctor.SLURM_COMMANDS:
        _tool(bin_dir, tool, "exit 0")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "nowhere" / "slurm.conf"))
    report = doctor.run_checks(patches=False)
    assert report["slurm_client"] and "does not exist" in report["slurm_problem"]
    doctor.print_report(report)
    rows = [ln for ln in capsys.readouterr().out.splitlines() if "Slurm" in ln]
    assert rows and "yes" not in rows[0] and any("SLURM_CONF=" in ln for ln in rows), rows


# -- job ids are per cluster -----------------------------------------------------------------------------------


@pytest.fixture
def cluster_ci(tmp_path):
    """Stand-in Slurm of cluster `ci`: scontrol names it, sacct has no accounting (fails), squeue knows no job,
    scancel records any call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir, "scontrol", 'case "$*" in "show config") echo "ClusterName             = ci"; '
                               'echo "SlurmctldHost[0]        = head(10.0.0.1)";; *) exit 1;; esac')
    _tool(bin_dir, "sacct", 'echo "sacct: error: no accounting" >&2; exit 1')
    _tool(bin_dir, "squeue", "exit 0")
    _tool(bin_dir, "scancel", f'echo "$*" >> {tmp_path}/scancel.log')
    runs = {}
    for name in ("old", "mine"):
        d = tmp_path / name
        (d / "logs").mkdir(parents=True)
        (d / "logs" / "slurm-8.out").write_text(f"log of the {name} run\n")
        runs[name] = d
    cache = tmp_path / "cache"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "XDG_CACHE_HOME": str(cache)}
    index = cache / "ogrpo" / "slurm-jobs.jsonl"
    index.parent.mkdir(parents=True)
    return env, index, runs, tmp_path / "scancel.log"


def _entry(job_dir, **cluster) -> str:
    return json.dumps({"job_id": "8", "job_dir": str(job_dir), **cluster}) + "\n"


def test_a_job_id_resolves_within_this_cluster_only(cluster_ci):
    env, index, runs, scancel = cluster_ci
    # job 8 of this cluster, then (later) job 8 of another cluster: the latter used to win
    index.write_text(_entry(runs["mine"], cluster="ci", controller="head(10.0.0.1)")
                     + _entry(runs["old"], cluster="other", controller="ctl(10.9.9.9)"))
    out = _ogrpo("logs", "8", "--role", "supervisor", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "log of the mine run"

    index.write_text(_entry(runs["old"], cluster="other", controller="ctl(10.9.9.9)"))
    for cmd in ("logs", "status", "cancel"):
        proc = _ogrpo(cmd, "8", env=env)
        line = _one_line(proc)
        assert proc.returncode == 2 and "log of the old run" not in proc.stdout, (cmd, proc.stdout, line)
        assert "job 8 was submitted to cluster other (controller ctl(10.9.9.9)), not to this one (cluster ci" in line
        assert str(runs["old"]) in line  # what to pass instead
    assert not scancel.exists()  # cancel never acted


def test_submit_records_the_cluster_with_the_job(cluster_ci, monkeypatch):
    from ogrpo.launch.slurm import query as slurm_query

    env, index, runs, _ = cluster_ci
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("XDG_CACHE_HOME", env["XDG_CACHE_HOME"])
    slurm_query.remember("8", runs["mine"])
    rec = json.loads(index.read_text().splitlines()[-1])
    assert rec == {"job_id": "8", "job_dir": str(runs["mine"].resolve()), "cluster": "ci",
                   "controller": "head(10.0.0.1)"}
