"""`ogrpo bench step`: the same GRPO steps two ways, side by side in one run — plain TRL with its defaults
(what `trl grpo` does with the same recipe keys) and O-GRPO's plan for this machine (its kernels, its
rollout path, its settings) — and per-stage seconds, peak memory and the ratios.

`--placement split` runs the split placement instead (`--gpus 2xcpu`: a vLLM server on one core, the trainer on
the other, as on a 3xA40 node) once per `ogrpo.overlap` mode (off, lossless, one-step), each a real local job
(`ogrpo serve` + `ogrpo train` under the supervisor), and reports each mode's step time over `off`'s and over the
ideal overlap of the same run (max(server busy, trainer busy) per step, from the profiler's timeline), and each
device set's idle share. Numbers from a machine other helpers or jobs share are not benchmarks: quote them only
from a quiet machine.

Same model (random Qwen2 weights of the given shape, word-level tokenizer), same prompts, reward, seed and
dtype. Each path runs in a fresh subprocess so its peak resident memory is its own; both carry O-GRPO's stage
profiler (ogrpo/train/profiler.py), which only measures. The first step is a warm-up (allocations, compile
caches, engine start) and is left out of the medians.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from ogrpo.bench.harness import append_rows, environment_tags, format_table, make_row
from ogrpo.bench.rollout import RolloutShape, build_model, make_prompts
from ogrpo import dtypes
from ogrpo.errors import OgrpoError

PATHS = ("trl", "ogrpo")
SPLIT_PATHS = ("split-off", "split-lossless", "split-one-step")  # "split-" + an ogrpo.overlap mode
PLACEMENTS = {"single": PATHS, "split": SPLIT_PATHS}
STAGES = ("generation", "reward", "logprobs", "train", "step")
_DTYPES = {p: dtypes.torch_name(p) for p in ("fp32", "bf16")}


def token_reward(completions, **kwargs) -> list[float]:
    """Share of even-numbered tokens ("t2", "t4", ...) in each completion: dense, cheap, learnable."""
    out = []
    for text in completions:
        toks = str(text).split()
        out.append(sum(1 for t in toks if t[1:].isdigit() and int(t[1:]) % 2 == 0) / max(1, len(toks)))
    return out


def recipe(model_dir: str, data: str, *, steps: int, prompts: int, generations: int, new_tokens: int,
           dtype: str, seed: int) -> dict:
    """The TRL recipe both paths run (TRL's flat format)."""
    return {"model_name_or_path": model_dir, "dataset_name": data, "reward_funcs": ["ogrpo.bench.step:token_reward"],
            "seed": seed, "learning_rate": 1e-5, "beta": 0.04, "num_generations": generations,
            "per_device_train_batch_size": prompts * generations, "max_completion_length": new_tokens,
            "max_steps": steps, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
            "temperature": 1.0, "dtype": dtype}


def _run_trl(workdir: Path, rec: dict) -> None:
    """Plain TRL: GRPOConfig from the recipe keys with TRL's defaults for everything else."""
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from ogrpo.train.profiler import StageProfiler

    keys = {k: v for k, v in rec.items() if k not in ("model_name_or_path", "dataset_name", "reward_funcs", "dtype")}
    args = GRPOConfig(output_dir=str(workdir / "trl-out"), use_cpu=True, bf16=rec["dtype"] == "bfloat16",
                      model_init_kwargs={"dtype": rec["dtype"]}, **{**keys, "report_to": []})
    tok = AutoTokenizer.from_pretrained(rec["model_name_or_path"])
    ds = datasets.load_dataset("json", data_files=rec["dataset_name"], split="train")
    trainer = GRPOTrainer(model=rec["model_name_or_path"], reward_funcs=[token_reward], args=args, train_dataset=ds,
                          processing_class=tok)
    StageProfiler(workdir / "trl-profile.jsonl").attach(trainer)
    trainer.train()


def _run_ogrpo(workdir: Path, rec: dict) -> None:
    """O-GRPO: the same recipe through `ogrpo train`, planned for this machine."""
    cfg = workdir / "ogrpo-recipe.yaml"
    cfg.write_text(yaml.safe_dump({**rec, "ogrpo": {"gpus": "cpu"}}))
    out = workdir / "ogrpo-run"
    cmd = [sys.executable, "-m", "ogrpo", "train", "--config", str(cfg), "--output-dir", str(out), "--gpus", "cpu"]
    with open(workdir / "ogrpo-train.log", "wb") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError(f"ogrpo train failed (exit {rc}); see {workdir / 'ogrpo-train.log'}")
    os.replace(out / "profile.jsonl", workdir / "ogrpo-profile.jsonl")


def _run_split(workdir: Path, rec: dict, mode: str) -> None:
    """The split placement with `ogrpo.overlap: mode`: planned for 2xcpu, rendered and run as a local job."""
    from ogrpo.config import load_run_config
    from ogrpo.jobspec import build_jobspec
    from ogrpo.launch.local import run_local
    from ogrpo.plan import plan_from_config
    from ogrpo.render import render_job, write_job

    cfg = workdir / f"split-{mode}-recipe.yaml"
    cfg.write_text(yaml.safe_dump({**rec, "ogrpo": {"gpus": "2xcpu", "use_vllm": True, "overlap": mode}}))
    rc = load_run_config(str(cfg))
    plan = plan_from_config(rc, gpus="2xcpu")
    job = workdir / f"split-{mode}-job"
    spec = build_jobspec(plan, rc, str(job))
    write_job(render_job(plan, rc, spec), str(job))
    (job / "jobspec.json").write_text(json.dumps(spec.to_dict(), indent=2) + "\n")
    code = run_local(str(job))
    if code != 0:
        raise RuntimeError(f"split placement, overlap {mode}: the job failed (exit {code}); see {job / 'run' / 'logs'}")
    os.replace(job / "run" / "profile.jsonl", workdir / f"split-{mode}-profile.jsonl")


def summarize(rows: list[dict]) -> dict[str, float]:
    """Median seconds per stage over the steps after the first, and the peak memory of the run (GiB)."""
    timed = rows[1:] or rows
    out = {s: statistics.median(r.get(f"{s}_s", 0.0) for r in timed) for s in STAGES}
    out["peak_gib"] = max(r.get("peak_mem_gib", 0.0) for r in rows)
    out["tokens_per_s"] = statistics.median(r.get("tokens_per_s", 0.0) for r in timed)
    # the paths need not score the same number of times per step (vLLM's importance-sampling correction scores
    # the old policy as well as the reference model): seconds per pass compare the log-prob code itself
    out["logprob_passes"] = statistics.median(r.get("logprob_passes", 0) for r in timed)
    out["logprobs_per_pass"] = out["logprobs"] / out["logprob_passes"] if out["logprob_passes"] else 0.0
    split = [r for r in timed if isinstance(r.get("idle_share"), dict)]
    if split:  # the split placement: each device set's idle share, and the step an ideal overlap would take
        out["server_idle"] = statistics.median(r["idle_share"]["server"] for r in split)
        out["trainer_idle"] = statistics.median(r["idle_share"]["trainer"] for r in split)
        out["ideal_step"] = statistics.median(max(r["server_busy_s"], r["step_s"] - r["trainer_wait_s"])
                                              for r in split)
    return out


def split_ratios(results: dict) -> dict[str, float]:
    """Each overlap mode's step over `off`'s (< 1: faster) and over the ideal overlap of its own run (1: ideal)."""
    out = {}
    off = results.get("split-off", {}).get("step")
    for path, res in results.items():
        mode = path.removeprefix("split-")
        if off and path != "split-off":
            out[f"{mode}_step_over_off"] = res["step"] / off
        if res.get("ideal_step"):
            out[f"{mode}_step_over_ideal"] = res["step"] / res["ideal_step"]
    return out


def ratios(trl: dict, ours: dict) -> dict[str, float]:
    """TRL's seconds (or GiB) over O-GRPO's: > 1 means O-GRPO is faster (or smaller)."""
    out = {f"{s}_speedup": trl[s] / ours[s] for s in (*STAGES, "logprobs_per_pass")
           if ours.get(s, 0) > 0 and trl.get(s, 0) > 0}
    if ours.get("peak_gib"):
        out["memory_ratio"] = ours["peak_gib"] / trl["peak_gib"]  # < 1: O-GRPO needs less
    return out


def run_step_bench(shape: RolloutShape, *, dtype: str = "fp32", steps: int = 4, prompts: int = 4,
                   generations: int = 8, new_tokens: int = 64, prompt_tokens: int = 32, seed: int = 42,
                   csv_path: str = "bench/results/step.csv", png_path: str | None = "bench/results/step.png",
                   workdir: str | None = None, out=None, placement: str = "single") -> dict:
    out = out or sys.stdout
    if placement not in PLACEMENTS:
        raise OgrpoError(f"--placement {placement!r}: use single or split")
    paths = PLACEMENTS[placement]
    if dtype not in _DTYPES:
        raise OgrpoError(f"--dtype {dtype!r}: use fp32 or bf16")
    if steps < 2:
        raise OgrpoError("--steps must be at least 2 (the first step is a warm-up)")
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="ogrpo-bench-step-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(shape, _DTYPES[dtype], work / f"model-{shape.hidden}-{shape.layers}-{shape.vocab}")
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": " ".join(f"t{i}" for i in p)}) + "\n"
                            for p in make_prompts(64, prompt_tokens, shape.vocab, seed)))
    rec = recipe(str(model_dir), str(data), steps=steps, prompts=prompts, generations=generations,
                 new_tokens=new_tokens, dtype=_DTYPES[dtype], seed=seed)
    (work / "recipe.json").write_text(json.dumps(rec))
    results = {}
    for path in paths:
        out.write(f"running {path} ...\n")
        out.flush()
        rc = subprocess.call([sys.executable, "-m", "ogrpo.bench.step", path, str(work)],
                             stdout=subprocess.DEVNULL, stderr=open(work / f"{path}.log", "wb"))
        if rc != 0:
            raise OgrpoError(f"bench path {path} failed (exit {rc}); see {work / f'{path}.log'}")
        rows = [json.loads(x) for x in (work / f"{path}-profile.jsonl").read_text().splitlines()]
        results[path] = summarize(rows)
    r = ratios(results["trl"], results["ogrpo"]) if placement == "single" else split_ratios(results)
    header = ["path", *[f"{s} s" for s in STAGES], "passes", "s/pass", "tok/s", "peak GiB"]
    table = [[p, *[f"{results[p][s]:.3f}" for s in STAGES], f"{results[p]['logprob_passes']:g}",
              f"{results[p]['logprobs_per_pass']:.3f}", f"{results[p]['tokens_per_s']:.0f}",
              f"{results[p]['peak_gib']:.2f}"] for p in paths]
    if placement == "split":
        header += ["server idle", "trainer idle", "ideal s"]
        for row, p in zip(table, paths):
            row += [f"{100 * results[p]['server_idle']:.0f}%", f"{100 * results[p]['trainer_idle']:.0f}%",
                    f"{results[p]['ideal_step']:.3f}"]
    out.write(f"\nGRPO step, {shape.label()} {dtype}, {prompts} prompts x {generations} generations x {new_tokens} "
              f"tokens, {placement} placement, median of steps 2..{steps}:\n" + format_table(header, table) + "\n")
    for name, value in r.items():
        out.write(f"{name}: {value:.3f}\n")
    tags = environment_tags()
    case = f"{shape.label()} {dtype} {prompts}x{generations}x{new_tokens}" + (" split" if placement == "split" else "")
    csv_rows = [make_row("step", case, p, f"{s}_s", results[p][s], "s", str(shape.params()), tags)
                for p in paths for s in STAGES]
    csv_rows += [make_row("step", case, p, "peak_mem", results[p]["peak_gib"], "GiB", str(shape.params()), tags)
                 for p in paths]
    csv_rows += [make_row("step", case, p, "logprobs_per_pass_s", results[p]["logprobs_per_pass"], "s",
                          str(shape.params()), tags) for p in paths]
    csv_rows += [make_row("step", case, p, f"{lane}_idle_share", results[p][f"{lane}_idle"], "share",
                          str(shape.params()), tags) for p in paths for lane in ("server", "trainer")
                 if f"{lane}_idle" in results[p]]
    csv_rows += [make_row("step", case, "ratio", k, v, "x", str(shape.params()), tags) for k, v in r.items()]
    out.write(f"csv: {append_rows(csv_path, csv_rows)}\n")
    if png_path:
        out.write(f"png: {_plot(results, case, Path(png_path), paths)}\n")
    return {"results": results, "ratios": r}


def _plot(results: dict, title: str, path: Path, paths=PATHS) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [s for s in STAGES if s != "step"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.76 / len(paths)
    for i, p in enumerate(paths):
        ax.bar([x + (i - (len(paths) - 1) / 2) * width for x in range(len(stages))], [results[p][s] for s in stages],
               width,
               label=f"{p} (step {results[p]['step']:.2f} s, peak {results[p]['peak_gib']:.2f} GiB)")
    ax.set_xticks(range(len(stages)), stages)
    ax.set_ylabel("seconds per step (median)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":  # worker entry: python -m ogrpo.bench.step PATH WORKDIR
    from ogrpo.launch.teardown import exit_on_signals

    _work = Path(sys.argv[2])
    _rec = json.loads((_work / "recipe.json").read_text())
    with exit_on_signals():
        if sys.argv[1].startswith("split-"):
            _run_split(_work, _rec, sys.argv[1].removeprefix("split-"))
        else:
            (_run_trl if sys.argv[1] == "trl" else _run_ogrpo)(_work, _rec)
