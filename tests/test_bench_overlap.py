"""`ogrpo bench overlap`: reward per mode at fixed steps and wall-clock times, the quality check's verdict (pass,
fail, inconclusive; lossless against off step by step) on synthetic curves, the broken one-step's plan, and the
run itself at the smallest size (one seed, two steps, every mode and the broken switch in one invocation)."""

from __future__ import annotations

import csv
import io
import json
import math
import random

import pytest
import typer

from ogrpo.bench import overlap as bench
from ogrpo.bench.overlap import at_step, at_time, judge, run_overlap_bench, summarize
from ogrpo.errors import OgrpoError
from ogrpo.launch.procs import mentioning

STEPS = 30


def learning(seed: int, lag: int = 0, top: float = 0.95, collapse_at: int | None = None, noise: float = 0.04):
    """A seed's curve of (step, seconds, reward, loss) shaped like tiny's: 0.3 at step 1 rising to `top` by step
    10 (`lag` steps later), per-step noise; 0 from `collapse_at` on (a diverged run)."""
    rnd = random.Random(seed)
    out = []
    for step in range(1, STEPS + 1):
        level = 0.3 + (top - 0.3) * min(1.0, max(0, step - 1 - lag) / 9)
        reward = 0.3 if step == 1 else min(1.0, max(0.0, level + rnd.uniform(-noise, noise)))
        if collapse_at is not None and step >= collapse_at:
            reward = 0.0
        out.append((step, 0.4 * step, reward, 0.2 + 0.01 * rnd.random()))
    return out


def test_summary_from_the_curves():
    # (step, seconds of training at its end, reward)
    off = [[(1, 1.0, 0.2), (2, 2.0, 0.4)], [(1, 1.5, 0.4), (2, 3.0, 0.6)]]
    one = [[(1, 0.5, 0.3), (2, 1.0, 0.5)], [(1, 0.6, 0.9), (2, 1.2, 1.5)]]
    assert at_step(off[0], 2) == 0.4 and at_step(off[0], 3) is None
    assert at_time(off[1], 1.4) is None and at_time(off[1], 1.5) == 0.4 and at_time(off[1], 9) == 0.6
    s = summarize({"off": off, "one-step": one}, [1, 2], [1.5])
    (m, sd), _ = s["steps"]["off"]
    assert m == pytest.approx(0.3) and sd == pytest.approx(math.sqrt(0.02))
    # at 1.5 s: off's runs have rewards 0.2 and 0.4, one-step's the last step each finished (0.5, 1.5)
    assert s["times"]["off"][0][0] == pytest.approx(0.3) and s["times"]["one-step"][0][0] == pytest.approx(1.0)
    single = summarize({"off": off[:1], "one-step": one[:1]}, [1], [1.0])
    assert math.isnan(single["steps"]["off"][0][1])


def test_a_mode_that_learns_as_off_passes_even_a_step_behind():
    off = [learning(s) for s in range(3)]
    one = [learning(10 + s, lag=1) for s in range(3)]  # one-step's samples are a policy version old
    check = judge({"off": off, "one-step": one}, STEPS)
    assert check["k"] == 10 and check["start"] == pytest.approx(0.3) and check["off"] is None
    assert check["rise"][0] == pytest.approx(0.65, abs=0.03)
    row = check["modes"]["one-step"]
    assert row["margin"] == pytest.approx(bench.MARGIN * check["rise"][0])
    assert row["lower"] < row["diff"] and row["lower"] > -row["margin"]
    assert row["verdict"] == "pass" and check["verdict"] == "pass" and bench.EXIT[check["verdict"]] == 0


def test_a_broken_mode_fails_whether_it_diverges_or_learns_less():
    off = [learning(s) for s in range(3)]
    # one seed of three diverges: the mean alone (0.63 vs 0.95) sits within 2 SE of off; non-inferiority is not
    diverged = [learning(20, collapse_at=19), learning(21), learning(22)]
    check = judge({"off": off, "one-step/no-correction": diverged}, STEPS)
    row = check["modes"]["one-step/no-correction"]
    assert row["diff"] + bench.Z * math.hypot(check["final_off"][1], row["final"][1]) > 0  # not "shown worse"
    assert row["verdict"] == "fail" and check["verdict"] == "fail" and bench.EXIT["fail"] == 1
    # every seed learns, to a plateau lower by more than a fifth of off's rise
    lower = judge({"off": off, "one-step": [learning(30 + s, top=0.75) for s in range(3)]}, STEPS)
    assert lower["modes"]["one-step"]["verdict"] == "fail"
    # ... and by less: within the margin, at 2 SE
    close = judge({"off": off, "one-step": [learning(30 + s, top=0.9) for s in range(3)]}, STEPS)
    assert close["modes"]["one-step"]["verdict"] == "pass"


