"""The memory model against measurement: the plan's per-process trainer estimate (ogrpo/planner/memory.py, as the plan
computes it) next to the peak that `ogrpo train` measures, for the shapes, strategies, gradient checkpointing
and beta a CPU host can run. Regenerates docs/memory-calibration.md:

    python -m ogrpo.bench.memory_calibration --out docs/memory-calibration.md

Each case is a real run: the trainer step of a `--gpus 2xcpu` job (`python -m ogrpo.train` in two gloo
processes under torchrun; DDP, or DeepSpeed ZeRO with the deepspeed.json the plan renders) of a randomly initialised Qwen2 of the shape, HF generate, MEASURE_STEPS
steps. Its profile.jsonl carries both numbers (ogrpo/profile/profiler.py): `mem_estimate_gib`, the plan's
estimate without its runtime term, and `mem_measured_gib`, rank 0's peak of live tensor bytes per step (on CPU:
the storages alive at the step's start plus the allocator's allocations and frees during it; on GPU:
torch.cuda.max_memory_allocated). The prompts are exactly the plan's prompt length, so the estimate and the run
see the same tokens: what is calibrated is the model's per-parameter and per-token coefficients, not its
planning assumption about prompt lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from ogrpo.bench.harness import _version, device_name
from ogrpo.bench.rollout import RolloutShape, build_model, text_prompts
from ogrpo.models import resolve_model
from ogrpo.planner.device_rules import rules_of
from ogrpo.planner.memory import tensor_gib, trainer_estimate
from ogrpo.planner.types import Plan

SHAPES = {
    # ogrpo:tiny's architecture (ogrpo/tiny.py), and the two shapes of `ogrpo bench rollout` in the README
    "tiny": RolloutShape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=384),
    "32.5M": RolloutShape(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=2048, vocab=4096),
    "78.7M": RolloutShape(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=4096),
}
# zero3_offload on CPU: DeepSpeed's offload code path over gloo, its "host" the same RAM (memory.py's
# DeviceTerms.offload_is_local), so the measured peak holds the offloaded optimizer and gradient copies too
STRATEGIES = ("ddp", "zero2", "zero3", "zero3_offload")
TOLERANCE = 0.2  # |measured / estimate - 1| the model must stay within
STEPS = 3
PROMPT_TOKENS = 64
COMPLETION_TOKENS = 64
MICRO_BATCH = 8  # sequences per process per step
GENERATIONS = 4


@dataclass(frozen=True)
class Case:
    shape: str
    strategy: str
    gc: bool
    beta: float

    @property
    def name(self) -> str:
        return f"{self.shape}-{self.strategy}-gc{int(self.gc)}-b{self.beta:g}"


def parse_case(name: str) -> Case:
    shape, strategy, gc, beta = name.rsplit("-", 3)
    if shape not in SHAPES or strategy not in STRATEGIES or gc not in ("gc0", "gc1") or not beta.startswith("b"):
        raise ValueError(f"case {name!r}: expected shape-strategy-gc0|gc1-bBETA, e.g. 32.5M-zero3-gc1-b0.04")
    return Case(shape, strategy, gc == "gc1", float(beta[1:]))


def cases(shapes=tuple(SHAPES), strategies=STRATEGIES, gcs=(False, True), betas=(0.0, 0.04)) -> list[Case]:
    return [Case(s, st, gc, b) for s in shapes for st in strategies for gc in gcs for b in betas]


def recipe(case: Case, model_dir: Path, data: Path, steps: int = STEPS) -> dict:
    return {"model_name_or_path": str(model_dir), "dataset_name": str(data),
            "reward_funcs": ["ogrpo.bench.task:token_reward"], "seed": 0, "learning_rate": 1e-5, "beta": case.beta,
            "num_generations": GENERATIONS, "per_device_train_batch_size": MICRO_BATCH,
            "gradient_accumulation_steps": 1, "max_completion_length": COMPLETION_TOKENS, "temperature": 1.0,
            "max_steps": steps, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
            "gradient_checkpointing": case.gc, "dtype": "float32",
            # padding_free rows: the memory model plans for every row computing its own prompt (a pass's rows
            # need not share one), so that is the layout measured
            "ogrpo": {"gpus": "2xcpu", "strategy": case.strategy, "use_vllm": False,
                      "max_prompt_length": PROMPT_TOKENS, "padding_free": "rows"}}


def prepare_shape(shape: str, work: Path) -> tuple[Path, Path]:
    """The shape's random fp32 model and a prompt file whose prompts are all PROMPT_TOKENS tokens long."""
    s = SHAPES[shape]
    model = build_model(s, "float32", work / f"model-{shape}")
    data = work / f"prompts-{s.vocab}.jsonl"
    if not data.is_file():
        data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in text_prompts(model, 64, PROMPT_TOKENS, 1)))
    return model, data


