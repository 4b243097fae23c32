"""`ogrpo bench overlap`: a quality check of `ogrpo.overlap` that can fail.

Trains the `tiny` demo recipe (ogrpo/recipes/tiny.yaml: its reward rises from about 0.3 to above 0.9 within 30
steps) on the split placement (`--gpus 2xcpu`, each run a real local job: `ogrpo serve` and the trainer) with
`off`, `lossless` and `one-step`, N seeds each (seed i is the same in every mode), and prints the mean ± std over
seeds of the reward at fixed steps and at fixed wall-clock times (seconds of training, summed from the
profiler's step times: server start-up is not in them). Writes the curves as CSV (one row per mode, seed and
step) and a reward-vs-time plot. The check (`judge`):

- `lossless` equals `off` step by step: the same seeds give the same samples by design, so every (seed, step)'s
  reward must match to REWARD_TOL and its logged loss to LOSS_TOL through step IDENTICAL_STEPS. Its per-group
  log-prob passes round differently from the batch's (the loss differs by about 1e-7); over many updates that
  rounding can grow until a sampled token flips and the runs part (measured: one seed of three at step 24, the
  others never in 30 steps). A bug (other seeds, weights, prompts or groups) shows at step 1 or 2. Runs that part
  later are judged as the other modes are;
- `off` must learn, or nothing can be judged: its final reward (the mean over the last third of the steps) must
  rise over step 1's (the untrained policy's, the same in every mode) by MIN_RISE and by Z standard errors, else
  the verdict is "inconclusive";
- every other mode must be shown to learn as well as `off` (non-inferiority): its mean final reward minus off's,
  less Z standard errors of that difference, must stay above -MARGIN x off's rise. A mode whose seeds scatter
  cannot show that, and fails: with 3 seeds, one diverged seed widens the standard error enough to hide itself
  from a test that fails only a mode shown to be worse.

`--broken no-correction` runs `one-step` with TRL's importance-sampling correction off (`broken_plan`): an
off-policy bug the check must catch.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

from ogrpo.bench.harness import environment_tags, save_figure
from ogrpo.bench.jobs import run_split_job
from ogrpo.errors import OgrpoError
from ogrpo.launch.run_state import read_jsonl
from ogrpo.planner.types import Change, Setting, TrainerArgs
from ogrpo.tables import format_table

MODES = ("off", "lossless", "one-step")
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"
CSV_COLUMNS = ["mode", "seed", "step", "time_s", "reward", "loss"]

# The check's constants. Rewards are tiny_letter's (0 to 1).
Z = 2.0  # standard errors: about a 95% one-sided bound; a t quantile at 2 degrees of freedom (2.92) would ask
# for seeds a 2-core machine cannot afford
MIN_RISE = 0.1  # off's final reward over its first step's, below which off has not learned enough to judge by
MARGIN = 0.2  # the share of off's rise a mode may lose and still pass
REWARD_TOL, LOSS_TOL = 1e-6, 1e-5  # lossless vs off per step (the loss: the per-group passes round differently)
IDENTICAL_STEPS = 10  # lossless must equal off through this step (its runs parted at step 24 at the earliest)
EXIT = {"pass": 0, "fail": 1, "inconclusive": 4}

# --broken: a deliberately broken one-step, only ever made here (ogrpo/planner/settings.py turns the correction on
# for every one-step plan a user gets, and lists it as a change where the recipe turned it off)
CORRECTION = "vllm_importance_sampling_correction"
BROKEN = {"no-correction": "TRL's importance-sampling correction off: samples one policy version old train as if "
                           "the current policy had drawn them"}


def recipe(steps: int, seed: int) -> dict:
    rec = yaml.safe_load(RECIPE.read_text())
    rec.update(max_steps=steps, seed=seed, save_strategy="no")
    return rec


def broken_plan(plan, broken: str):
    """`plan` (a one-step plan) with `broken` applied, named in its settings and changes so the run's manifest
    says what was broken and by whom."""
    if broken not in BROKEN:
        raise OgrpoError(f"--broken {broken!r}: one of {', '.join(BROKEN)}")
    why = f"ogrpo bench overlap --broken {broken}: {BROKEN[broken]} (a deliberately broken run)"
    # TRL then runs no old-policy pass (the steps are aligned): what the plan's old_policy_pass says for such runs
    replaced = {CORRECTION: False, "old_policy_pass": "none"}
    settings = [s for s in plan.settings if s.name not in replaced] + [Setting(k, v, why) for k, v in replaced.items()]
    return dataclasses.replace(plan, trainer_args=TrainerArgs({**plan.trainer_args.to_dict(), CORRECTION: False}),
                               settings=settings,
                               changes=[*plan.changes, Change(CORRECTION, plan.trainer_args.values.get(CORRECTION),
                                                              False, why)])


def curve(run: Path) -> list[tuple[int, float, float, float | None]]:
    """(step, seconds of training at its end, reward, loss) from a run directory's metrics and profile."""
    logged = {m["step"]: m for m in read_jsonl(run / "metrics.jsonl") if m.get("reward") is not None}
    out, t = [], 0.0
    for row in sorted(read_jsonl(run / "profile.jsonl"), key=lambda r: r["step"]):
        t += row["step_s"]
        if row["step"] in logged:
            m = logged[row["step"]]
            out.append((row["step"], t, m["reward"], m.get("loss")))
    return out