def test_inconclusive_when_off_does_not_learn_or_one_seed():
    flat = [learning(s, top=0.35) for s in range(3)]
    check = judge({"off": flat, "one-step": [learning(10 + s, top=0.0) for s in range(3)]}, STEPS)
    assert "off did not learn clearly" in check["off"]
    assert check["modes"]["one-step"]["verdict"] == "inconclusive" and check["verdict"] == "inconclusive"
    assert bench.EXIT["inconclusive"] == 4
    one_seed = judge({"off": [learning(0)], "one-step": [learning(1)]}, STEPS)
    assert "one seed" in one_seed["off"] and one_seed["verdict"] == "inconclusive"
    assert math.isnan(one_seed["modes"]["one-step"]["lower"])


def test_lossless_is_judged_by_identity_with_off_step_by_step():
    off = [learning(s) for s in range(3)]
    same = judge({"off": off, "lossless": [list(c) for c in off]}, STEPS)
    ident = same["modes"]["lossless"]["identity"]
    assert [r["step"] for r in ident] == list(range(1, STEPS + 1)) and all(r["equal"] for r in ident)
    assert same["modes"]["lossless"]["verdict"] == "pass" and same["verdict"] == "pass"
    # identical curves pass even where off learned nothing to judge the others by
    flat = [learning(s, top=0.3) for s in range(2)]
    assert judge({"off": flat, "lossless": flat}, STEPS)["verdict"] == "pass"

    def changed(step, d_reward=0.0, d_loss=0.0):
        runs = [list(c) for c in off]
        s, t, r, loss = runs[1][step - 1]
        runs[1][step - 1] = (s, t, r + d_reward, loss + d_loss)
        return runs

    reward = judge({"off": off, "lossless": changed(7, d_reward=1 / 32)}, STEPS)
    bad = [r for r in reward["modes"]["lossless"]["identity"] if not r["equal"]]
    assert [(r["step"], r["seeds"]) for r in bad] == [(7, [1])] and bad[0]["reward_diff"] == pytest.approx(1 / 32)
    assert reward["modes"]["lossless"]["parted"] == 7
    assert reward["modes"]["lossless"]["verdict"] == "fail" and reward["verdict"] == "fail"
    # parted after IDENTICAL_STEPS (rounding grown into a flipped sample): judged as the other modes
    late = judge({"off": off, "lossless": changed(bench.IDENTICAL_STEPS + 1, d_reward=1 / 32)}, STEPS)
    assert late["modes"]["lossless"]["parted"] == bench.IDENTICAL_STEPS + 1
    assert late["modes"]["lossless"]["verdict"] == "pass"
    diverged = [list(c) for c in off]
    diverged[2] = diverged[2][:bench.IDENTICAL_STEPS + 1] + [(s, t, 0.0, loss) for s, t, _, loss in
                                                            diverged[2][bench.IDENTICAL_STEPS + 1:]]
    assert judge({"off": off, "lossless": diverged}, STEPS)["modes"]["lossless"]["verdict"] == "fail"
    assert judge({"off": off, "lossless": changed(3, d_loss=2e-5)}, STEPS)["modes"]["lossless"]["verdict"] == "fail"
    assert judge({"off": off, "lossless": changed(3, d_loss=5e-6)}, STEPS)["modes"]["lossless"]["verdict"] == "pass"
    # a step one run never logged differs
    short = [list(c) for c in off]
    short[0] = short[0][:-1]
    assert not judge({"off": off, "lossless": short}, STEPS)["modes"]["lossless"]["identity"][-1]["equal"]


def test_the_printed_check_names_verdicts_and_lossless_differences():
    off = [learning(s) for s in range(3)]
    runs = [list(c) for c in off]
    s, t, r, loss = runs[0][4]
    runs[0][4] = (s, t, r + 0.25, loss)
    check = judge({"off": off, "lossless": runs, "one-step": [learning(10 + s, lag=1) for s in range(3)]}, STEPS)
    out = io.StringIO()
    bench.write_check(check, STEPS, out)
    text = out.getvalue()
    assert "last 10 of 30 steps" in text and "equal at 29 of 30 steps" in text
    assert "max |reward diff| 0, max |loss diff| 0 before step 5, where the runs parted" in text
    assert any(line.split() == ["5", "0", "0.25", "0"] for line in text.splitlines())  # step, seed, diffs
    assert "lossless" in text and "FAIL" in text and "PASS" in text and text.rstrip().endswith("(exit 1)")


