"""`ogrpo sweep` on the test cluster: one job array over both nodes of partition `two`, each task a point's whole
job (server and trainer steps under the point's own supervisor), with the steps' processes replaced by the
stand-ins of tests/sweep_steps.py so that a point takes seconds. The plans are CPU plans (`2xcpu`, server on one
device, trainer on the other): a task asks for 2 CPUs, so the two nodes could run every task at once and
`--max-parallel 2` is what holds them to two.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import sweep_steps
from toy_recipe import toy_recipe

from .conftest import read_json, sacct_state, wait_for

pytestmark = pytest.mark.slurm

LRS, BETAS = (1e-3, 2e-3), (0, 0.04)


@pytest.fixture(scope="module")
def two_nodes(slurm_cluster):
    out = subprocess.run(["sinfo", "-h", "-p", "two", "-N", "-o", "%N"], capture_output=True, text=True)
    if len(set(out.stdout.split())) < 2:
        pytest.skip("no partition `two` with two nodes: cluster.sh brings up node2 only as root with `ip netns`")


def start_sweep(tmp_path: Path, steps: int, step_s: float) -> tuple[Path, dict, dict]:
    cfg = tmp_path / "toy.yaml"
    cfg.write_text(toy_recipe(steps, save_steps=1, use_vllm=True, vllm_gpus=1))
    sweep = tmp_path / "sweep"
    env = {**sweep_steps.env(), "SWEEP_TOY_STEP_S": str(step_s), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-m", "ogrpo", "sweep", "--gpus", "2xcpu", "--config", str(cfg),
                          "--grid", f"learning_rate={LRS[0]},{LRS[1]}", "--grid", f"beta={BETAS[0]},{BETAS[1]}",
                          "--max-parallel", "2", "--partition", "two", "--time", "10", "-o", str(sweep)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((sweep / "sweep.json").read_text())
    assert f"submitted job array {data['slurm']['array_job_id']}: 4 tasks, at most 2 at once" in out.stdout
    return sweep, data, env


def tasks(array: str, state: str) -> list[tuple[str, str]]:
    """(task id, reason) of the array's tasks in STATE, one row per task (-r)."""
    out = subprocess.run(["squeue", "-h", "-r", "-j", array, "-t", state, "-o", "%i|%r"], capture_output=True,
                         text=True)
    return [tuple(ln.split("|")) for ln in out.stdout.splitlines() if "|" in ln]


def toy(sweep: Path, i: int) -> dict:
    try:
        return read_json(sweep / "points" / str(i) / "run" / "toy_ckpt.json")
    except (OSError, ValueError):
        return {"step": 0, "attempts": []}