def at_step(points: list[tuple], step: int) -> float | None:
    return next((p[2] for p in points if p[0] == step), None)


def at_time(points: list[tuple], t: float) -> float | None:
    """The reward of the last step finished by `t` seconds (None before the first)."""
    done = [p[2] for p in points if p[1] <= t + 1e-9]
    return done[-1] if done else None


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (NaN with one value: one seed says nothing about the spread)."""
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else float("nan")


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (NaN with one value)."""
    m, sd = mean_std(values)
    return m, sd / math.sqrt(len(values)) if values else float("nan")


def summarize(curves: dict[str, list[list[tuple]]], steps: list[int], times: list[float]) -> dict:
    """{"steps": {mode: [(mean, std) per step]}, "times": {mode: [(mean, std) per time]}}."""
    out: dict = {"steps": {}, "times": {}}
    for mode, runs in curves.items():
        out["steps"][mode] = [mean_std([v for v in (at_step(c, s) for c in runs) if v is not None]) for s in steps]
        out["times"][mode] = [mean_std([v for v in (at_time(c, t) for c in runs) if v is not None]) for t in times]
    return out


def final_steps(steps: int) -> int:
    """How many of the last steps the final reward averages: the last third (a plateau's noise averages out)."""
    return max(1, steps // 3)


def final_reward(points: list[tuple], k: int) -> float:
    return statistics.fmean(p[2] for p in points[-k:])


def identity(off: list[list[tuple]], other: list[list[tuple]]) -> list[dict]:
    """Per step, over the seeds (seed i of one mode against seed i of the other): the largest |reward difference|
    and |loss difference|, the seeds that differ beyond REWARD_TOL / LOSS_TOL, and whether none does. A step one
    run lacks differs."""
    out = []
    for step in sorted({p[0] for runs in (off, other) for c in runs for p in c}):
        reward, loss, differ = 0.0, 0.0, list(range(min(len(off), len(other)), max(len(off), len(other))))
        for seed, (a, b) in enumerate(zip(off, other)):
            pa, pb = (next((p for p in c if p[0] == step), None) for c in (a, b))
            la, lb = (p[3] if p is not None and len(p) > 3 else None for p in (pa, pb))
            if pa is None or pb is None or (la is None) != (lb is None):
                differ.append(seed)
                continue
            d_reward, d_loss = abs(pa[2] - pb[2]), abs(la - lb) if la is not None else 0.0
            reward, loss = max(reward, d_reward), max(loss, d_loss)
            if d_reward > REWARD_TOL or d_loss > LOSS_TOL:
                differ.append(seed)
        out.append({"step": step, "reward_diff": reward, "loss_diff": loss, "seeds": sorted(differ),
                    "equal": not differ})
    return out


def parted(rows: list[dict]) -> int | None:
    """The first step of `identity`'s rows that differs, else None."""
    return next((r["step"] for r in rows if not r["equal"]), None)


def judge(curves: dict[str, list[list[tuple]]], steps: int) -> dict:
    """The check on curves of (step, time, reward[, loss]) per mode and seed, `off` among them; seed i at the same
    index in every mode. {"k", "start", "rise": (mean, se), "off": why-or-None (None: off learns), "modes": {mode:
    {...,"verdict"}}, "verdict": pass | fail | inconclusive}."""
    k = final_steps(steps)
    off = curves["off"]
    start = statistics.fmean(c[0][2] for c in off)
    rise, rise_se = mean_se([final_reward(c, k) - c[0][2] for c in off])
    off_final = mean_se([final_reward(c, k) for c in off])
    if len(off) < 2:
        unjudged = "one seed: no spread to judge by (give --seeds 2 or more)"
    elif rise < MIN_RISE or not rise > Z * rise_se:
        unjudged = (f"off did not learn clearly: its final reward rose {rise:+.3f} ± {rise_se:.3f} (SE) over step 1's,"
                    f" under {MIN_RISE:g} or {Z:g} SE")
    else:
        unjudged = None
    margin = MARGIN * rise
    modes: dict = {}
    for mode, runs in curves.items():
        if mode == "off":
            continue
        fin = mean_se([final_reward(c, k) for c in runs])
        diff = fin[0] - off_final[0]
        lower = diff - Z * math.hypot(off_final[1], fin[1]) if len(runs) > 1 and len(off) > 1 else float("nan")
        row = {"final": fin, "diff": diff, "lower": lower, "margin": margin}
        quality = "inconclusive" if unjudged else "pass" if lower >= -margin else "fail"
        if mode == "lossless":  # a run identical to off passes whatever off learned
            row["identity"] = identity(off, runs)
            row["parted"] = parted(row["identity"])
            row["verdict"] = ("pass" if row["parted"] is None else "fail" if row["parted"] <= IDENTICAL_STEPS
                              else quality)
        else:
            row["verdict"] = quality
        modes[mode] = row
    verdicts = {row["verdict"] for row in modes.values()}
    verdict = "fail" if "fail" in verdicts else "inconclusive" if "inconclusive" in verdicts else "pass"
    return {"k": k, "start": start, "rise": (rise, rise_se), "final_off": off_final, "off": unjudged,
            "modes": modes, "verdict": verdict}


def parse_modes(text: str, broken: str | None) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise OgrpoError(f"--modes {text!r}: {', '.join(bad)} is not a mode; give a comma list of {', '.join(MODES)}")
    if "off" not in modes:
        raise OgrpoError(f"--modes {text!r}: the check compares every mode with off; include off")
    if len(set(modes)) != len(modes):
        raise OgrpoError(f"--modes {text!r}: a mode is named twice")
    if broken is not None and broken not in BROKEN:
        raise OgrpoError(f"--broken {broken!r}: one of {', '.join(BROKEN)}")
    if broken is not None and "one-step" not in modes:
        raise OgrpoError(f"--broken {broken} breaks one-step; include one-step in --modes")
    return [m for m in MODES if m in modes]  # off first: every later mode is compared with it


def label(mode: str, broken: str | None) -> str:
    return f"{mode}/{broken}" if broken and mode == "one-step" else mode


def _fmt(ms: tuple[float, float]) -> str:
    m, s = ms
    if math.isnan(m):
        return "-"  # no run had logged a reward by then
    return f"{m:.3f}" + ("" if math.isnan(s) else f" ± {s:.3f}")


def run_overlap_bench(*, seeds: int = 3, steps: int = 30, modes: str = ",".join(MODES), broken: str | None = None,
                      workdir: str | None = None, csv_path: str = "bench/results/overlap.csv",
                      png_path: str = "bench/results/overlap.png", out=None) -> dict:
    out = out or sys.stdout
    if seeds < 1:
        raise OgrpoError(f"--seeds {seeds}: give at least 1")
    if steps < 2:
        raise OgrpoError(f"--steps {steps}: give at least 2")
    chosen = parse_modes(modes, broken)
    labels = [label(m, broken) for m in chosen]
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="ogrpo-bench-overlap-"))
    work.mkdir(parents=True, exist_ok=True)
    curves: dict[str, list] = {name: [] for name in labels}
    rows = []
    for seed in range(seeds):
        for mode, name in zip(chosen, labels):  # alternating modes: load from other jobs falls on all alike
            out.write(f"running {name}, seed {seed} ...\n")
            out.flush()
            adjust = (lambda plan: broken_plan(plan, broken)) if name != mode else None
            run = run_split_job(work, f"{name.replace('/', '-')}-seed{seed}", recipe(steps, seed), mode, adjust)
            points = curve(run)
            if not points:
                raise OgrpoError(f"{name}, seed {seed}: the run logged no reward; see {work}")
            curves[name].append(points)
            rows += [{"mode": name, "seed": seed, "step": s, "time_s": round(t, 4), "reward": r, "loss": loss}
                     for s, t, r, loss in points]
    at_steps = sorted({max(1, round(steps * f)) for f in (0.25, 0.5, 0.75, 1.0)})
    horizon = min(c[-1][1] for runs in curves.values() for c in runs)  # every run has reached it
    at_times = [round(horizon * f, 2) for f in (0.25, 0.5, 0.75, 1.0)]
    summary = summarize(curves, at_steps, at_times)
    check = judge(curves, steps)
    tags = environment_tags()
    out.write(f"\nreward of tiny on the split placement (2xcpu), {seeds} seed(s) per mode, mean ± std "
              f"({tags['device']}):\n")
    out.write(format_table(["at step", *labels], [[str(s), *[_fmt(summary["steps"][m][i]) for m in labels]]
                                                  for i, s in enumerate(at_steps)]) + "\n\n")
    out.write(format_table(["at time s", *labels], [[f"{t:g}", *[_fmt(summary["times"][m][i]) for m in labels]]
                                                    for i, t in enumerate(at_times)]) + "\n")
    write_check(check, steps, out)
    path = Path(csv_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    out.write(f"csv: {path}\npng: {_plot(curves, summary, at_times, Path(png_path))}\n")
    result = {"curves": curves, "at_steps": at_steps, "at_times": at_times, **summary, "check": check,
              "exit_code": EXIT[check["verdict"]]}
    (work / "summary.json").write_text(json.dumps({k: v for k, v in result.items() if k != "curves"}, indent=1))
    return result


def write_check(check: dict, steps: int, out) -> None:
    k, (rise, rise_se) = check["k"], check["rise"]
    out.write(f"\nquality: final reward = mean over the last {k} of {steps} steps, mean ± SE over seeds; off from "
              f"{check['start']:.3f} at step 1 to {_fmt(check['final_off'])} (rise {rise:+.3f} ± {rise_se:.3f}); "
              f"a mode passes if (its final - off's) - {Z:g} SE >= -{MARGIN:g} x off's rise "
              f"(-{MARGIN * rise:.3f})\n")
    table = []
    for mode, row in check["modes"].items():
        lower = "-" if math.isnan(row["lower"]) else f"{row['lower']:+.3f}"
        table.append([mode, _fmt(row["final"]), f"{row['diff']:+.3f}", lower, row["verdict"].upper()])
    out.write(format_table(["mode", "final reward", "vs off", f"vs off - {Z:g} SE", "verdict"], table) + "\n")
    if check["off"]:
        out.write(f"inconclusive: {check['off']}\n")
    lossless = check["modes"].get("lossless")
    if lossless:
        steps_ = lossless["identity"]
        differ = [r for r in steps_ if not r["equal"]]
        first = lossless["parted"]
        before = [r for r in steps_ if first is None or r["step"] < first]
        where = "over every step" if first is None else f"before step {first}, where the runs parted"
        out.write(f"lossless vs off, step by step (seed by seed; reward to {REWARD_TOL:g}, loss to {LOSS_TOL:g}; "
                  f"equal through step {IDENTICAL_STEPS} required): equal at {len(steps_) - len(differ)} of "
                  f"{len(steps_)} steps; max |reward diff| {max((r['reward_diff'] for r in before), default=0):.3g}"
                  f", max |loss diff| {max((r['loss_diff'] for r in before), default=0):.3g} {where}\n")
        if differ:
            out.write(format_table(["step", "seeds", "max |reward diff|", "max |loss diff|"],
                                   [[str(r["step"]), ",".join(map(str, r["seeds"])), f"{r['reward_diff']:.3g}",
                                     f"{r['loss_diff']:.3g}"] for r in differ[:10]]) + "\n")
    out.write(f"verdict: {check['verdict'].upper()} (exit {EXIT[check['verdict']]})\n")


def _plot(curves: dict, summary: dict, at_times: list[float], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"off": "tab:blue", "lossless": "tab:green", "one-step": "tab:orange"}
    for mode in curves:
        color = colors.get(mode, "tab:red")  # red: a broken one-step
        for i, c in enumerate(curves[mode]):
            ax.plot([p[1] for p in c], [p[2] for p in c], color=color, alpha=0.35, lw=1,
                    label=f"{mode} (each seed)" if i == 0 else None)
        means = summary["times"][mode]
        ax.errorbar(at_times, [m for m, _ in means], yerr=[0 if math.isnan(s) else s for _, s in means],
                    color=color, marker="o", capsize=3, lw=2, label=f"{mode}: mean ± std")
    ax.set_xlabel("seconds of training (sum of step times)")
    ax.set_ylabel("reward")
    return save_figure(fig, ax, f"tiny, split placement (2xcpu): {', '.join(curves)}", path)