def run_case(case: Case, work: Path, steps: int = STEPS, timeout: int = 600) -> dict:
    """One run of the case; its estimate, measurement and terms."""
    model, data = prepare_shape(case.shape, work)
    cfg = work / f"{case.name}.yaml"
    cfg.write_text(yaml.safe_dump(recipe(case, model, data, steps)))
    run_dir = work / case.name
    # what a CPU job's trainer step runs (accelerate launch -m ogrpo.train), under torchrun: 2 gloo processes
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), "-m", "ogrpo.train", "--config", str(cfg), "--output-dir", str(run_dir), "--gpus", "2xcpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(work / f"{case.name}.log", "wb") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if rc != 0:
        tail = (work / f"{case.name}.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{case.name}: ogrpo.train under torchrun failed (exit {rc}):\n{tail}")
    return read_result(case, run_dir)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_result(case: Case, run_dir: Path) -> dict:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "profile.jsonl").read_text().splitlines() if x.strip()]
    measured = [r for r in rows if r.get("mem_measured_gib") is not None]
    if not measured:
        raise RuntimeError(f"{case.name}: profile.jsonl has no mem_measured_gib")

    plan = Plan.from_dict(manifest["plan"])  # the run's record, parsed once
    plan_terms = plan.trainer.memory_terms["terms"]
    terms = estimate_terms(plan, manifest["model_path"], float(manifest["grpo_config"].get("beta") or 0.0))
    estimate = tensor_gib(terms)
    peak = max(measured, key=lambda r: r["mem_measured_gib"])
    ran = manifest.get("distributed") or {}
    return {"case": case.name, "shape": case.shape, "strategy": case.strategy, "gc": case.gc, "beta": case.beta,
            "estimate_gib": estimate, "measured_gib": peak["mem_measured_gib"], "measured_step": peak["step"],
            "per_step_gib": [r["mem_measured_gib"] for r in measured], "method": peak["mem_measure"],
            "profile_estimate_gib": rows[-1].get("mem_estimate_gib"), "plan_estimate_gib": tensor_gib(plan_terms),
            "rss_peak_gib": peak.get("peak_mem_gib"),
            "ratio": peak["mem_measured_gib"] / estimate, "terms": {k: v for k, v in terms.items() if k != "runtime"},
            "runtime_gib": terms.get("runtime", 0.0), "ran": ran.get("distributed_type"),
            "zero_stage": (ran.get("deepspeed") or {}).get("zero_stage"),
            "plan_gc": plan.trainer.gradient_checkpointing}


def estimate_terms(plan, model_path: str, beta: float) -> dict:
    """trainer_estimate with the inputs the plan gave it (its model, processes, strategy, precision, batch,
    lengths, checkpointing, beta, kernels, gradient_accumulation_steps): the plan's own terms unrounded, and
    today's model for runs that `--reuse` reads back from before a change to it."""
    b, t = plan.batch, plan.trainer
    e = trainer_estimate(resolve_model(model_path), num_processes=t.num_processes, strategy=t.strategy,
                         precision=plan.precision, micro_batch=b.per_device_train_batch_size,
                         prompt_len=b.prompt_length, completion_len=b.completion_length,
                         gradient_checkpointing=t.gradient_checkpointing, beta=beta,
                         device=rules_of(plan).memory_terms,
                         fused_logprobs=bool(plan.kernels.linear_logprobs),
                         grad_accumulation_steps=b.gradient_accumulation_steps)
    return e.terms


def dominant_terms(terms: dict, n: int = 3) -> str:
    total = sum(v for v in terms.values() if v > 0) or 1.0
    top = sorted(terms.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in top if v > 0)


def _gib(x: float) -> str:
    return f"{x:.4f}" if x < 0.1 else f"{x:.3f}"


def table(results: list[dict]) -> str:
    head = ["shape", "strategy", "gc", "beta", "estimate GiB", "measured GiB", "ratio", "dominant terms (estimate)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        lines.append(f"| {r['shape']} | {r['strategy']} | {'on' if r['gc'] else 'off'} | {r['beta']:g} | "
                     f"{_gib(r['estimate_gib'])} | {_gib(r['measured_gib'])} | {r['ratio']:.3f} | "
                     f"{dominant_terms(r['terms'])} |")
    return "\n".join(lines)