def ogrpo(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ogrpo", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def sweep_processes(sweep: Path, array: str) -> list[psutil.Process]:
    """Every live process of the sweep on this machine (both nodes share its kernel): those whose environment
    names the array (batch steps, srun clients, step wrappers, stand-ins) or whose command names the sweep."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            env = p.environ()
            if (env.get("SLURM_ARRAY_JOB_ID") == array and env.get("SLURM_CONF") == os.environ["SLURM_CONF"]) or \
                    str(sweep) in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_four_points_two_at_a_time_each_its_own_job_and_a_requeue_resumes_one(two_nodes, tmp_path):
    steps = 12
    sweep, data, env = start_sweep(tmp_path, steps, step_s=1.0)
    array = data["slurm"]["array_job_id"]
    most, limited, requeued, summarized_early = 0, False, None, False
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        running = tasks(array, "RUNNING")
        pending = tasks(array, "PENDING")
        if not running and not pending and not tasks(array, "COMPLETING"):
            break
        most = max(most, len(running))
        limited |= any(reason == "JobArrayTaskLimit" for _, reason in pending)
        # a task that starts after a point ended refreshes the summary: before the array's end, with that point
        summary = sweep / "summary.csv"
        summarized_early |= summary.exists() and ",COMPLETED," in summary.read_text()
        if requeued is None:
            # requeue the first task whose trainer is a few steps in: only that point may start again
            for task, _ in running:
                i = int(task.split("_")[1])
                if toy(sweep, i)["step"] >= 3:
                    subprocess.run(["scontrol", "requeue", task], check=True)
                    requeued = i
                    break
        time.sleep(0.5)
    else:
        queue = subprocess.run(["squeue", "-r", "-j", array], capture_output=True, text=True).stdout
        raise AssertionError(f"the sweep still runs after 300 s:\n{queue}")
    assert requeued is not None, "no task ran 3 steps while watched"
    # at most two at once, and two did run at once: the array's limit, not the cluster's size, held them
    assert most == 2 and limited, (most, limited)
    assert summarized_early
    spans = [(a["t0"], a["t1"]) for i in range(4) for a in toy(sweep, i)["attempts"]]
    assert max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans) <= 2, spans

    ports, job_ids = [], set()
    for i, entry in enumerate(data["points"]):
        pdir = sweep / "points" / str(i)
        logs = "".join(f.read_text()[-1500:] for f in (pdir / "logs").glob("slurm-*_*.out"))
        assert sacct_state(f"{array}_{i}") == "COMPLETED", logs
        state = toy(sweep, i)
        assert state["step"] == steps
        # its own run directory, with its own config: reward 0.2 + (lr * 10 + beta) * step (tests/sweep_steps.py)
        lr, beta = entry["values"]["learning_rate"], entry["values"]["beta"]
        first = json.loads((pdir / "run" / "metrics.jsonl").read_text().splitlines()[0])
        assert first["reward"] == pytest.approx(0.2 + lr * 10 + beta)
        # its own ports (run/ports.json, the same the steps were given) and its own job id
        rec = read_json(pdir / "run" / "ports.json")
        ports += [rec["server"], rec["rendezvous"], rec["group"]]
        assert state["attempts"][-1]["rendezvous_port"] == rec["rendezvous"]
        assert state["attempts"][-1]["vllm_url"].endswith(f":{rec['server']}")
        served = [read_json(p)["port"] for p in (pdir / "stand-ins").glob("server-*.json")]
        assert served and set(served) == {rec["server"]}
        job_ids.add((pdir / "slurm" / "job_id").read_text().strip())
        # the supervisor's log is the task's log, found under the task's own job id
        assert "ogrpo supervisor" in (pdir / "logs" / f"slurm-{rec['job_id']}.out").read_text()
        if i == requeued:  # resumed from its checkpoint, in the same task
            assert len(state["attempts"]) == 2 and state["attempts"][1]["start"] > 0, state
            assert state["attempts"][1]["restart_count"] == 1
        else:
            assert len(state["attempts"]) == 1 and state["attempts"][0]["restart_count"] == 0, (i, state)
    assert len(set(ports)) == 12 and len(job_ids) == 4

    status = json.loads(ogrpo("status", str(sweep), "--json", env=env).stdout)
    assert [(r["state"], r["step"], r["requeues"]) for r in status["points"]] == [
        ("COMPLETED", steps, 1 if i == requeued else 0) for i in range(4)]
    table = ogrpo("status", data["id"], env=env).stdout  # by the sweep's id
    assert table.splitlines()[1].split() == ["point", "learning_rate", "beta", "seed", "state", "step", "reward",
                                             "requeues"], table
    # the summary job ran after the array and wrote the summary
    summary_job = data["slurm"]["summary_job_id"]
    wait_for(lambda: sacct_state(summary_job, timeout=5) == "COMPLETED", 120, "the summary job")
    assert "wrote" in next((sweep / "logs").glob("summary-*.out")).read_text()
    rows = (sweep / "summary.csv").read_text().splitlines()
    assert len(rows) == 5 and all(",COMPLETED," in r for r in rows[1:])
    assert not sweep_processes(sweep, array)


def test_cancel_stops_every_task_and_leaves_no_process(two_nodes, tmp_path):
    sweep, data, env = start_sweep(tmp_path, steps=600, step_s=0.5)
    array = data["slurm"]["array_job_id"]
    wait_for(lambda: sum(1 for i in range(4) if toy(sweep, i)["attempts"]) == 2, 180, "two trainers running")
    running = [i for i in range(4) if toy(sweep, i)["attempts"]]
    before = sweep_processes(sweep, array)
    # per running point: batch step (supervisor), srun clients, step wrappers, server and trainer stand-ins
    assert len(before) >= 2 * 5, [p.cmdline() for p in before]
    out = ogrpo("cancel", data["id"], env=env)
    assert out.returncode == 0, out.stderr
    assert f"cancelled sweep {data['id']}: no process of it is left" in out.stdout
    # the moment it returns: nothing of the sweep on this machine, on either node
    left = sweep_processes(sweep, array)
    assert not left, [(p.pid, p.cmdline()) for p in left]
    assert not tasks(array, "PENDING,RUNNING,COMPLETING,REQUEUED,SUSPENDED")
    # every task CANCELLED; the pending ones as one row of the array's range (sacct names them 9_[2-3%2]).
    # sacct reads slurmdbd, which gets the tasks' start and end records from slurmctld asynchronously: on a loaded
    # machine it may still show the whole array as one pending row for a while after the cancel.
    def accounted() -> dict:
        out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", array, "-o", "JobID,State"], capture_output=True,
                             text=True).stdout
        return dict(ln.split("|") for ln in out.splitlines())

    def settled() -> bool:
        rows = accounted()
        return bool(rows) and {f"{array}_{i}" for i in running} <= set(rows) and all(
            s.startswith("CANCELLED") for s in rows.values())

    try:
        wait_for(settled, 120, "sacct to account every task as cancelled")
    except AssertionError as e:
        raise AssertionError(f"{e}: {accounted()}, running {running}") from None
    for i in set(range(4)) - set(running):
        assert not toy(sweep, i)["attempts"]  # pending tasks never started
    rows = json.loads(ogrpo("status", str(sweep), "--json", env=env).stdout)["points"]
    assert [r["state"] for r in rows] == ["CANCELLED"] * 4
    for i in running:
        assert read_json(sweep / "points" / str(i) / "run" / "manifest.json")["status"] == "cancelled"
