"""Preemption timing: the cluster's SIGTERM → SIGKILL window from real scontrol output (ogrpo.launch.slurm.grace), the
policy the planner makes of it (ogrpo.planner.preemption: save_steps, signal lead time, warnings), and the trainer's
SIGTERM decision (ogrpo.trainer.preemption), without Slurm or a training run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ogrpo.launch.slurm import grace
from ogrpo.planner import preemption as policy_of
from ogrpo.planner.preemption import PreemptionFacts
from ogrpo.planner.types import Change

DATA = Path(__file__).parent / "data"
# `scontrol show partition -o` on the test cluster (tests/slurm/cluster.sh, Slurm 22.05.8)
PARTITION = (
    "PartitionName=debug AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A "
    "DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED MaxTime=UNLIMITED "
    "MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=localhost PriorityJobFactor=1 PriorityTier=1 RootOnly=NO "
    "ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=8 TotalNodes=1 "
    "SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED "
    "TRES=cpu=8,mem=19284M,node=1,billing=8,gres/gpu=3\n")
CONFIG = (DATA / "scontrol_show_config.txt").read_text()
# The same cluster as a preempting one: a low-priority partition whose jobs are requeued after 120 s of grace.
PREEMPTING_CONFIG = CONFIG.replace("preempt/none", "preempt/partition_prio").replace(
    "PreemptMode             = OFF", "PreemptMode             = REQUEUE")
SCAVENGER = PARTITION.replace("PartitionName=debug", "PartitionName=scavenger").replace(
    "Default=YES", "Default=NO").replace("GraceTime=0", "GraceTime=120").replace("PreemptMode=OFF", "PreemptMode=REQUEUE")


def _plan(gpus="cpu", recipe="tiny", facts=None, **ogrpo):
    from ogrpo.config import load_run_config
    from ogrpo.plan import plan_from_config

    rc = load_run_config(recipe, {"ogrpo": {"gpus": gpus, **ogrpo}})
    return rc, plan_from_config(rc, preemption=facts)


def _policy(plan, trl, *, grace, step, signal_delay_s=None):
    """The pure policy for a plan's model: (Preemption, warnings, changes)."""
    return policy_of.policy(trl, grace=grace, step=step, save_s=policy_of.save_estimate_s(plan.model.params),
                            signal_delay_s=signal_delay_s)


def test_parses_the_test_clusters_scontrol_output():
    g = grace.grace_from(CONFIG, PARTITION)
    assert g == grace.Grace(kill_wait_s=5, grace_time_s=0, preempt_type="preempt/none", preempt_mode="OFF",
                            partition="debug")
    assert not g.preempts and g.window_s == 5
    assert grace.parse_config(CONFIG)["AuthInfo"].endswith("cred_expire=10")  # values with '=' stay whole


def test_a_preempting_partition_adds_its_grace_time():
    parts = PARTITION + SCAVENGER
    g = grace.grace_from(PREEMPTING_CONFIG, parts, "scavenger")
    assert g.preempts and g.grace_time_s == 120 and g.window_s == 125
    assert "GraceTime 120 s of partition scavenger" in g.describe()
    # the default partition when none is named; a cluster without preemption ignores GraceTime
    assert grace.grace_from(PREEMPTING_CONFIG, parts).partition == "debug"
    assert grace.grace_from(CONFIG, parts, "scavenger").window_s == 5
    assert grace.grace_from("not scontrol output", parts) is None


@pytest.mark.parametrize("text, secs", [("5 sec", 5), ("30", 30), ("00:01:30", 90), ("1-00:00:00", 86400),
                                        ("NONE", None), ("UNLIMITED", None)])
def test_seconds(text, secs):
    assert grace._seconds(text) == secs


def test_short_kill_wait_checkpoints_every_step_and_warns():
    rc, plan = _plan()
    g = grace.grace_from(CONFIG, PARTITION)
    pol, warnings, changes = _policy(plan, rc.trl, grace=g, step=(3.0, "measured"))
    # one step (with margin) + the tiny model's save do not fit in 5 s
    assert pol.need_s == pytest.approx(3.0 * policy_of.STEP_MARGIN + pol.save_s) and pol.need_s > 5
    assert pol.save_steps == 1 and changes == [Change("save_steps", 10, 1, changes[0].reason)]
    assert "KillWait 5 s" in warnings[0] and "at most that step" in warnings[0]
    assert pol.signal_delay_s == 90  # the lead the step needs (26 s) is under the default