def markdown(results: list[dict], env: dict) -> str:
    ratios = [r["ratio"] for r in results]
    worst = max(results, key=lambda r: abs(r["ratio"] - 1)) if results else None
    shapes = ", ".join(f"{k} = {v.label()}" for k, v in SHAPES.items() if any(r["shape"] == k for r in results))
    summary = (f"{len(results)} runs; measured / estimate from {min(ratios):.3f} to {max(ratios):.3f} "
               f"(worst: {worst['case']}, {worst['ratio']:.3f}); tolerance ±{TOLERANCE:.0%}." if results else "")
    return f"""# Memory model calibration (trainer, CPU)

Generated by `python -m ogrpo.bench.memory_calibration --out docs/memory-calibration.md` on {env['device']}
(torch {env['torch']}, transformers {env['transformers']}, TRL {env['trl']}, DeepSpeed {env['deepspeed']}).
{summary}

What is compared, per trainer process:

- **estimate**: the plan's trainer estimate (`ogrpo/planner/memory.py` `trainer_estimate`, as `ogrpo plan` computes it
  for `--gpus 2xcpu`: fp32, the case's strategy, gradient checkpointing and beta, the plan's kernels and the
  recipe's gradient_accumulation_steps), all terms except `runtime` (the interpreter on CPU, the CUDA context
  and allocator slack on GPU), which no tensor measurement sees.
- **measured**: rank 0's peak of live tensor bytes over the first {STEPS} optimizer steps of a real run
  (the trainer step of a `--gpus 2xcpu` job: `python -m ogrpo.train` in two gloo processes under torchrun, HF
  generate; ZeRO through DeepSpeed with the config the plan renders). On CPU torch keeps no allocator statistics, so `ogrpo train`'s profiler
  (`ogrpo/profile/profiler.py`) adds the bytes of every CPU storage alive at the step's start (found through the
  garbage collector, each storage once) to the running sum of the CPU allocator's allocations and frees during
  the step (torch.profiler, `profile_memory=True`: every allocation, DeepSpeed's and the autograd engine's
  included), and takes the maximum. On GPU the same fields hold `torch.cuda.max_memory_allocated()`.
  The RSS high-water mark is not used: it holds the interpreter, shared libraries and allocator caches
  (about 0.6-0.9 GiB here, more than the whole tensor footprint of the small shapes) and never goes down.

Workload: {MICRO_BATCH} sequences per process per step ({GENERATIONS} generations per prompt), prompts of exactly
{PROMPT_TOKENS} tokens (`ogrpo.max_prompt_length` {PROMPT_TOKENS}, so the plan assumes the length the run sees),
completions up to {COMPLETION_TOKENS} tokens, random weights ({shapes}).

{table(results)}

Without `--cases` the command runs every combination ({len(SHAPES)} shapes x {len(STRATEGIES)} strategies x
checkpointing x 2 betas, about a minute each on 2 cores); the table above is the subset `--cases` named,
covering every shape, strategy, checkpointing setting and beta.

What the measurement changed in the model (`ogrpo/planner/memory.py`):

- **DDP gradient buckets** (`ddp_buckets`, +4 bytes per parameter with more than one process): torch DDP, as
  accelerate builds it (`gradient_as_bucket_view=False`), keeps flat all-reduce buckets the size of all
  gradients for the whole run, held only by C++ (a walk over Python objects never finds them; the profiler sees
  them allocated). Documented torch behaviour, so GPU plans count it too: it moves the 4xV100-32G 1.5B example
  from DDP to ZeRO-2 (DDP would need 32.2 of 28.8 GiB); the 3xA40 one stays DDP (32.2 of 40.5).
- **Gradients vs activations** (`grads_activations_overlap`): with `gradient_accumulation_steps` 1 the trainer
  frees gradients after each step (`zero_grad(set_to_none=True)`) and backward rebuilds them while it frees the
  activations, so DDP and ZeRO-2 peak at the larger of the two, not at their sum (step-start counts: weights +
  optimizer state (+ buckets) only). With accumulation the gradients live through the next forward and both
  count. The planner gives `trainer_estimate` the recipe's `gradient_accumulation_steps` (TRL's default: 1), so
  the plan, `mem_estimate_gib` in profiles and this table's estimate are the same number.
- **Reference model dtype**: TRL loads it with the policy's `model_init_kwargs`, i.e. fp32 under DDP (the
  plan's master weights, also under bf16/fp16 autocast on GPU: 4 bytes per parameter, not 2); DeepSpeed casts it
  to its half dtype. This one changes GPU figures (tests/test_memory.py, tests/test_lora.py updated).
- **ZeRO-2 full gradients** (`zero2_full_gradients`): backward computes every full gradient before ZeRO-2
  reduces it into the process's partition; on this path the full set is held at the backward peak.
- **ZeRO-3 reference gather** (`zero3_reference_gather`): the reference model's no-grad scoring pass has no
  backward to release what DeepSpeed gathered, and `stage3_max_live_parameters` (1e9 by default) lets whole
  models stay gathered; measured, that pass holds two full copies (`mem_peak_stage` = logprobs when the loss's
  activations are smaller). A phase of its own: only what exceeds the activations counts.
- These two DeepSpeed terms were measured over gloo only: CPU plans count them, GPU plans do not
  (`DEEPSPEED_CPU_TERMS_ON_GPU` in `ogrpo/planner/memory.py`) until a GPU measurement confirms them; the gpu-marked
  test in tests/test_memory_calibration.py compares DDP on one GPU so far.
- **ZeRO-3 with optimizer offload** (issue 33): DeepSpeed 0.19.8's `stage3.py` allocates the optimizer's
  fp32 master weights and Adam moments, the fp32 gradients its optimizer steps on and the gradient partition
  (`grad_partitions_flat_buffer`, in the half dtype) on the CPU once `offload_optimizer` is set: a GPU keeps
  only the half weights' partition and the gathers, the host 12 + 4 + 2 bytes per parameter over N
  (`host_terms`, counted by `ogrpo/planner/host_memory.py`). The GPU side equals DeepSpeed's own estimator
  (`estimate_zero3_model_states_mem_needs`, offload_optimizer=cpu: tests/test_memory.py); its host figure leaves
  out the half gradient partition. On CPU processes that host RAM is the process's own, so the estimate keeps
  the offloaded terms and the runs below measure them.
- **Attention probabilities on CPU** (in `activations`, `DeviceTerms.attention_scores`): PyTorch's CPU SDPA
  takes its math path under the padding mask TRL passes and keeps each layer's B·heads·S² probabilities for
  backward (with checkpointing, the recomputed layer's), and backward builds one layer's gradient of them. It
  showed once the prompts were really {PROMPT_TOKENS} tokens (an earlier table was measured with a bench
  tokenizer that read each prompt as 3-5 unknown ids): the tiny shape then measured 21-25% above an estimate
  without it. Flash-attn 2 and SDPA's CUDA kernels hold no S² tensor: GPU plans do not count it.

Left as it was: the activation coefficients (10·H + 3·I values per token and layer); one shape family is not
enough to refit them.

Dominant terms: the estimate's largest terms as shares of its tensor total. Every run's own `profile.jsonl`
carries `mem_estimate_gib`, `mem_measured_gib` and `mem_measure` per measured step, and its manifest the
largest step against the estimate (`profile.mem_measured_over_estimate`), so users' runs extend this table.
"""


