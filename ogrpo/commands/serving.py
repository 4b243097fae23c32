"""`ogrpo serve`, `ogrpo supervise`, `ogrpo bench …` (owned by the serving/launch area)."""
from __future__ import annotations

from typing import Optional

import typer

from ogrpo.errors import OgrpoError

bench_app = typer.Typer(help="Benchmarks that print ratios against a baseline measured in the same run.",
                        no_args_is_help=True)


def serve(
    config: str = typer.Option(..., "--config", "-c", help="Resolved run.yaml (or a built-in recipe name)."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; loopback unless the trainer is on another node."),
    port: int = typer.Option(8000, help="Port to bind."),
    model: Optional[str] = typer.Option(None, help="Refuse to start unless the run trains this model."),
    revision: Optional[str] = typer.Option(None, help="Refuse to start unless the run trains this revision."),
    dtype: Optional[str] = typer.Option(None, help="Refuse to start unless the trainer runs this dtype."),
    max_model_len: Optional[int] = typer.Option(None, help="Context length; refused when shorter than needed."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the vLLM command line and exit."),
    extra: Optional[list[str]] = typer.Argument(None, help="Extra vLLM server arguments, after `--`."),
) -> None:
    """Run the vLLM OpenAI server for a run, with the plan's flags (and the cpu_shm weight sync on CPU)."""
    import shlex

    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.serve.server import serve as run_serve

    argv = run_serve(config, host, port, model=model, revision=revision, dtype=dtype,
                     max_model_len=max_model_len, extra_args=extra, dry_run=dry_run)
    typer.echo(shlex.join(argv))


def supervise(
    job: str = typer.Argument(..., help="Job directory holding jobspec.json, or a jobspec.json path."),
    health_timeout: Optional[float] = typer.Option(None, help="Seconds to wait for the server's /health."),
) -> None:
    """Run a job's steps on this machine: server and trainer as process groups, health wait, watchdog."""
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.launch.local import run_local

    rc = run_local(job, health_timeout_s=health_timeout)
    raise typer.Exit(rc)


@bench_app.command("rollout")
def bench_rollout(
    hidden: int = typer.Option(512, help="Hidden size."),
    layers: int = typer.Option(8, help="Decoder layers."),
    heads: int = typer.Option(8, help="Attention heads."),
    kv_heads: int = typer.Option(2, "--kv-heads", help="Key/value heads."),
    intermediate: int = typer.Option(2048, help="MLP intermediate size."),
    vocab: int = typer.Option(4096, help="Vocabulary size."),
    dtype: str = typer.Option("fp32", help="fp32 | bf16 (same on every side)."),
    prompts: int = typer.Option(8, help="Prompts per batch."),
    generations: int = typer.Option(8, help="Completions per prompt."),
    tokens: int = typer.Option(128, help="New tokens per completion (EOS ignored)."),
    prompt_tokens: int = typer.Option(32, help="Tokens per prompt."),
    repeats: int = typer.Option(3, help="Timed repeats per path; the median is reported."),
    paths: str = typer.Option("hf,vllm,vllm_inproc,server",
                              help="Comma list of paths: hf, vllm, vllm_inproc, server."),
    csv: str = typer.Option("bench/results/rollout.csv", help="CSV file rows are appended to."),
    workdir: Optional[str] = typer.Option(None, help="Where the random model is written (default: a temp dir)."),
    gpu_memory_utilization: Optional[float] = typer.Option(
        None, help="vLLM memory share, the same for both vLLM paths (default: an explicit KV budget that holds "
                   "the whole rollout)."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help="Both vLLM paths without compilation."),
    paired: bool = typer.Option(True, "--paired/--separate",
                                help="Time raw offline vLLM (in-process when run) and the server in turns in one "
                                     "run (robust to load from other jobs), or each in its own run."),
) -> None:
    """Rollout tokens/s: TRL's default (HF generate) vs raw vLLM offline vs O-GRPO's server path."""
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.bench.rollout import RolloutShape, run_rollout_bench
    from ogrpo.launch.teardown import exit_on_signals

    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:  # NaN fails both
        raise OgrpoError(f"--gpu-memory-utilization {gpu_memory_utilization}: vLLM's share of the device, in (0, 1]")
    shape = RolloutShape(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                         intermediate=intermediate, vocab=vocab)
    with exit_on_signals():  # the server it starts is stopped on SIGTERM/SIGHUP too
        run_rollout_bench(shape, dtype=dtype, prompts=prompts, generations=generations, new_tokens=tokens,
                          prompt_tokens=prompt_tokens, repeats=repeats,
                          paths=[p.strip() for p in paths.split(",")], csv_path=csv, workdir=workdir,
                          gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, paired=paired)


@bench_app.command("kernels")
def bench_kernels(
    tokens: str = typer.Option("1024,4096", help="Comma list of token counts for the log-prob cases."),
    hidden: int = typer.Option(1536, help="Hidden size of the LM head (Qwen2.5-1.5B: 1536)."),
    vocab: int = typer.Option(151936, help="Vocabulary size (Qwen2.5: 151,936)."),
    dtype: str = typer.Option("fp32", help="fp32 | bf16 | fp16 for the log-prob inputs."),
    batch: int = typer.Option(64, help="Rows of logits per sampling step."),
    history: int = typer.Option(256, help="Previous tokens per row (repetition penalty)."),
    repeats: int = typer.Option(3, help="Timed repeats per path; the median is reported."),
    parts: str = typer.Option("logprobs,sample", help="Comma list: logprobs, sample."),
    paths: str = typer.Option("trl_1_9_2,trl_1_16,ogrpo", help="Log-prob paths: trl_1_9_2, trl_1_16, ogrpo."),
    csv: str = typer.Option("bench/results/kernels.csv", help="CSV file rows are appended to."),
) -> None:
    """Our kernels vs TRL 1.9.2 / TRL 1.16 log-probs (time, peak memory) and transformers' sampling chain."""
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.bench.kernels import run_kernels_bench

    try:
        token_counts = tuple(int(t) for t in tokens.split(",") if t.strip())
    except ValueError:
        raise OgrpoError(f"--tokens takes a comma list of integers, got {tokens!r}") from None
    split = lambda text: tuple(p.strip() for p in text.split(",") if p.strip())  # noqa: E731
    if "logprobs" in split(parts) and (not token_counts or min(token_counts) < 1):
        raise OgrpoError(f"--tokens {tokens!r}: the log-prob cases need token counts of 1 or more")
    run_kernels_bench(tokens=token_counts, hidden=hidden, vocab=vocab, dtype=dtype, batch=batch, history=history,
                      repeats=repeats, parts=split(parts), paths=split(paths), csv_path=csv)


@bench_app.command("step")
def bench_step(
    shape: str = typer.Option("default", help="Preset of model, batch and completion length: default (32.5M, "
                                              "4x8x64), generation-heavy (256-token completions) or variable "
                                              "(4x8, up to 256 tokens, mean about 0.35 of it); the options "
                                              "below override it."),
    hidden: Optional[int] = typer.Option(None, help="Hidden size."),
    layers: Optional[int] = typer.Option(None, help="Decoder layers."),
    heads: Optional[int] = typer.Option(None, help="Attention heads."),
    kv_heads: Optional[int] = typer.Option(None, help="Key/value heads."),
    intermediate: Optional[int] = typer.Option(None, help="MLP width."),
    vocab: Optional[int] = typer.Option(None, help="Vocabulary size."),
    dtype: str = typer.Option("fp32", help="fp32 | bf16."),
    steps: int = typer.Option(4, help="GRPO steps per path (the first is a warm-up)."),
    rounds: int = typer.Option(1, help="Runs per path, the paths interleaved round by round; the medians pool "
                                       "the rounds' steps (the machine's drift then weighs on every path)."),
    prompts: Optional[int] = typer.Option(None, help="Prompts per step."),
    generations: Optional[int] = typer.Option(None, help="Completions per prompt."),
    tokens: Optional[int] = typer.Option(None, help="New tokens per completion (at most, on the split placement)."),
    csv: str = typer.Option("bench/results/step.csv", help="CSV file rows are appended to."),
    png: str = typer.Option("bench/results/step.png", help="Bar chart of the per-stage seconds."),
    workdir: Optional[str] = typer.Option(None, help="Where the model and runs are written (default: temp)."),
    placement: str = typer.Option("single", help="single: plain TRL vs O-GRPO in one process; split: a vLLM "
                                                 "server on one core, the trainer on the other (2xcpu), with "
                                                 "plain TRL's server mode and ogrpo.overlap off, lossless and "
                                                 "one-step; ranks: two trainer processes (DDP, 2xcpu), TRL's "
                                                 "split of each batch against ranks balanced by tokens (use "
                                                 "--shape variable)."),
    gpus: str = typer.Option("cpu", "--gpus", help="single placement: cpu, or one local GPU (1xH100)."),
    kernels: Optional[bool] = typer.Option(None, "--kernels/--no-kernels", help="O-GRPO's ogrpo.kernels "
                                                                               "(default: the plan's choice)."),
) -> None:
    """The same GRPO steps as plain TRL (its defaults) and as O-GRPO's plan: per-stage seconds, memory, ratios."""
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.bench.step import preset, run_step_bench
    from ogrpo.launch.teardown import exit_on_signals

    model, batch = preset(shape, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                          intermediate=intermediate, vocab=vocab, prompts=prompts, generations=generations,
                          tokens=tokens)
    with exit_on_signals():
        run_step_bench(model, dtype=dtype, steps=steps, prompts=batch["prompts"], generations=batch["generations"],
                       new_tokens=batch["tokens"], csv_path=csv, png_path=png, workdir=workdir,
                       placement=placement, shape_name=shape, gpus=gpus, kernels=kernels,
                       mean_share=batch["mean_share"], rounds=rounds)


@bench_app.command("overlap")
def bench_overlap(
    seeds: int = typer.Option(3, help="Seeds per mode (the check needs 2 or more: it judges by their spread)."),
    steps: int = typer.Option(30, help="GRPO steps per run."),
    modes: str = typer.Option("off,lossless,one-step", help="Comma list of ogrpo.overlap modes to run; off is "
                                                            "the reference and must be among them."),
    broken: Optional[str] = typer.Option(None, help="Run one-step deliberately broken, to see the check fail: "
                                                   "no-correction (TRL's importance-sampling correction off). "
                                                   "Only the bench's own plan changes."),
    csv: str = typer.Option("bench/results/overlap.csv", help="CSV file of the reward curves (replaced)."),
    png: str = typer.Option("bench/results/overlap.png", help="Reward-vs-time plot."),
    workdir: Optional[str] = typer.Option(None, help="Where the jobs run (default: temp)."),
) -> None:
    """A quality check of ogrpo.overlap: the tiny recipe on the split placement with each mode, N seeds each;
    reward (mean ± std over seeds) at fixed steps and wall-clock times, then the verdict. lossless must equal off
    step by step, seed by seed (reward and logged loss) through step 10 (later its per-group passes' rounding
    may part a seed's samples; from there it is judged as the others); every other mode must show a final reward (mean over
    the last third of the steps) no lower than off's by more than a fifth of off's rise, at 2 standard errors.
    Exit 0: every mode passes; 1: a mode fails; 4: inconclusive (off did not learn clearly, or one seed); 2: bad
    options."""
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.bench.overlap import run_overlap_bench
    from ogrpo.launch.teardown import exit_on_signals

    with exit_on_signals():
        result = run_overlap_bench(seeds=seeds, steps=steps, modes=modes, broken=broken, workdir=workdir,
                                   csv_path=csv, png_path=png)
    raise typer.Exit(result["exit_code"])


@bench_app.command("rewards")
def bench_rewards(
    old_cap: float = typer.Option(150.0, "--old-cap", help="Seconds after which an old path is stopped (shown as "
                                                           "'> cap')."),
    cases: Optional[str] = typer.Option(None, help="Comma list of case names (substrings) to run; default all."),
    csv: str = typer.Option("bench/results/rewards.csv", help="CSV file rows are appended to."),
) -> None:
    """Reward stage before/after: open-r1's regexes vs linear scanners, math-verify in a thread vs killable
    workers, one completion's test cases in turn vs in parallel."""
    import math

    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.bench.rewards import run_rewards_bench

    if not (math.isfinite(old_cap) and old_cap > 0):
        raise OgrpoError(f"--old-cap {old_cap}: give the seconds after which an old path is stopped (> 0)")
    picked = tuple(c.strip() for c in cases.split(",") if c.strip()) if cases else None
    run_rewards_bench(old_cap_s=old_cap, csv_path=csv, cases=picked)