def test_options_are_one_error(tmp_path):
    with pytest.raises(OgrpoError, match="--seeds"):
        run_overlap_bench(seeds=0, workdir=str(tmp_path))
    with pytest.raises(OgrpoError, match="--steps"):
        run_overlap_bench(steps=1, workdir=str(tmp_path))
    for modes, broken, match in (("lossless,one-step", None, "include off"), ("off,two-step", None, "not a mode"),
                                 ("off,off", None, "twice"), ("off,lossless", "no-correction", "include one-step"),
                                 ("off,one-step", "no-clip", "one of no-correction")):
        with pytest.raises(OgrpoError, match=match):
            run_overlap_bench(modes=modes, broken=broken, workdir=str(tmp_path))
    assert bench.parse_modes("one-step, off", None) == ["off", "one-step"]  # off first: the reference


def test_the_command_exits_with_the_verdict(monkeypatch):
    from ogrpo.commands.serving import bench_overlap

    seen = {}
    for verdict, code in bench.EXIT.items():
        monkeypatch.setattr(bench, "run_overlap_bench", lambda **kw: seen.update(kw) or {"exit_code": code})
        with pytest.raises(typer.Exit) as exc:
            bench_overlap(seeds=3, steps=30, modes="off,one-step", broken="no-correction", csv="c", png="p",
                          workdir=None)
        assert exc.value.exit_code == code
    assert seen["broken"] == "no-correction" and seen["modes"] == "off,one-step"


def test_the_broken_plan_is_the_benchs_own(tmp_path):
    from ogrpo.bench.jobs import split_plan

    _, plan = split_plan(tmp_path, "p", bench.recipe(2, 0), "one-step")
    before = plan.to_dict()
    broken = bench.broken_plan(plan, "no-correction")
    assert plan.to_dict() == before  # the planner's plan is untouched
    assert plan.trainer_args.values[bench.CORRECTION] is True  # the planner turns it on for one-step
    assert broken.trainer_args.values[bench.CORRECTION] is False and broken.old_policy_pass == "none"
    change = broken.change(bench.CORRECTION)
    assert (change.old, change.new) == (True, False) and "--broken no-correction" in change.reason
    assert "--broken no-correction" in broken.reason_of(bench.CORRECTION)


@pytest.mark.slow
def test_runs_every_mode_and_the_broken_one_and_writes_table_csv_png(tmp_path):
    out = io.StringIO()
    res = run_overlap_bench(seeds=1, steps=2, broken="no-correction", workdir=str(tmp_path / "w"),
                            csv_path=str(tmp_path / "o.csv"), png_path=str(tmp_path / "o.png"), out=out)
    text = out.getvalue()
    modes = ("off", "lossless", "one-step/no-correction")
    assert "at step" in text and "at time s" in text and "one seed" in text
    rows = list(csv.DictReader(open(tmp_path / "o.csv")))
    assert {(r["mode"], r["step"]) for r in rows} == {(m, s) for m in modes for s in ("1", "2")}
    assert all(0 <= float(r["reward"]) <= 1 and float(r["time_s"]) > 0 and r["loss"] for r in rows)
    # the table's numbers are the curves' (one seed: the value itself)
    for mode in modes:
        last = next(float(r["reward"]) for r in rows if r["mode"] == mode and r["step"] == "2")
        assert res["steps"][mode][-1][0] == pytest.approx(last)
        assert f"{last:.3f}" in text
    # lossless trains on off's samples: the same rewards and losses, step by step
    check = res["check"]
    assert [r["equal"] for r in check["modes"]["lossless"]["identity"]] == [True, True]
    assert check["modes"]["one-step/no-correction"]["verdict"] == "inconclusive"  # one seed, two steps
    assert check["verdict"] == "inconclusive" and res["exit_code"] == 4
    # the switch reached the trainer: the broken run's manifest says the correction was off
    manifests = {p.parent.parent.name: json.loads(p.read_text()) for p in (tmp_path / "w").glob("*/run/manifest.json")}
    broken = manifests["one-step-no-correction-seed0-job"]
    assert broken["overlap"]["importance_sampling_correction"] is False and broken["overlap"]["mode"] == "one-step"
    assert any(c["key"] == bench.CORRECTION and c["to"] is False for c in broken["plan"]["changes"])
    assert manifests["lossless-seed0-job"]["overlap"]["mode"] == "lossless"
    assert (tmp_path / "o.png").stat().st_size > 1000
    assert mentioning(str(tmp_path / "w")) == []  # no server or trainer outlives its run


def test_a_failed_job_ends_the_bench_in_one_line(tmp_path, monkeypatch):
    """A job that fails inside a bench is the launcher's one-line error (exit 1) naming its logs, not a traceback."""
    from error_checks import one_line_error
    from ogrpo.bench import jobs
    from ogrpo.bench.overlap import recipe
    from ogrpo.errors import LaunchError

    monkeypatch.setattr(jobs, "run_local", lambda job_dir: 3)
    err = one_line_error(jobs.run_split_job, tmp_path, "off-seed0", recipe(2, 0), "off", error=LaunchError,
                         match=r"the job failed \(exit 3\); see .*run/logs")
    assert err.exit_code == 1
