"""Disjoint cores for a CPU plan's server and trainer (ogrpo/launch/cpu_slots.py), from the plan to the processes."""

from __future__ import annotations

import os

import pytest

from ogrpo.launch import cpu_slots


@pytest.mark.parametrize("slots, allowed, want", [
    ("0:1:2", [0, 1], [0]), ("1:1:2", [0, 1], [1]),
    ("0:1:3", list(range(8)), [0, 1]), ("1:2:3", list(range(8)), [2, 3, 4, 5, 6, 7]),
    ("1:1:2", [4, 9, 2, 7], [7, 9]),  # the cores this process may use, whatever their numbers
    ("0:1:3", [0, 1], None),  # fewer cores than shares: nothing pinned
    ("2:1:2", [0, 1], None), ("x", [0, 1], None),
])
def test_each_step_gets_its_share_of_the_allowed_cores(slots, allowed, want):
    assert cpu_slots.cores_for(slots, allowed) == want


def test_cpu_list_is_libnumas_form():
    assert cpu_slots.cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and cpu_slots.cpu_list([3]) == "3"


def test_a_cpu_split_plan_gives_server_and_trainer_disjoint_cores(monkeypatch):
    from ogrpo.config import load_run_config
    from ogrpo.jobspec import build_jobspec
    from ogrpo.launch.local import local_step_env
    from ogrpo.plan import plan_from_config

    rc = load_run_config("tiny")
    rc.ogrpo.use_vllm = True
    plan = plan_from_config(rc, gpus="3xcpu")
    spec = build_jobspec(plan, rc, "/tmp/job")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    server, trainer = local_step_env(spec.step("server")), local_step_env(spec.step("trainer"))
    # the engine on the server's cores, its HTTP front end on all once the engine has started
    assert server == {"OGRPO_CPU_CORES": "0-1", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "OGRPO_CPU_FRONTEND_CORES": "0-5"}
    assert trainer == {"OGRPO_CPU_CORES": "2-5"}
    assert plan.setting("cpu_slots") is not None  # shown with its reason


def test_a_process_pins_itself_to_its_cores():
    import subprocess
    import sys

    core = sorted(os.sched_getaffinity(0))[-1]
    code = "from ogrpo.launch.cpu_slots import pin_from_env; import os; pin_from_env(); print(sorted(os.sched_getaffinity(0)))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OGRPO_CPU_CORES": str(core)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"[{core}]", out.stderr


RELEASE_PROBE = """
import json, os, subprocess, sys, time
from ogrpo.launch import cpu_slots
os.sched_setaffinity(0, [int(sys.argv[1])])
thread = cpu_slots.release_frontend({cpu_slots.FRONTEND_ENV: sys.argv[2]}, poll_s=0.05)
time.sleep(0.3)
before = sorted(os.sched_getaffinity(0))  # no engine yet: still pinned
child = subprocess.Popen([sys.executable, "-c", "import ctypes, time; "
                          "ctypes.CDLL(None).prctl(15, b'VLLM::EngineCore', 0, 0, 0); time.sleep(30)"])
thread.join(20)
print(json.dumps([before, sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(child.pid)), child.pid]))
child.kill()
child.wait()
"""


def test_the_servers_front_end_leaves_the_engines_cores_once_the_engine_has_started():
    """The API process stays on the server's cores until its engine process (named as vLLM names it) has started
    there, then moves to all the cores given; the engine keeps the server's."""
    import subprocess
    import sys

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one core: nothing to move to")
    from ogrpo.launch.cpu_slots import cpu_list

    out = subprocess.run([sys.executable, "-c", RELEASE_PROBE, str(allowed[-1]), cpu_list(allowed)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    before, after, engine, pid = json.loads(out.stdout)
    assert (before, after, engine) == ([allowed[-1]], allowed, [allowed[-1]]), out.stdout
    assert not os.path.exists(f"/proc/{pid}")  # the probe killed and reaped its stand-in engine


def test_without_an_engine_process_the_front_end_stays_and_says_so(capsys):
    before = os.sched_getaffinity(0)
    thread = cpu_slots.release_frontend({cpu_slots.FRONTEND_ENV: "0"}, poll_s=0.01, give_up_s=0.2)
    thread.join(30)
    assert not thread.is_alive() and os.sched_getaffinity(0) == before
    assert "no VLLM::EngineCore process seen" in capsys.readouterr().err
    assert cpu_slots.release_frontend({}) is None  # a GPU plan, or Slurm: nothing to move