def test_the_planner_step_puts_the_policy_on_the_plan():
    """Facts in, the plan out: its change (once, after the planner's own), its warning, its policy; the recipe's
    run config untouched (run.yaml carries the plan's save_steps: tests/test_render.py)."""
    facts = PreemptionFacts(grace=grace.grace_from(CONFIG, PARTITION), recorded_step=(3.0, "measured"))
    rc, plan = _plan(facts=facts)
    _, bare = _plan()
    assert plan.changes == bare.changes + [Change("save_steps", 10, 1, plan.changes[-1].reason)]
    assert plan.warnings[:len(bare.warnings)] == bare.warnings and len(plan.warnings) == len(bare.warnings) + 1
    assert "KillWait 5 s" in plan.warnings[-1] and "at most that step" in plan.warnings[-1]
    pol = plan.preemption
    assert pol.save_steps == 1 and pol.step_s == 3.0 and pol.step_source == "measured" and pol.grace.window_s == 5
    assert pol.signal_delay_s == 90 and rc.trl["save_steps"] == 10
    assert plan.to_dict() == {**bare.to_dict(), "changes": [c.to_dict() for c in plan.changes],
                              "warnings": plan.warnings}  # the JSON form has no new key
    # no facts (a plan that runs here, a fix being re-planned): no policy, nothing added
    assert bare.preemption is None and not any(c.key == "save_steps" for c in bare.changes)
    # an installed Slurm that did not answer: the plan says what it assumed, and changes nothing
    _, unread = _plan(facts=PreemptionFacts(unread="controller down"))
    assert unread.changes == bare.changes and unread.preemption.save_steps is None
    assert unread.warnings[-1].startswith("KillWait could not be read (controller down)")
    # --signal-delay comes in with the facts
    _, delayed = _plan(facts=PreemptionFacts(signal_delay_s=120))
    assert delayed.preemption.signal_delay_s == 120 and delayed.warnings == bare.warnings


def test_strict_refuses_the_planned_save_steps_change(monkeypatch):
    """--strict refuses the preemption policy's change as every other (one message, the changes listed)."""
    from ogrpo.errors import ConfigError
    from ogrpo.load_plan import load_and_plan

    asked = []

    def facts(rc):
        asked.append(rc.source)
        return PreemptionFacts(grace=grace.grace_from(CONFIG, PARTITION))

    with pytest.raises(ConfigError, match=r"--strict refuses .*save_steps would change from 10 to 1") as err:
        load_and_plan("tiny", "cpu", None, None, None, None, strict=True, preemption=facts)
    with pytest.raises(ConfigError) as without:  # a CPU plan changes other keys too: all are listed, this last
        load_and_plan("tiny", "cpu", None, None, None, None, strict=True)
    assert len(asked) == 1 and err.value.problems == without.value.problems + [
        "save_steps would change from 10 to 1 (KillWait 5 s < one step + checkpoint (~14 s): lose at most one step "
        "on a requeue)"]
    rc, plan = load_and_plan("tiny", "cpu", None, None, None, None, preemption=facts)
    assert plan.preemption.save_steps == 1 and plan.preemption.step_source.startswith("default for CPU")


def test_a_long_enough_window_changes_nothing():
    rc, plan = _plan()
    g = grace.grace_from(PREEMPTING_CONFIG, PARTITION + SCAVENGER, "scavenger")
    pol, warnings, changes = _policy(plan, rc.trl, grace=g, step=(2.0, "measured"))
    assert pol.save_steps is None and not warnings and not changes
    # without a cluster, nothing is known about SIGTERM: no change either
    assert _policy(plan, rc.trl, grace=None, step=(2.0, "m"))[0].save_steps is None


def test_already_every_step_or_no_step_checkpoints_only_warn():
    rc, plan = _plan()
    g = grace.grace_from(CONFIG, PARTITION)
    every, warnings, changes = _policy(plan, {**rc.trl, "save_steps": 1}, grace=g, step=(3.0, "m"))
    assert every.save_steps is None and not changes and "save_steps is 1" in warnings[0]
    epoch, warnings, _ = _policy(plan, {**rc.trl, "save_strategy": "epoch"}, grace=g, step=(3.0, "m"))
    assert epoch.save_steps is None and "save_strategy 'epoch'" in warnings[0]


def test_signal_lead_time_follows_step_and_save_time():
    rc, plan = _plan("8xA100-80G")
    slow, _, _ = _policy(plan, rc.trl, grace=None, step=(120.0, "m"))
    # 120 s x 1.25 + a 2 s save + 20 s for the supervisor's stop
    assert slow.signal_delay_s == policy_of.lead_time_s(120.0, slow.save_s) == 172
    # an explicit --signal-delay is kept, with a warning when it is too short
    short, warnings, _ = _policy(plan, rc.trl, grace=None, step=(120.0, "m"), signal_delay_s=60)
    assert short.signal_delay_s == 60 and "--signal-delay 60 s is shorter" in warnings[0]
    assert not _policy(plan, rc.trl, grace=None, step=(10.0, "m"), signal_delay_s=60)[1]


