"""`ogrpo bench step`: the same GRPO steps two ways, side by side in one run — plain TRL with its defaults
(what `trl grpo` does with the same recipe keys) and O-GRPO's plan for this machine (its kernels, its
rollout path, its settings) — and per-stage seconds, peak memory and the ratios.

`--placement split` runs the split placement instead (`--gpus 2xcpu`: a vLLM server on one core, the trainer on
the other, as on a 3xA40 node) once per `ogrpo.overlap` mode (off, lossless, one-step), each a real local job
(`ogrpo serve` + `ogrpo train` under the supervisor), and once as plain TRL's own server mode on the same split
(`split-trl`, the anchor: ogrpo/bench/trl_server.py). Completions end at an end token the random model emits
now and then (`stop_every`), so their lengths vary as on a real task. It reports, per path: step time, server
busy and trainer busy seconds (from the profiler's timeline), the ideal overlap max(server busy, trainer busy)
per step and the step over it, the step over `off`'s and over plain TRL's, and the idle share of the
bottleneck device set (the busier one). `--shape generation-heavy` (256-token completions on a model whose
generation is at least 45 % of an `off` step here) sits beside the default shape. Numbers from a machine other
helpers or jobs share are not benchmarks: quote them only from a quiet machine.

Same model (random Qwen2 weights of the given shape, word-level tokenizer), same prompts, reward, seed and
dtype. Each path runs in a fresh subprocess so its peak resident memory is its own; both carry O-GRPO's stage
profiler (ogrpo/profile/profiler.py), which only measures. The first step is a warm-up (allocations, compile
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

from ogrpo import dtypes
from ogrpo.bench import trl_server
from ogrpo.bench.harness import append_rows, environment_tags, make_row, save_figure
from ogrpo.bench.jobs import run_split_job, split_plan
from ogrpo.bench.rollout import RolloutShape, build_model, check_counts, text_prompts
from ogrpo.bench.task import token_reward
from ogrpo.errors import LaunchError, OgrpoError
from ogrpo.hardware import parse_gpus
from ogrpo.launch.cpu_slots import SLOTS_ENV
from ogrpo.profile.hooks import profiled
from ogrpo.profile.profiler import StageProfiler, pad_shares, run_peak_gib
from ogrpo.tables import format_table

PATHS = ("trl", "ogrpo")
# "split-" + an ogrpo.overlap mode; split-trl: plain TRL's server mode on the same split (the anchor)
SPLIT_PATHS = ("split-trl", "split-off", "split-lossless", "split-one-step")
# two trainer processes (DDP, one core each, generating themselves): TRL's split of the batch between them against
# rows exchanged for even tokens (ogrpo/trainer/rank_balance.py), the same O-GRPO run otherwise
RANK_PATHS = ("ranks-trl-split", "ranks-balanced")
PLACEMENTS = {"single": PATHS, "split": SPLIT_PATHS, "ranks": RANK_PATHS}
STAGES = ("generation", "reward", "logprobs", "train", "step")
_DTYPES = {p: dtypes.torch_name(p) for p in ("fp32", "bf16")}
# Presets of `--shape`: model, batch and completion length (explicit options override them). default: the
# issue's 32.5M at 4x8x64; generation-heavy: 256-token completions on a model small enough that generation is
# at least GEN_HEAVY_SHARE of an `off` step on CPU (as reasoning tasks are on GPUs).
SHAPES = {
    "default": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 2, "intermediate": 2048, "vocab": 4096,
                "prompts": 4, "generations": 8, "tokens": 64},
    # generation about half of an `off` step on the split (55% measured), as on reasoning tasks; a smaller model
    # makes the step all generation, which no overlap can shorten below the server's own time
    "generation-heavy": {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 1024,
                         "vocab": 1024, "prompts": 2, "generations": 4, "tokens": 256},
    # completions that mostly end early, a few at the cap, as on reasoning tasks: end tokens at a rate that makes
    # the mean length `mean_share` of the cap, on both placements (the model's generation config lists them)
    "variable": {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 1024, "vocab": 1024,
                 "prompts": 4, "generations": 8, "tokens": 256, "mean_share": 0.35},
}
GEN_HEAVY_SHARE = 0.45


def expected_length(cap: int, rate: float) -> float:
    """Mean length of a completion that ends at each token with probability `rate`, or at `cap`: E[min(G, cap)]
    for G geometric on 1, 2, ... (the end token counts)."""
    return cap if rate <= 0 else (1 - (1 - rate) ** cap) / rate


def end_rate(vocab: int, every: int) -> float:
    """The share of the vocabulary `stop_tokens(vocab, every)` makes end tokens: the rate a random model, whose
    next token is near uniform, ends at."""
    return len(stop_tokens(vocab, every)) / vocab


def stop_every_for(cap: int, vocab: int, mean_share: float) -> int:
    """The `stop_every` whose end tokens give completions a mean length closest to `mean_share` of `cap`."""
    if not 0 < mean_share < 1:
        raise OgrpoError(f"mean_share {mean_share}: give a share of the completion cap between 0 and 1")
    return min(range(2, vocab + 1), key=lambda every: abs(expected_length(cap, end_rate(vocab, every)) / cap
                                                          - mean_share))


def stop_tokens(vocab: int, every: int) -> list[int]:
    """End tokens for the split placement: t0 (the tokenizer's EOS) and every `every`-th id, so that a random
    model ends a completion with probability about 1/every per token and lengths vary (geometrically)."""
    return list(range(0, vocab, max(2, every)))


def recipe(model_dir: str, data: str, *, steps: int, prompts: int, generations: int, new_tokens: int,
           dtype: str, seed: int, stops: list[int] | None = None) -> dict:
    """The TRL recipe every path runs (TRL's flat format); `stops`: end tokens vLLM stops at (split only:
    HF generate has no such sampling argument)."""
    extra = {"generation_kwargs": {"stop_token_ids": stops}} if stops else {}
    return {**extra, "model_name_or_path": model_dir, "dataset_name": data,
            "reward_funcs": ["ogrpo.bench.task:token_reward"], "seed": seed, "learning_rate": 1e-5, "beta": 0.04,
            "num_generations": generations,
            "per_device_train_batch_size": prompts * generations, "max_completion_length": new_tokens,
            "max_steps": steps, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
            "temperature": 1.0, "dtype": dtype}


def _run_trl(workdir: Path, rec: dict) -> None:
    """Plain TRL: GRPOConfig from the recipe keys with TRL's defaults for everything else."""
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    keys = {k: v for k, v in rec.items()
            if k not in ("model_name_or_path", "dataset_name", "reward_funcs", "dtype", "ogrpo")}
    on_cpu = rec.get("ogrpo", {}).get("gpus", "cpu") == "cpu"
    args = GRPOConfig(output_dir=str(workdir / "trl-out"), use_cpu=on_cpu, bf16=rec["dtype"] == "bfloat16",
                      model_init_kwargs={"dtype": rec["dtype"]}, **{**keys, "report_to": []})
    tok = AutoTokenizer.from_pretrained(rec["model_name_or_path"])
    ds = datasets.load_dataset("json", data_files=rec["dataset_name"], split="train")
    # plain TRL with only the profiler's layers: timed as O-GRPO's runs are
    trainer = profiled(GRPOTrainer)(model=rec["model_name_or_path"], reward_funcs=[token_reward], args=args, train_dataset=ds,
                          processing_class=tok)
    StageProfiler(workdir / "trl-profile.jsonl").attach(trainer)
    trainer.train()


def _run_ogrpo(workdir: Path, rec: dict) -> None:
    """O-GRPO: the same recipe through `ogrpo train`, planned for this machine."""
    cfg = workdir / "ogrpo-recipe.yaml"
    ogrpo = {"gpus": "cpu", **rec.get("ogrpo", {})}  # --gpus 1xH100 / --no-kernels (run_step_bench)
    cfg.write_text(yaml.safe_dump({**rec, "ogrpo": ogrpo}))
    out = workdir / "ogrpo-run"
    cmd = [sys.executable, "-m", "ogrpo", "train", "--config", str(cfg), "--output-dir", str(out),
           "--gpus", ogrpo["gpus"]]
    with open(workdir / "ogrpo-train.log", "wb") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        raise LaunchError(f"ogrpo train failed (exit {rc}); see {workdir / 'ogrpo-train.log'}")
    os.replace(out / "profile.jsonl", workdir / "ogrpo-profile.jsonl")


def _run_split_trl(workdir: Path, rec: dict) -> None:
    """Plain TRL's server mode on the same split, with the server memory O-GRPO's plan gives its own."""
    _, plan = split_plan(workdir, "split-trl", rec, "off")
    trl_server.run(workdir, rec, plan.vllm.args.to_dict(), workdir / "split-trl-profile.jsonl",
                   server_slots=plan.vllm.env.get(SLOTS_ENV), trainer_slots=plan.trainer.env.get(SLOTS_ENV))


def _run_split(workdir: Path, rec: dict, mode: str) -> None:
    """The split placement with `ogrpo.overlap: mode`: planned for 2xcpu, rendered and run as a local job."""
    run = run_split_job(workdir, f"split-{mode}", rec, mode)
    os.replace(run / "profile.jsonl", workdir / f"split-{mode}-profile.jsonl")


def _run_ranks(workdir: Path, rec: dict, path: str) -> None:
    """Two trainer processes under DDP on the two cores, TRL's split of each batch or the balanced one."""
    run = run_split_job(workdir, path, rec, "off", use_vllm=False, strategy="ddp",
                        rank_balance="auto" if path == "ranks-balanced" else "off")
    os.replace(run / "profile.jsonl", workdir / f"{path}-profile.jsonl")
    balance = json.loads((run / "manifest.json").read_text()).get("rank_balance") or {}
    (workdir / f"{path}-balance.json").write_text(json.dumps(balance) + "\n")


def summarize(rows: list[dict], warmups: int = 1) -> dict[str, float]:
    """Median seconds per stage over the steps after the first `warmups` rows, and the peak memory over all of
    them (GiB)."""
    timed = rows[warmups:] or rows
    out = {s: statistics.median(r.get(f"{s}_s", 0.0) for r in timed) for s in STAGES}
    out["peak_gib"] = run_peak_gib(rows)
    out["tokens_per_s"] = statistics.median(r.get("tokens_per_s", 0.0) for r in timed)
    # the paths need not score the same number of times per step (vLLM's importance-sampling correction scores
    # the old policy as well as the reference model): seconds per pass compare the log-prob code itself
    out["logprob_passes"] = statistics.median(r.get("logprob_passes", 0) for r in timed)
    out["logprobs_per_pass"] = out["logprobs"] / out["logprob_passes"] if out["logprob_passes"] else 0.0
    out["completion_len"] = (sum(r.get("completion_tokens", 0) for r in timed)
                             / max(1, sum(r.get("completions", 0) for r in timed)))
    shares = pad_shares(timed)  # the share of each kind of log-prob pass spent on padding
    out["pad_share_score"], out["pad_share_loss"] = shares.get("score", 0.0), shares.get("loss", 0.0)
    split = [r for r in timed if isinstance(r.get("idle_share"), dict)]
    if split:  # the split placement: each device set's busy seconds and idle share, and the ideal overlap
        out.update(lanes(split))
    return out


def pooled(runs: list[list[dict]]) -> dict[str, float]:
    """`summarize` over several runs of one path (rounds): each run's first step is its warm-up, every other step
    of every run counts once in the medians."""
    return summarize([run[0] for run in runs] + [r for run in runs for r in run[1:]], warmups=len(runs))


def lanes(rows: list[dict]) -> dict[str, float]:
    """Per split-placement step: the server busy (generating or receiving weights), the trainer busy (the step
    less its waits on the server), the ideal overlap max(server busy, trainer busy) and the step over it; medians
    over the steps, and the bottleneck (the busier set) with its median idle share. The step over its ideal is
    taken step by step, then the median: a ratio of two medians could pair one step's time with another's ideal."""
    server = [r["server_busy_s"] for r in rows]
    trainer = [r["step_s"] - r["trainer_wait_s"] for r in rows]
    ideal = [max(a, b) for a, b in zip(server, trainer)]
    out = {"server_busy": statistics.median(server), "trainer_busy": statistics.median(trainer),
           "ideal_step": statistics.median(ideal),
           "step_over_ideal": statistics.median(r["step_s"] / i for r, i in zip(rows, ideal) if i > 0),
           "server_idle": statistics.median(r["idle_share"]["server"] for r in rows),
           "trainer_idle": statistics.median(r["idle_share"]["trainer"] for r in rows)}
    out["bottleneck"] = "server" if out["server_busy"] >= out["trainer_busy"] else "trainer"
    out["bottleneck_idle"] = out[f"{out['bottleneck']}_idle"]
    return out


def split_ratios(results: dict) -> dict[str, float]:
    """Each path's step over `off`'s and over plain TRL's (< 1: faster), over the ideal overlap of its own run
    (1: ideal), and `off`'s generation share of its step (what the generation-heavy shape must reach)."""
    out = {}
    off = results.get("split-off", {}).get("step")
    trl = results.get("split-trl", {}).get("step")
    for path, res in results.items():
        mode = path.removeprefix("split-")
        if off and path != "split-off":
            out[f"{mode}_step_over_off"] = res["step"] / off
        if trl and path != "split-trl":
            out[f"{mode}_step_over_trl"] = res["step"] / trl
        if res.get("step_over_ideal"):
            out[f"{mode}_step_over_ideal"] = res["step_over_ideal"]
    if off:
        out["off_generation_share"] = results["split-off"]["generation"] / off
    return out


def ratios(trl: dict, ours: dict) -> dict[str, float]:
    """TRL's seconds (or GiB) over O-GRPO's: > 1 means O-GRPO is faster (or smaller)."""
    out = {f"{s}_speedup": trl[s] / ours[s] for s in (*STAGES, "logprobs_per_pass")
           if ours.get(s, 0) > 0 and trl.get(s, 0) > 0}
    if ours.get("peak_gib"):
        out["memory_ratio"] = ours["peak_gib"] / trl["peak_gib"]  # < 1: O-GRPO needs less
    return out


def preset(name: str, **given) -> tuple[RolloutShape, dict]:
    """(model shape, {prompts, generations, tokens}) of a `--shape` preset, with the options given (not None)
    taking precedence."""
    if name not in SHAPES:
        raise OgrpoError(f"--shape {name!r}: use one of {', '.join(SHAPES)}")
    values = {**SHAPES[name], **{k: v for k, v in given.items() if v is not None}}
    shape = RolloutShape(**{k: values[k] for k in ("hidden", "layers", "heads", "kv_heads", "intermediate",
                                                   "vocab")})
    return shape, {k: values.get(k) for k in ("prompts", "generations", "tokens", "mean_share")}


def check_local_gpus(gpus: str) -> None:
    """--gpus of the single placement: cpu, or one GPU of a kind the catalog knows that this node has; refused
    before the baseline's minutes, not after them."""
    if gpus == "cpu":
        return
    import torch

    spec = parse_gpus(gpus)
    if spec.total_gpus != 1:
        raise OgrpoError(f"--gpus {gpus}: the single placement runs on one GPU (1x{spec.gpu.name})")
    if not torch.cuda.is_available():
        raise OgrpoError(f"--gpus {gpus}: this node has no CUDA GPU; use --gpus cpu")


def run_step_bench(shape: RolloutShape, *, dtype: str = "fp32", steps: int = 4, prompts: int = 4,
                   generations: int = 8, new_tokens: int = 64, prompt_tokens: int = 32, seed: int = 42,
                   csv_path: str = "bench/results/step.csv", png_path: str | None = "bench/results/step.png",
                   workdir: str | None = None, out=None, placement: str = "single", stop_every: int | None = None,
                   shape_name: str = "", gpus: str = "cpu", kernels: bool | None = None,
                   mean_share: float | None = None, rounds: int = 1) -> dict:
    """`stop_every` (split placement): completions end at an end token about once in that many tokens
    (default: half the completion budget), so their lengths vary. `mean_share` (both placements): end tokens at
    the rate that makes the mean completion that share of `new_tokens` (lengths geometric, cut at the cap), listed
    in the model's generation config. `gpus` (single placement): "cpu" or one local GPU ("1xH100"), both paths
    on it; `kernels`: O-GRPO's `ogrpo.kernels` (None: the plan's choice). `rounds`: every path runs that many
    times, the paths interleaved round by round, and each path's medians pool its rounds' steps: a drift of the
    machine over the bench (a neighbour's load) then weighs on every path alike rather than on the one it hit."""
    out = out or sys.stdout
    if placement not in PLACEMENTS:
        raise OgrpoError(f"--placement {placement!r}: use {', '.join(PLACEMENTS)}")
    paths = PLACEMENTS[placement]
    if placement != "single" and (gpus != "cpu" or kernels is not None):
        raise OgrpoError("--gpus and --kernels/--no-kernels apply to the single placement")
    check_local_gpus(gpus)
    if dtype not in _DTYPES:
        raise OgrpoError(f"--dtype {dtype!r}: use fp32 or bf16")
    if steps < 2:
        raise OgrpoError("--steps must be at least 2 (the first step is a warm-up)")
    if rounds < 1:
        raise OgrpoError("--rounds must be at least 1")
    shape.check()
    check_counts(prompts=prompts, generations=(generations, 2), tokens=new_tokens, prompt_tokens=prompt_tokens)
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="ogrpo-bench-step-"))
    work.mkdir(parents=True, exist_ok=True)
    if mean_share is not None:
        stop_every = stop_every or stop_every_for(new_tokens, shape.vocab, mean_share)
    ends = tuple(stop_tokens(shape.vocab, stop_every)) if mean_share is not None else ()
    model_dir = build_model(shape, _DTYPES[dtype], work / (f"model-{shape.hidden}-{shape.layers}-{shape.vocab}"
                                                          + (f"-end{stop_every}" if ends else "")), end_ids=ends)
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in text_prompts(model_dir, 64, prompt_tokens, seed)))
    stops = stop_tokens(shape.vocab, stop_every or new_tokens // 2) if placement == "split" and not ends else None
    rec = recipe(str(model_dir), str(data), steps=steps, prompts=prompts, generations=generations,
                 new_tokens=new_tokens, dtype=_DTYPES[dtype], seed=seed, stops=stops)
    if placement == "single":
        # the prompts' length, as a user's recipe states its prompt budget: without it the plan assumes 512 tokens
        # (TRL 1.16 truncates none) and sizes memory, gradient checkpointing included, for prompts 16x as long
        rec["ogrpo"] = {"gpus": gpus, "max_prompt_length": prompt_tokens,
                        **({"kernels": kernels} if kernels is not None else {})}
    else:
        # a long run's server, which the medians stand for: it compiles its model, as TRL's vllm-serve (the
        # anchor) does by default; a 10-step recipe alone would run it eagerly (ogrpo/planner/compile_choice.py)
        rec["ogrpo"] = {"max_prompt_length": prompt_tokens, "vllm_compile": "on"}
    (work / "recipe.json").write_text(json.dumps(rec))
    runs: dict[str, list[list[dict]]] = {p: [] for p in paths}
    for k in range(rounds):
        where = work if rounds == 1 else work / f"round-{k + 1}"  # each round's jobs in a directory of their own
        where.mkdir(exist_ok=True)
        (where / "recipe.json").write_text(json.dumps(rec))
        for path in paths:
            out.write(f"running {path}{f' (round {k + 1} of {rounds})' if rounds > 1 else ''} ...\n")
            out.flush()
            # the anchor's trainer gets the thread cap the plan gives O-GRPO's trainer on the split (its server
            # drops it: ogrpo.bench.trl_server.server_env)
            env = {**os.environ, "OMP_NUM_THREADS": "1"} if path == "split-trl" else None
            with open(where / f"{path}.log", "wb") as log:
                rc = subprocess.call([sys.executable, "-m", "ogrpo.bench.step", path, str(where)],
                                     stdout=subprocess.DEVNULL, stderr=log, env=env)
            if rc != 0:
                raise OgrpoError(f"bench path {path} failed (exit {rc}); see {where / f'{path}.log'}")
            runs[path].append([json.loads(x) for x in (where / f"{path}-profile.jsonl").read_text().splitlines()])
    results = {p: pooled(runs[p]) for p in paths}
    for p in paths:  # each round's own median step: how far the rounds spread
        results[p]["round_steps"] = [summarize(run)["step"] for run in runs[p]]
    r = (ratios(*(results[p] for p in paths)) if placement in ("single", "ranks") else split_ratios(results))
    header = ["path", *[f"{s} s" for s in STAGES], "passes", "s/pass", "pad score", "pad loss", "tok/s", "peak GiB"]
    table = [[p, *[f"{results[p][s]:.3f}" for s in STAGES], f"{results[p]['logprob_passes']:g}",
              f"{results[p]['logprobs_per_pass']:.3f}", f"{100 * results[p]['pad_share_score']:.0f}%",
              f"{100 * results[p]['pad_share_loss']:.0f}%", f"{results[p]['tokens_per_s']:.0f}",
              f"{results[p]['peak_gib']:.2f}"] for p in paths]
    if ends:
        want = expected_length(new_tokens, end_rate(shape.vocab, stop_every))
        lengths = f" (end tokens 1 in {stop_every}: expected mean length {want:.0f})"
    else:
        lengths = f" (EOS allowed: end tokens 1 in {stop_every or new_tokens // 2})" if placement == "split" else ""
    over = f"steps 2..{steps}" if rounds == 1 else f"steps 2..{steps} of {rounds} rounds, the paths interleaved"
    out.write(f"\nGRPO step, {shape.label()} {dtype}, {prompts} prompts x {generations} generations x <= {new_tokens} "
              f"tokens{lengths}, {placement} placement{f', shape {shape_name}' if shape_name else ''}, median of "
              f"{over}:\n" + format_table(header, table) + "\n")
    if rounds > 1:
        out.write("each round's median step s: " + "; ".join(
            f"{p} " + ", ".join(f"{x:.3f}" for x in results[p]["round_steps"]) for p in paths) + "\n")
    if placement == "split":
        out.write("\n" + split_table(results, r, paths) + "\n")
    if placement == "ranks":  # how unevenly TRL's split left the ranks' tokens, and the balanced one
        b = json.loads((where / "ranks-balanced-balance.json").read_text())  # the last round's
        out.write(f"ranks' tokens, the most a rank held over the mean: TRL's split {b.get('spread_before')}, "
                  f"balanced {b.get('spread_after')} ({b.get('exchanged')} of {b.get('batches')} batches "
                  "exchanged rows)\n")
    for name, value in r.items():
        out.write(f"{name}: {value:.3f}\n")
    if ends:  # what the shape is about: how far the lengths spread, and what the padding then costs
        for p in paths:
            out.write(f"{p}: mean completion {results[p]['completion_len']:.1f} tokens "
                      f"({results[p]['completion_len'] / new_tokens:.2f} of the cap)\n")
    share = r.get("off_generation_share")
    if shape_name == "generation-heavy" and share is not None and share < GEN_HEAVY_SHARE:
        out.write(f"note: generation is {100 * share:.0f}% of an off step here, under the {100 * GEN_HEAVY_SHARE:.0f}% "
                  "this shape is meant to reach: pick a smaller model or fewer completions per step\n")
    tags = environment_tags()
    case = (f"{shape.label()} {dtype} {prompts}x{generations}x{new_tokens}" + ("" if placement == "single" else f" {placement}")
            + {None: "", True: " kernels on", False: " kernels off"}[kernels] + (f" {rounds} rounds" if rounds > 1 else ""))
    csv_rows = [make_row("step", case, p, f"{s}_s", results[p][s], "s", str(shape.params()), tags)
                for p in paths for s in STAGES]
    csv_rows += [make_row("step", case, p, "peak_mem", results[p]["peak_gib"], "GiB", str(shape.params()), tags)
                 for p in paths]
    csv_rows += [make_row("step", case, p, "logprobs_per_pass_s", results[p]["logprobs_per_pass"], "s",
                          str(shape.params()), tags) for p in paths]
    csv_rows += [make_row("step", case, p, f"{lane}_idle_share", results[p][f"{lane}_idle"], "share",
                          str(shape.params()), tags) for p in paths for lane in ("server", "trainer")
                 if f"{lane}_idle" in results[p]]
    csv_rows += [make_row("step", case, p, metric, results[p][metric], unit, str(shape.params()), tags)
                 for p in paths for metric, unit in (("server_busy", "s"), ("trainer_busy", "s"),
                                                     ("ideal_step", "s"), ("bottleneck_idle", "share"),
                                                     ("completion_len", "tokens"), ("pad_share_score", "share"),
                                                     ("pad_share_loss", "share"))
                 if metric in results[p]]
    csv_rows += [make_row("step", case, "ratio", k, v, "x", str(shape.params()), tags) for k, v in r.items()]
    out.write(f"csv: {append_rows(csv_path, csv_rows)}\n")
    if png_path:
        out.write(f"png: {_plot(results, case, Path(png_path), paths)}\n")
    return {"results": results, "ratios": r}


SPLIT_COLUMNS = ["path", "step s", "server busy s", "trainer busy s", "ideal s", "step/ideal", "vs off", "vs trl",
                 "bottleneck", "bottleneck idle", "server idle", "trainer idle", "tokens/completion"]


def split_table(results: dict, r: dict, paths=SPLIT_PATHS) -> str:
    """The split placement's columns: busy seconds per device set, the ideal overlap and the ratios."""
    rows = []
    for p in paths:
        res, mode = results[p], p.removeprefix("split-")
        ratio = lambda key: f"{r[key]:.3f}" if key in r else "1"  # noqa: E731 - a path against itself: 1
        rows.append([p, f"{res['step']:.3f}", f"{res['server_busy']:.3f}", f"{res['trainer_busy']:.3f}",
                     f"{res['ideal_step']:.3f}", f"{r[f'{mode}_step_over_ideal']:.3f}",
                     ratio(f"{mode}_step_over_off"), ratio(f"{mode}_step_over_trl"), res["bottleneck"],
                     f"{100 * res['bottleneck_idle']:.0f}%", f"{100 * res['server_idle']:.0f}%",
                     f"{100 * res['trainer_idle']:.0f}%", f"{res['completion_len']:.1f}"])
    return format_table(SPLIT_COLUMNS, rows)


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
    return save_figure(fig, ax, title, path)


if __name__ == "__main__":  # worker entry: python -m ogrpo.bench.step PATH WORKDIR
    from ogrpo.launch.teardown import exit_on_signals

    _work = Path(sys.argv[2])
    _rec = json.loads((_work / "recipe.json").read_text())
    with exit_on_signals():
        if sys.argv[1] == "split-trl":
            _run_split_trl(_work, _rec)
        elif sys.argv[1].startswith("ranks-"):
            _run_ranks(_work, _rec, sys.argv[1])
        elif sys.argv[1].startswith("split-"):
            _run_split(_work, _rec, sys.argv[1].removeprefix("split-"))
        else:
            (_run_trl if sys.argv[1] == "trl" else _run_ogrpo)(_work, _rec)
