"""`ogrpo sweep` without a cluster: the grid and its errors, every point planned like `ogrpo submit` (all fit, or
exit 3 naming those that do not), the sweep directory and job array a dry run writes, what `ogrpo sweep` hands
sbatch (stand-in Slurm tools), and a local sweep run end to end with stand-in steps (tests/sweep_steps.py), its
status, summary, cancel and `ogrpo reproduce`. The real job array runs in tests/slurm/test_slurm_sweep.py."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import sweep_steps
from toy_recipe import toy_recipe
from ogrpo.errors import OgrpoError
from ogrpo.sweep import grid as g

OGRPO = [sys.executable, "-m", "ogrpo"]


def run(*args, env=None, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([*OGRPO, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """Stand-in Slurm tools first on PATH: sinfo (partition debug, nodes with 3 A40s, 16 CPUs, 64000 MB),
    sacctmgr; sbatch logs its arguments (SBATCH_LOG), and with --parsable FILE keeps a copy of FILE (what Slurm
    would run) and prints job id 4242."""
    bin_dir, log = tmp_path / "bin", tmp_path / "sbatch.log"
    bin_dir.mkdir()
    tools = {
        "sinfo": 'case "$*" in *"%P %G"*) echo "debug* gpu:a40:3(S:0)";; *%P*) echo "debug*";; '
                 '*%G*) echo "gpu:a40:3(S:0)";; *%c*) echo 16;; *%m*) echo 64000;; esac',
        "sacctmgr": "echo lab",
        "sbatch": f'echo "$*" >> {log}; if [ "$1" = --parsable ] && [ -f "$2" ]; then '
                  f'cp "$2" {tmp_path}/submitted.sbatch; fi; if [ "$1" = --parsable ]; then echo 4242; fi',
        "srun": "exit 0", "squeue": "exit 0", "scontrol": "exit 1",  # no cluster timing: the defaults
    }
    for name, body in tools.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the job and sweep indexes
    return log


# -- the grid ------------------------------------------------------------------------------------------------


def test_grid_values_are_typed_and_points_are_every_combination_times_seeds():
    grid = g.parse_grid(["learning_rate=1e-6,3e-6", "beta=0,0.04", "ogrpo.use_vllm=true,false"])
    # 1e-6 is a float here (PyYAML alone reads it as a string), 0 an int, true a bool
    assert grid == {"learning_rate": [1e-6, 3e-6], "beta": [0, 0.04], "ogrpo.use_vllm": [True, False]}
    points = g.expand(grid, seeds=2, base_seed=42)
    assert len(points) == 2 * 2 * 2 * 2
    # the first --grid varies slowest, seeds fastest, starting at the recipe's seed
    assert [p.index for p in points] == list(range(16))
    assert points[0].overrides() == {"learning_rate": 1e-6, "beta": 0, "ogrpo.use_vllm": True, "seed": 42}
    assert points[1].overrides()["seed"] == 43 and points[2].values["ogrpo.use_vllm"] is False
    assert points[-1].label() == "learning_rate=3e-06, beta=0.04, ogrpo.use_vllm=false, seed=43"
    assert [p.overrides() for p in g.expand({"beta": [0, 1]})] == [{"beta": 0}, {"beta": 1}]


@pytest.mark.parametrize("items,seeds,match", [
    (["learning_rate"], None, "expected KEY=V1,V2"),
    (["=1,2"], None, "expected KEY=V1,V2"),
    (["beta=0,,1"], None, "empty value"),
    (["beta="], None, "empty value"),
    (["beta=0", "beta=1"], None, "already swept by an earlier --grid"),
    (["lerning_rate=1e-6"], None, "unknown key 'lerning_rate': did you mean learning_rate?"),
    (["ogrpo.profil=balanced"], None, "unknown key 'ogrpo.profil': did you mean ogrpo.profile?"),
    (["ogrpo.partition=a,b"], None, "cannot vary between points"),
    (["output_dir=a,b"], None, "cannot vary between points"),
    (["beta=abc"], None, "beta"),
    (["num_generations=4,4"], None, "value 4 is listed twice"),
    (["seed=1,2"], 3, "give the seeds one way"),
    ([], 0, "--seeds 0: must be 1 or more"),
])
def test_bad_grids_are_one_clear_error(items, seeds, match):
    with pytest.raises(OgrpoError, match=match):
        g.parse_seeds(seeds, g.parse_grid(items))


def test_too_many_points_are_refused():
    with pytest.raises(OgrpoError, match="at most 1000"):
        g.expand({"beta": list(range(40)), "learning_rate": [float(i) for i in range(30)]})


def test_bad_grid_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    for args, expect in ((["--grid", "lerning_rate=1e-6,3e-6"], "did you mean learning_rate?"),
                         (["--grid", "beta"], "expected KEY=V1,V2"),
                         ([], "nothing to sweep"),
                         (["--grid", "beta=0,1", "--max-parallel", "0"], "--max-parallel 0")):
        out = run("sweep", "--gpus", "cpu", "--config", "tiny", "--backend", "local", "--dry-run", *args,
                  "-o", str(tmp_path / "s"))
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.strip().count("\n") == 0 and expect in out.stderr and "Traceback" not in out.stderr
        assert not (tmp_path / "s").exists()


# -- planning every point --------------------------------------------------------------------------------------


def test_each_point_is_planned_with_its_own_values(tmp_path):
    from ogrpo.sweep.plan import plan_points

    planned = plan_points(g.expand({"learning_rate": [1e-6, 3e-6], "num_generations": [4, 8]}), "tiny", "3xA40")
    assert [pp.rc.trl["learning_rate"] for pp in planned] == [1e-6, 1e-6, 3e-6, 3e-6]
    assert [pp.rc.trl["num_generations"] for pp in planned] == [4, 8, 4, 8]
    assert all(pp.plan.fits and pp.plan.cluster.spec == "3xA40" for pp in planned)


def test_points_that_do_not_fit_are_each_named_and_exit_3(tmp_path):
    out = run("sweep", "--gpus", "1xA40", "--config", "tiny", "--backend", "slurm", "--dry-run",
              "--grid", "model_name_or_path=Qwen/Qwen2.5-0.5B,Qwen/Qwen2.5-72B,Qwen/Qwen2.5-72B-Instruct",
              "-o", str(tmp_path / "s"))
    assert out.returncode == 3, out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    # one line per failing point, naming it; the 0.5B point fits and is not listed
    assert len(errors) == 2, out.stderr
    assert errors[0].startswith("error: point 1 (model_name_or_path=Qwen/Qwen2.5-72B) does not fit: ")
    assert errors[1].startswith("error: point 2 (model_name_or_path=Qwen/Qwen2.5-72B-Instruct) does not fit: ")
    assert "Traceback" not in out.stderr and not (tmp_path / "s").exists()


def test_a_point_that_makes_the_config_invalid_is_named(tmp_path):
    # a string the grid takes as such; the run config's own check refuses it for point 1 only
    out = run("sweep", "--gpus", "cpu", "--config", "tiny", "--backend", "local", "--dry-run",
              "--grid", "ogrpo.strategy=ddp,zero9", "-o", str(tmp_path / "s"))
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: point 1 (ogrpo.strategy=zero9): ") and "did you mean zero3?" in out.stderr
    assert out.stderr.strip().count("\n") == 0 and not (tmp_path / "s").exists()


# -- the sweep directory and the job array ------------------------------------------------------------------------


def test_dry_run_writes_every_point_and_one_job_array(fake_slurm, tmp_path):
    sweep, cfg = tmp_path / "sweep", tmp_path / "server.yaml"
    cfg.write_text(toy_recipe(3, gpus="cpu", use_vllm=True))  # a vLLM server step
    out = run("sweep", "--gpus", "3xA40", "--config", str(cfg), "--grid", "learning_rate=1e-6,3e-6",
              "--grid", "beta=0,0.04", "--max-parallel", "2", "--backend", "slurm", "--dry-run", "-o", str(sweep))
    assert out.returncode == 0, out.stderr
    assert "dry run: nothing submitted" in out.stdout and not (tmp_path / "submitted.sbatch").exists()
    data = json.loads((sweep / "sweep.json").read_text())
    assert data["kind"] == "ogrpo-sweep" and data["grid"] == {"learning_rate": [1e-6, 3e-6], "beta": [0, 0.04]}
    assert [(p["values"]["learning_rate"], p["values"]["beta"]) for p in data["points"]] == [
        (1e-6, 0), (1e-6, 0.04), (3e-6, 0), (3e-6, 0.04)]
    assert data.get("slurm") is None  # nothing submitted
    script = (sweep / "sweep.sbatch").read_text()
    lines = script.splitlines()
    for want in ("#SBATCH --array=0-3%2", "#SBATCH --gres=gpu:a40:3", "#SBATCH --requeue", f"#SBATCH --chdir={sweep}",
                 f"#SBATCH --output={sweep}/points/%a/logs/slurm-%A_%a.out"):
        assert want in lines, (want, script)
    assert any(ln.startswith("#SBATCH --signal=B:USR2@") for ln in lines)
    # the body: the single job's supervisor, pointed at the task's point
    assert 'POINT_DIR="$SWEEP_DIR/points/${SLURM_ARRAY_TASK_ID:?' in script
    assert 'exec "${OGRPO_PYTHON:-$RENDERED_PYTHON}" -m ogrpo.launch.slurm supervise "$POINT_DIR"' in script
    assert "srun" not in script.split("# command", 1)[1]  # the supervisor starts the steps, not the batch script
    for p in data["points"]:
        pdir = sweep / "points" / str(p["index"])
        run_yaml = yaml.safe_load((pdir / "run.yaml").read_text())
        assert run_yaml["learning_rate"] == p["values"]["learning_rate"] and run_yaml["beta"] == p["values"]["beta"]
        job = json.loads((pdir / "manifest.json").read_text())
        assert job["inputs"]["sweep"] == data["id"] and job["inputs"]["point"] == p["index"]
        steps = {s["role"]: s for s in job["jobspec"]["steps"]}
        # each task is a whole job: server and trainer on disjoint GPUs of its allocation, as a single job
        assert steps["server"]["gpus"] == [0] and steps["trainer"]["gpus"] == [1, 2]
        assert job["jobspec"]["job_dir"] == str(pdir)
        assert (pdir / "job.sbatch").exists() and not (pdir / "slurm" / "job_id").exists()


def test_submit_hands_sbatch_the_array_and_records_each_task(fake_slurm, tmp_path):
    sweep = tmp_path / "sweep"
    out = run("sweep", "--gpus", "3xA40", "--config", "tiny", "--grid", "beta=0,0.04", "--seeds", "2",
              "--backend", "slurm", "-o", str(sweep))
    assert out.returncode == 0, out.stderr
    assert "submitted job array 4242: 4 tasks, at most 4 at once" in out.stdout
    # what Slurm got is the file in the sweep directory, byte for byte
    assert (tmp_path / "submitted.sbatch").read_text() == (sweep / "sweep.sbatch").read_text()
    assert "#SBATCH --array=0-3%4" in (sweep / "sweep.sbatch").read_text()
    data = json.loads((sweep / "sweep.json").read_text())
    assert data["slurm"]["array_job_id"] == "4242"
    for i in range(4):
        pdir = sweep / "points" / str(i)
        assert (pdir / "slurm" / "job_id").read_text().strip() == f"4242_{i}"
        assert (pdir / "job.key").stat().st_mode & 0o777 == 0o600  # each point's own key
    keys = {(sweep / "points" / str(i) / "job.key").read_text() for i in range(4)}
    assert len(keys) == 4
    log = fake_slurm.read_text()
    assert "--dependency=afterany:4242" in log and "ogrpo.sweep.summary" in log  # the summary job after the array


# -- a local sweep, end to end (stand-in steps) ---------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _local_toy_sweep(tmp_path: Path, monkeypatch, steps: int, step_s: float) -> tuple[Path, dict, Path]:
    """(config, environment, sweep directory) of a local sweep over the toy recipe on the CPU: STEPS steps of
    STEP_S seconds each (tests/sweep_steps.py); the job and sweep indexes under tmp_path, for this test and the
    commands it runs."""
    cache = str(tmp_path / "cache")
    monkeypatch.setenv("XDG_CACHE_HOME", cache)
    cfg = tmp_path / "toy.yaml"
    cfg.write_text(toy_recipe(steps, gpus="cpu", use_vllm=False))
    env = {**sweep_steps.env(), "SWEEP_TOY_STEP_S": str(step_s), "XDG_CACHE_HOME": cache}
    return cfg, env, tmp_path / "sweep"


@pytest.mark.slow
def test_local_sweep_runs_points_in_turn_with_status_summary_and_reproduce(tmp_path, monkeypatch):
    cfg, env, sweep = _local_toy_sweep(tmp_path, monkeypatch, steps=3, step_s=0.2)
    out = run("sweep", "--backend", "local", "--config", str(cfg), "--grid", "learning_rate=1e-3,2e-3", "-o",
              str(sweep), env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads((sweep / "sweep.json").read_text())
    runs = []
    for i, lr in enumerate((1e-3, 2e-3)):
        run_dir = sweep / "points" / str(i) / "run"
        state = json.loads((run_dir / "toy_ckpt.json").read_text())
        assert state["step"] == 3 and len(state["attempts"]) == 1
        runs.append(state["attempts"][0])
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        # the point's own config reached its trainer: reward 0.2 + lr * 10 * step (tests/sweep_steps.py)
        assert [m["reward"] for m in metrics] == pytest.approx([0.2 + lr * 10 * s for s in (1, 2, 3)])
    assert runs[0]["t1"] <= runs[1]["t0"]  # one after another
    assert runs[0]["rendezvous_port"] != runs[1]["rendezvous_port"]

    status = run("status", str(sweep), env=env)
    assert status.returncode == 0, status.stderr
    rows = [ln.split() for ln in status.stdout.splitlines()[2:4]]
    assert status.stdout.splitlines()[1].split() == ["point", "learning_rate", "seed", "state", "step", "reward",
                                                     "requeues"]
    assert rows == [["0", "0.001", "-", "COMPLETED", "3", "0.23", "0"],
                    ["1", "0.002", "-", "COMPLETED", "3", "0.26", "0"]]
    by_id = json.loads(run("status", data["id"], "--json", env=env).stdout)  # the sweep's id works as well
    assert [r["state"] for r in by_id["points"]] == ["COMPLETED", "COMPLETED"]
    with (sweep / "summary.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [(r["point"], r["learning_rate"], r["state"], r["last_reward"]) for r in table] == [
        ("0", "0.001", "COMPLETED", "0.23"), ("1", "0.002", "COMPLETED", "0.26")]
    assert (sweep / "rewards.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert run("cancel", str(sweep), env=env).returncode == 2  # it ended: nothing to cancel

    # the whole sweep again, from its manifest alone (written, not run: the point below runs)
    cfg.unlink()
    again = tmp_path / "again"
    out = run("reproduce", str(sweep), "-o", str(again), "--dry-run", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "differs from the recorded sweep" not in out.stderr, out.stderr  # today's planner plans each point alike
    redo = json.loads((again / "sweep.json").read_text())
    assert redo["backend"] == "local" and redo["recipe"] == data["recipe"] and redo["grid"] == data["grid"]
    assert [p["values"] for p in redo["points"]] == [p["values"] for p in data["points"]]
    for i in (0, 1):
        assert (yaml.safe_load((again / "points" / str(i) / "run.yaml").read_text()) ==
                yaml.safe_load((sweep / "points" / str(i) / "run.yaml").read_text()))
    # and one point of it: a job directory like any other
    one = tmp_path / "one"
    out = run("reproduce", str(sweep / "points" / "1"), "-o", str(one), env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert yaml.safe_load((one / "run.yaml").read_text())["learning_rate"] == 2e-3
    # a point planned with another setting than today's planner picks: the sweep's rerun names it, --strict refuses
    manifest = sweep / "points" / "0" / "manifest.json"  # the job's: its plan
    record = json.loads(manifest.read_text())
    setting = record["plan"]["settings"][0]
    setting["value"] = "moved"
    manifest.write_text(json.dumps(record))
    out = run("reproduce", str(sweep), "-o", str(tmp_path / "fourth"), "--dry-run", "--strict", env=env)
    assert out.returncode == 2 and f"plan setting {setting['name']}: 'moved' ->" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and not (tmp_path / "fourth").exists()


@pytest.mark.slow
def test_cancel_stops_a_local_sweep_and_leaves_no_process(tmp_path, monkeypatch):
    cfg, env, sweep = _local_toy_sweep(tmp_path, monkeypatch, steps=600, step_s=0.5)
    proc = subprocess.Popen([*OGRPO, "sweep", "--backend", "local", "--config", str(cfg), "--grid",
                             "learning_rate=1e-3,2e-3", "-o", str(sweep)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        ckpt = sweep / "points" / "0" / "run" / "toy_ckpt.json"
        deadline = time.monotonic() + 120
        while not ckpt.exists() and time.monotonic() < deadline:
            assert proc.poll() is None, "the sweep ended before its first point started"
            time.sleep(0.2)
        trainer = json.loads(ckpt.read_text())["attempts"][0]["pid"]
        assert _alive(trainer)
        out = run("cancel", str(sweep), env=env)
        assert out.returncode == 0, out.stderr
        assert f"cancelled sweep {sweep.name}" in out.stdout
        assert proc.wait(timeout=30) != 0
        assert not _alive(trainer) and not _alive(proc.pid)
        assert not (sweep / "points" / "1" / "run" / "toy_ckpt.json").exists()  # the next point never started
        rows = json.loads(run("status", str(sweep), "--json", env=env).stdout)["points"]
        assert [r["state"] for r in rows] == ["CANCELLED", "CANCELLED"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)


def test_slurm_options_are_refused_for_a_local_run_and_a_slurm_sweep_reruns_here_without_them(fake_slurm, tmp_path):
    """--backend local runs on this machine: Slurm's command-line options would be dropped, so they are refused
    (submit and sweep, nothing written); the recipe's Slurm keys are noted as unused (the recipe goes to Slurm
    later); a Slurm sweep reproduced here says which of its Slurm options it does not pass."""
    cfg = tmp_path / "r.yaml"
    cfg.write_text(toy_recipe(3, gpus="cpu") + "  partition: debug\n  container: /images/a40.sif\n")
    for args in (["submit", "--time", "10", "--nodes", "2"], ["submit", "--max-requeues", "3"],
                 ["sweep", "--grid", "beta=0,0.04", "--qos", "high", "--slurm", "exclusive"]):
        out = tmp_path / f"out-{len(args)}"
        proc = run(*args, "--backend", "local", "--gpus", "cpu", "--config", str(cfg), "--dry-run", "-o", str(out))
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        flags = [a for a in args if a.startswith("--") and a != "--grid"]
        assert f"{', '.join(flags)}: " in proc.stderr and "--backend local runs on this machine" in proc.stderr
        assert not out.exists()
    proc = run("submit", "--backend", "local", "--gpus", "cpu", "--config", str(cfg), "--dry-run",
               "-o", str(tmp_path / "job"))
    assert proc.returncode == 0, proc.stderr
    assert ("note: ogrpo.partition, ogrpo.container not used: --backend local runs on this machine, without Slurm"
            in proc.stderr.splitlines())
    sweep = tmp_path / "sweep"
    proc = run("sweep", "--gpus", "cpu", "--config", str(cfg), "--grid", "beta=0,0.04", "--backend", "slurm",
               "--time", "30", "--qos", "high", "--dry-run", "-o", str(sweep))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((sweep / "sweep.json").read_text())["options"]["max_requeues"] is None  # as given
    proc = run("reproduce", str(sweep), "--backend", "local", "-o", str(tmp_path / "again"), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert ("note: --time 30, --qos high of the recorded sweep not passed: --backend local runs on this machine, "
            "without Slurm") in proc.stderr, proc.stderr
    assert len(json.loads((tmp_path / "again" / "sweep.json").read_text())["points"]) == 2