def test_save_estimate_grows_with_the_model():
    _, tiny = _plan()
    assert policy_of.save_estimate_s(tiny.model.params) == pytest.approx(grace.SAVE_FIXED_S, abs=0.1)
    assert policy_of.save_estimate_s(7e9) == pytest.approx(2 + 7e9 * 16 / 1e9)  # 114 s at 1 GB/s


def test_step_time_sources(tmp_path):
    assert policy_of.step_estimate("cpu") == (10.0, "default for CPU plans (set ogrpo.step_time_s)")
    run = tmp_path / "run"
    run.mkdir()
    # the first step (warm-up) is left out; the median of the rest
    (run / "profile.jsonl").write_text("".join(json.dumps({"step": i, "step_s": s}) + "\n"
                                               for i, s in enumerate([30.0, 1.0, 3.0, 2.0], 1)))
    rec = grace.recorded_step_s(tmp_path)
    assert rec[0] == 2.0 and "median of 3 recorded steps" in rec[1]
    assert policy_of.step_estimate("cpu", None, rec) == rec
    assert policy_of.step_estimate("cpu", 7, rec) == (7.0, "ogrpo.step_time_s")
    # gathered for the planner with the cluster's answer (none here: SLURM_CONF names no file)
    from ogrpo.config import load_run_config

    facts = grace.gather(load_run_config("tiny"), job_dir=tmp_path, signal_delay_s=60)
    assert facts == PreemptionFacts(grace=None, unread=None, recorded_step=rec, signal_delay_s=60)
    assert grace.recorded_step_s(tmp_path / "nothing") is None


def test_step_time_option_is_validated():
    from ogrpo.config import load_run_config
    from ogrpo.errors import ConfigError

    assert load_run_config("tiny", {"ogrpo": {"step_time_s": 3}}).ogrpo.step_time_s == 3
    with pytest.raises(ConfigError, match="ogrpo.step_time_s"):
        load_run_config("tiny", {"ogrpo": {"step_time_s": "fast"}})


@pytest.mark.parametrize("elapsed, step_s, save_s, window, saved, leave", [
    (0.5, 3.0, 1.0, 5.0, True, False),  # 2.5 s left + 1 s save fit in 5 s: finish and save
    (0.5, 8.0, 1.0, 5.0, True, True),  # 7.5 s left: cannot; the last step is on disk -> leave now
    (0.5, 8.0, 1.0, 5.0, False, False),  # the last step is not on disk: waiting is the only chance to save
    (0.5, None, 1.0, 5.0, True, False),  # no step measured yet
    (0.5, 8.0, 1.0, None, True, False),  # no known deadline (not under Slurm)
])
def test_leave_now_decision(elapsed, step_s, save_s, window, saved, leave):
    assert grace.leave_now(elapsed_s=elapsed, step_s=step_s, save_s=save_s, window_s=window,
                           last_step_saved=saved) is leave


class _State:
    def __init__(self, step):
        self.global_step = step
        self.is_world_process_zero = True


def _callback(tmp_path, monkeypatch, window):
    import transformers  # noqa: F401  (the train extra is part of the test environment: missing fails)
    from ogrpo.trainer import preemption

    monkeypatch.setenv(preemption.WINDOW_ENV, str(window))
    exits = []
    monkeypatch.setattr(preemption, "_exit", exits.append)
    cb = preemption.PreemptionCallback(tmp_path)
    return preemption, cb, exits


def _run_steps(cb, times, monkeypatch, preemption, start=0):
    """Steps that take `times` seconds each, a checkpoint after each (save_steps 1)."""
    clock = [1000.0]
    monkeypatch.setattr(preemption.time, "monotonic", lambda: clock[0])
    for i, t in enumerate(times):
        cb.on_step_begin(None, _State(start + i), None)
        clock[0] += t
        cb.on_step_end(None, _State(start + i + 1), None)
        clock[0] += 0.5
        cb.on_save(None, _State(start + i + 1), None)
    return clock


def _sigterm_1s_into_step_3(tmp_path, monkeypatch, step_s: float):
    """A 5 s SIGTERM window, two saved steps of STEP_S seconds each, then SIGTERM 1 s into the third step."""
    preemption, cb, exits = _callback(tmp_path, monkeypatch, window=5)
    clock = _run_steps(cb, [step_s, step_s], monkeypatch, preemption)
    cb.on_step_begin(None, _State(2), None)
    clock[0] += 1.0
    cb._on_signal(signal.SIGTERM, None)
    return preemption, cb, exits