def environment() -> dict:
    return {"device": device_name(), "torch": _version("torch"), "transformers": _version("transformers"),
            "trl": _version("trl"), "deepspeed": _version("deepspeed")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ogrpo.bench.memory_calibration", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/memory-calibration.md", help="Markdown table to write.")
    ap.add_argument("--json", default=None, help="Also write the raw results here.")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"Comma list of {', '.join(SHAPES)}.")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help=f"Comma list of {', '.join(STRATEGIES)}.")
    ap.add_argument("--gc", default="off,on", help="Gradient checkpointing: comma list of off, on.")
    ap.add_argument("--betas", default="0,0.04", help="Comma list of beta values.")
    ap.add_argument("--workdir", default=None, help="Where models and runs are written (default: a temp dir).")
    ap.add_argument("--cases", default=None,
                    help="Comma list of case names (shape-strategy-gcN-bBETA, e.g. 32.5M-zero3-gc1-b0.04) instead "
                         "of the product of the lists above.")
    ap.add_argument("--reuse", action="store_true", help="Read finished runs already in --workdir instead of "
                                                          "running them again.")
    a = ap.parse_args(argv)
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    bad = [s for s in split(a.shapes) if s not in SHAPES] + [s for s in split(a.strategies) if s not in STRATEGIES]
    if bad:
        print(f"error: unknown shape or strategy {', '.join(bad)}", file=sys.stderr)
        return 2
    todo = cases(split(a.shapes), split(a.strategies), [g == "on" for g in split(a.gc)],
                 [float(b) for b in split(a.betas)])
    if a.cases:
        todo = [parse_case(c) for c in split(a.cases)]
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="ogrpo-memcal-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    env = environment()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    for case in todo:
        done = work / case.name / "manifest.json"
        if a.reuse and done.is_file() and json.loads(done.read_text()).get("status") == "finished":
            r = read_result(case, work / case.name)
        else:
            r = run_case(case, work)
        results.append(r)
        print(f"{case.name}: estimate {r['estimate_gib']:.4f} GiB, measured {r['measured_gib']:.4f} GiB "
              f"(steps {r['per_step_gib']}), ratio {r['ratio']:.3f}", flush=True)
        # after every case: an interrupted sweep still leaves its table
        Path(a.out).write_text(markdown(results, env))
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1))
    print(f"wrote {a.out}")
    return 0 if all(abs(r["ratio"] - 1) <= TOLERANCE for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