def test_sigterm_that_a_step_cannot_outrun_exits_at_once(tmp_path, monkeypatch):
    preemption, cb, exits = _sigterm_1s_into_step_3(tmp_path, monkeypatch, step_s=8.0)
    assert exits == [preemption.EXIT_PREEMPTED]
    marker = json.loads((tmp_path / preemption.MARKER).read_text())
    assert marker["signal"] == "SIGTERM" and marker["checkpoint"] == "checkpoint-2" and marker["left_mid_step"]


def test_sigterm_waits_for_the_step_end_when_it_can_be_saved(tmp_path, monkeypatch):
    preemption, cb, exits = _sigterm_1s_into_step_3(tmp_path, monkeypatch, step_s=2.0)
    assert not exits and cb.signal_name == "SIGTERM"  # flagged: save at the end of this step, then exit
    assert not (tmp_path / preemption.MARKER).exists()


def test_sigterm_during_a_save_or_on_usr2_never_leaves(tmp_path, monkeypatch):
    preemption, cb, exits = _callback(tmp_path, monkeypatch, window=5)
    clock = _run_steps(cb, [8.0], monkeypatch, preemption)
    cb.on_step_begin(None, _State(1), None)
    clock[0] += 8.0
    cb.on_step_end(None, _State(2), None)  # step 2 done, its save running
    cb._on_signal(signal.SIGTERM, None)
    assert not exits and cb.signal_name == "SIGTERM"
    _, cb2, exits2 = _callback(tmp_path, monkeypatch, window=5)
    clock = _run_steps(cb2, [8.0], monkeypatch, preemption)
    cb2.on_step_begin(None, _State(1), None)
    cb2._on_signal(signal.SIGUSR2, None)  # the time-limit warning comes with its lead time: always save
    assert not exits2 and cb2.signal_name == "SIGUSR2"


def _scontrol_printing_the_test_cluster(tmp_path: Path) -> Path:
    """A folder with an `scontrol` that prints the test cluster's `show config` / `show partition` output (each
    call's arguments logged in bin/calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        f"#!{sys.executable}\nimport sys\n"
        f"open({str(bin_dir / 'calls')!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        f"print(open({str(DATA / 'scontrol_show_config.txt')!r}).read() if sys.argv[2] == 'config' else "
        f"{PARTITION!r})\n")
    (bin_dir / "scontrol").chmod(0o755)
    return bin_dir


def test_window_under_slurm_comes_from_scontrol(tmp_path, monkeypatch):
    from ogrpo.trainer import preemption

    bin_dir = _scontrol_printing_the_test_cluster(tmp_path)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(preemption.WINDOW_ENV, raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert preemption.sigterm_window_s() is None  # not in a job: no deadline assumed
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert preemption.sigterm_window_s() == 5.0
    assert grace.query().kill_wait_s == 5


def test_render_and_plan_show_the_policy_of_the_cluster(tmp_path):
    """`ogrpo render` / `plan --json` against a cluster whose KillWait is 5 s (a stand-in scontrol printing the
    test cluster's output): save_steps lowered in run.yaml, the change and the warning shown and recorded."""
    bin_dir = _scontrol_printing_the_test_cluster(tmp_path)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    ogrpo = [sys.executable, "-m", "ogrpo"]
    out = subprocess.run([*ogrpo, "render", "--gpus", "2xcpu", "--config", "tiny", "-o", str(tmp_path / "job")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "KillWait 5 s between SIGTERM and SIGKILL" in out.stderr and "change: save_steps: 10 -> 1" in out.stderr
    import yaml

    assert yaml.safe_load((tmp_path / "job" / "run.yaml").read_text())["save_steps"] == 1
    manifest = json.loads((tmp_path / "job" / "manifest.json").read_text())
    assert any(c["key"] == "save_steps" and c["to"] == 1 for c in manifest["changes"])
    assert "#SBATCH --signal=B:USR2@90" in (tmp_path / "job" / "job.sbatch").read_text()
    assert (bin_dir / "calls").read_text().splitlines() == ["show config", "show partition -o"]
    (bin_dir / "calls").unlink()
    # a plan that runs on this machine asks no cluster: its preemption is the render's or the submit's
    plan = subprocess.run([*ogrpo, "plan", "--gpus", "2xcpu", "--config", "tiny", "--json"], capture_output=True,
                          text=True, env=env, timeout=120)
    d = json.loads(plan.stdout)
    assert d["preemption"] is None and not (bin_dir / "calls").exists()
    assert not any(c["key"] == "save_steps" for c in d["changes"])
    plan = subprocess.run([*ogrpo, "plan", "--gpus", "3xA40", "--config", "tiny", "--json"], capture_output=True,
                          text=True, env=env, timeout=120)
    d = json.loads(plan.stdout)
    assert d["preemption"]["grace"]["window_s"] == 5 and d["preemption"]["save_steps"] == 1
    assert any("KillWait 5 s" in w for w in d["warnings"]) and (bin_dir / "calls").exists()
