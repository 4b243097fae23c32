"""`ogrpo bench kernels`: our two ops against what TRL and transformers do, side by side in one run.

(a) log-probs + entropy of an LM head, forward and backward (the trainer's per-token log-prob step), at
    hidden 1536 and V=151,936 (Qwen2.5-1.5B's head) for 1k and 4k tokens:
    trl_1_9_2   — TRL 1.9.2's path, the GPU images' line: full logits `hidden @ W.T`, then
                  `selective_log_softmax` and, under no_grad as GRPOTrainer does, `entropy_from_logits`;
    trl_1_16    — TRL 1.16's own fused head: `trl.kernels.ChunkedLogProbFunction`, what `add_fused_lm_head`
                  runs (tiles of 4096 tokens x 32768 vocab; torch ops where Triton is absent, as on CPU);
    ogrpo       — `ogrpo.kernels.linear_logprobs` (the compiled kernel when it builds and passes its check).
    The backward is that of `sum(logp * g)` with entropy kept for metrics only, as in GRPOTrainer; the
    lm_head gradient [V, H] (0.9 GB in fp32) is part of every path's peak.
(b) sampling one token per row of [64, 151,936] logits: transformers' logits-processor chain
    (RepetitionPenalty -> Temperature -> TopK -> TopP, the order `generate` builds) + softmax +
    `torch.multinomial`, against `ogrpo.kernels.fused_sample`.

Peak memory on CPU: torch keeps no allocator statistics there, so each (a) path runs in a fresh subprocess,
allocates its inputs in place (no temporaries), and takes the resident set size as the baseline; the peak is
`ru_maxrss` (the process's high-water mark) after one forward+backward minus that baseline. Large CPU tensors are mmap-backed and returned to the OS when freed
(glibc's mmap threshold is at most 32 MiB), so the high-water mark is the path's own working set. A warm-up
at a tiny size before the baseline keeps one-time costs (op registration, the extension's first-use check)
out of it.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from ogrpo import dtypes
from ogrpo.bench.harness import append_rows, environment_tags, make_row, median_seconds
from ogrpo.errors import OgrpoError
from ogrpo.install_hints import require
from ogrpo.kernels import _build
from ogrpo.kernels.fused_sample import fused_sample
from ogrpo.kernels.linear_logprobs import linear_logprobs
from ogrpo.tables import format_table

RESULT_TAG = "OGRPO_BENCH_RESULT "
LOGPROB_PATHS = ("trl_1_9_2", "trl_1_16", "ogrpo")
SAMPLE_PATHS = ("transformers", "ogrpo")
PATH_NAMES = {"trl_1_9_2": "TRL 1.9.2 (full logits)", "trl_1_16": "TRL 1.16 fused head", "ogrpo": "ogrpo",
              "transformers": "transformers chain"}
BASELINE = {"logprobs": "trl_1_9_2", "sample": "transformers"}
# the issue's bars: peak <= 0.5x and time <= 1.1x TRL 1.9.2's; sampling >= 2x faster than transformers
TARGETS = {"peak_ratio": 0.5, "time_ratio": 1.1, "sample_speedup": 2.0}
_DTYPES = {p: dtypes.torch_name(p) for p in ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")}


@dataclass
class LogprobCase:
    path: str
    tokens: int
    hidden: int
    vocab: int
    dtype: str
    repeats: int
    temperature: float = 0.9
    seed: int = 0


@dataclass
class SampleCase:
    name: str
    top_k: int
    top_p: float
    temperature: float = 0.7
    repetition_penalty: float = 1.1


SAMPLE_CASES = (SampleCase("topk50_topp0.9", 50, 0.9), SampleCase("topp0.95", 0, 0.95))


# --- (a) the three log-prob paths -------------------------------------------------------------------------


def selective_log_softmax(logits, index):
    """TRL's `selective_log_softmax` (trl/trainer/utils.py), the function both TRL 1.9.2 and 1.16 define;
    copied from 1.16 without its CUDA-only Triton branch and its `row_mask` (1.9.2 has neither)."""
    import torch
    import torch.nn.functional as F

    squeeze = index.ndim == logits.ndim - 1
    if squeeze:
        index = index.unsqueeze(-1)
    if logits.dtype in [torch.float32, torch.float64]:
        selected_logits = torch.gather(logits, dim=-1, index=index)
        # loop to reduce peak mem consumption
        logsumexp_values = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
        per_token_logps = selected_logits - logsumexp_values.unsqueeze(-1)
    else:
        # logsumexp approach is unstable with bfloat16, fall back to slightly less efficient approach
        per_token_logps = []
        for row_logits, row_labels in zip(logits, index):
            row_logps = F.log_softmax(row_logits, dim=-1)
            per_token_logps.append(row_logps.gather(dim=-1, index=row_labels))
        per_token_logps = torch.stack(per_token_logps)
    if squeeze:
        per_token_logps = per_token_logps.squeeze(-1)
    return per_token_logps


def entropy_from_logits(logits, chunk_size: int = 128):
    """TRL's `entropy_from_logits` (trl/trainer/utils.py, same in 1.9.2 and 1.16 less 1.16's CUDA Triton
    branch): chunked over rows."""
    import torch
    import torch.nn.functional as F

    original_shape = logits.shape[:-1]
    flat_logits = logits.reshape(-1, logits.shape[-1])
    entropies = []
    for chunk in flat_logits.split(chunk_size, dim=0):
        logps = F.log_softmax(chunk, dim=-1)
        entropies.append(-(torch.exp(logps) * logps).sum(-1))
    return torch.cat(entropies, dim=0).reshape(original_shape)


def trl_1_9_2(hidden, weight, targets, temperature):
    """GRPOTrainer._get_per_token_logps_and_entropies of TRL 1.9.2 after the model's lm_head: logits / T,
    selective_log_softmax, entropy under no_grad."""
    import torch

    logits = hidden @ weight.t()
    logits = logits / temperature
    logps = selective_log_softmax(logits[None], targets[None])[0]
    with torch.no_grad():
        entropy = entropy_from_logits(logits)
    return logps, entropy


def trl_1_16(hidden, weight, targets, temperature):
    """What TRL 1.16's `add_fused_lm_head` forward calls on the head (trl/trainer/utils.py)."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer import utils as trl_utils

    chunk = getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 32768)
    out = ChunkedLogProbFunction.apply(hidden, weight, None, targets, temperature, chunk, None, 1.0,
                                       ("log_probs", "entropy"))
    return out[0], out[1]


def ogrpo_logprobs(hidden, weight, targets, temperature):
    return linear_logprobs(hidden, weight, targets, temperature)


LOGPROB_FNS = {"trl_1_9_2": trl_1_9_2, "trl_1_16": trl_1_16, "ogrpo": ogrpo_logprobs}


def _maxrss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _rss_mib() -> float:
    """Resident set size now (ru_maxrss is the high-water mark)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _implementation(path: str) -> str:
    if path == "ogrpo":
        try:
            # inside the try: a failing import is reported in the table, not raised
            from ogrpo.kernels.linear_logprobs import implementation

            impl = implementation("cpu")
            if isinstance(impl, dict):
                return impl.get("impl", "?") + ("" if impl.get("impl") == "compiled" else f": {impl.get('reason', '')}")
            return str(impl)
        except Exception as exc:  # noqa: BLE001 - a label only
            return f"unknown ({type(exc).__name__})"
    return "torch" if path == "trl_1_9_2" else "torch ops (no Triton on CPU)"


def run_logprob_case(case: LogprobCase) -> dict:
    """One path, in this process (call it in a fresh one: the RSS high-water mark is per process)."""
    import torch

    fn = LOGPROB_FNS[case.path]
    dtype = getattr(torch, _DTYPES[case.dtype])

    def inputs(n: int, h: int, v: int):
        # filled in place: a temporary copy of the [V, H] weight would raise the high-water mark above the
        # baseline and hide up to its size of every path's peak
        gen = torch.Generator().manual_seed(case.seed)
        hidden = torch.empty(n, h, dtype=dtype).normal_(generator=gen).requires_grad_()
        weight = torch.empty(v, h, dtype=dtype).normal_(std=1 / math.sqrt(h), generator=gen).requires_grad_()
        targets = torch.randint(0, v, (n,), generator=gen)
        grad = torch.randn(n, generator=gen)
        return hidden, weight, targets, grad

    def step(hidden, weight, targets, grad):
        t0 = time.perf_counter()
        logp, entropy = fn(hidden, weight, targets, case.temperature)
        t1 = time.perf_counter()
        (logp.float() * grad).sum().backward()
        t2 = time.perf_counter()
        checksum = float(logp.detach().float().sum()) + float(entropy.detach().float().sum())
        hidden.grad = weight.grad = None
        return t1 - t0, t2 - t1, checksum

    step(*inputs(7, 24, 1000))  # one-time costs (imports, op registration, first-use check) before the baseline
    args = inputs(case.tokens, case.hidden, case.vocab)
    baseline = _rss_mib()
    # what the high-water mark already held above the current RSS (freed temporaries): a peak smaller than
    # this would not show; reported so a reader can tell
    slack = _maxrss_mib() - baseline
    fwd, bwd, checksum = step(*args)
    peak = _maxrss_mib() - baseline
    fwds, bwds = [fwd], [bwd]
    for _ in range(max(0, case.repeats - 1)):
        f, b, _ = step(*args)
        fwds.append(f)
        bwds.append(b)
    totals = [f + b for f, b in zip(fwds, bwds)]
    return {"path": case.path, "tokens": case.tokens, "fwd_s": statistics.median(fwds),
            "bwd_s": statistics.median(bwds), "total_s": statistics.median(totals), "peak_mib": peak,
            "checksum": checksum, "impl": _implementation(case.path), "baseline_slack_mib": slack}


def _median_of_rounds(runs: list[dict]) -> dict:
    """One row per path: the median of each measured figure over the rounds (an error ends the path's rounds)."""
    failed = next((r for r in runs if "error" in r), None)
    if failed is not None:
        return dict(failed)
    out = dict(runs[0])
    for key in ("fwd_s", "bwd_s", "total_s", "peak_mib", "baseline_slack_mib"):
        out[key] = statistics.median(r[key] for r in runs)
    return out


def _run_child(case: LogprobCase, timeout: float | None) -> dict:
    cmd = [sys.executable, "-m", "ogrpo.bench.kernels", "--child", json.dumps(asdict(case))]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"path": case.path, "tokens": case.tokens, "error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    if proc.returncode < 0 or proc.returncode == 137:
        tail = f"killed (signal {-proc.returncode if proc.returncode < 0 else 9}: out of memory?)"
    return {"path": case.path, "tokens": case.tokens, "error": tail[:200]}


# --- (b) sampling -------------------------------------------------------------------------------------------


def transformers_sample(logits, case: SampleCase, previous, generator):
    """`generate`'s sampling step: the processors it builds from these settings, in its order, then
    softmax + multinomial (transformers/generation/utils.py `_sample`)."""
    import torch
    from transformers import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    chain = LogitsProcessorList()
    if case.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(case.repetition_penalty))
    chain.append(TemperatureLogitsWarper(case.temperature))
    if case.top_k:
        chain.append(TopKLogitsWarper(case.top_k))
    if case.top_p < 1.0:
        chain.append(TopPLogitsWarper(case.top_p))
    scores = chain(previous, logits)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


def ogrpo_sample(logits, case: SampleCase, previous, generator):
    return fused_sample(logits, case.temperature, case.top_k, case.top_p, case.repetition_penalty, previous,
                        generator)


def run_sample_case(case: SampleCase, batch: int, vocab: int, history: int, repeats: int) -> list[dict]:
    import torch

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=gen) * 3
    previous = torch.randint(0, vocab, (batch, history), generator=gen)
    results = []
    for path, fn in (("transformers", transformers_sample), ("ogrpo", ogrpo_sample)):
        draw = torch.Generator().manual_seed(1)
        try:
            # each call gets its own copy: the processors edit scores in place
            seconds, _ = median_seconds(lambda: fn(logits.clone(), case, previous, draw), repeats=repeats)
            tokens = fn(logits.clone(), case, previous, draw)
            if tokens.shape != (batch,) or not bool(((tokens >= 0) & (tokens < vocab)).all()):
                raise RuntimeError(f"returned {tuple(tokens.shape)} tokens, not {batch} ids < {vocab}")
        except Exception as exc:  # noqa: BLE001 - a path that cannot run is reported, the others still are
            results.append({"path": path, "case": case.name, "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        # the clone is inside both timings alike: ~1% of the chain's time at [64, 151936]
        results.append({"path": path, "case": case.name, "seconds": seconds})
    return results


# --- the whole bench -----------------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def run_kernels_bench(tokens=(1024, 4096), hidden: int = 1536, vocab: int = 151936, dtype: str = "fp32",
                      batch: int = 64, history: int = 256, repeats: int = 3, parts=("logprobs", "sample"),
                      paths=LOGPROB_PATHS, csv_path: str | Path | None = "bench/results/kernels.csv",
                      case_timeout: float | None = 1800, out: TextIO | None = None) -> list[dict]:
    """Run the chosen parts, print the tables with ratios against the baselines, append CSV rows."""
    out = out or sys.stdout
    if dtype not in _DTYPES:
        raise OgrpoError(f"unknown dtype {dtype!r}; use fp32, bf16 or fp16")
    unknown = [p for p in parts if p not in BASELINE] + [p for p in paths if p not in LOGPROB_PATHS]
    if unknown:
        raise OgrpoError(f"unknown bench part/path {', '.join(unknown)}; parts: logprobs, sample; "
                         f"paths: {', '.join(LOGPROB_PATHS)}")
    if min(tokens, default=1) < 1 or hidden < 1 or vocab < 2 or batch < 1 or repeats < 1:
        raise OgrpoError("tokens, hidden, batch and repeats must be >= 1 and vocab >= 2")

    # before any child starts: a missing stack is one line, not three failed paths
    require(["torch", "transformers", "trl"], "ogrpo bench kernels")
    tags = environment_tags()
    rows: list[dict] = []
    results: list[dict] = []

    if "logprobs" in parts:
        if "ogrpo" in paths:
            _prebuild(out)
        table = []
        for n in tokens:
            # Rounds, each path once per round in a fresh process: a load that comes and goes on a shared
            # machine then hits every path alike instead of whichever ran during it (medians over rounds).
            rounds: dict[str, list[dict]] = {path: [] for path in paths}
            for _ in range(repeats):
                for path in paths:
                    if not any("error" in r for r in rounds[path]):
                        rounds[path].append(_run_child(LogprobCase(path, n, hidden, vocab, dtype, 1), case_timeout))
            case_results = {}
            for path in paths:
                r = _median_of_rounds(rounds[path])
                r.update(part="logprobs", case=f"N={n}", repeats=len(rounds[path]))
                case_results[path] = r
                results.append(r)
            base = case_results.get(BASELINE["logprobs"], {})
            # the gradients every path must return (hidden [N, H] and lm_head [V, H]); the peak without them is
            # the path's own working memory
            grads_mib = (n + vocab) * hidden * dtypes.BYTES[_DTYPES[dtype]] / 2**20
            for path, r in case_results.items():
                ok = "error" not in r
                if ok:
                    r["work_mib"] = max(r["peak_mib"] - grads_mib, 0.0)
                r["time_ratio"] = r["total_s"] / base["total_s"] if ok and "total_s" in base else None
                r["peak_ratio"] = (r["peak_mib"] / base["peak_mib"]
                                   if ok and base.get("peak_mib") else None)
                r["work_ratio"] = (r["work_mib"] / base["work_mib"]
                                   if ok and base.get("work_mib") else None)
                table.append([f"N={n}", PATH_NAMES[path], _fmt(r.get("fwd_s"), ".3f"), _fmt(r.get("bwd_s"), ".3f"),
                              _fmt(r.get("total_s"), ".3f"), _fmt(r["time_ratio"], ".2f"),
                              _fmt(r.get("peak_mib"), ".0f"), _fmt(r["peak_ratio"], ".2f"),
                              _fmt(r.get("work_mib"), ".0f"), _fmt(r["work_ratio"], ".2f"),
                              r.get("impl", "") if ok else f"ERROR: {r['error']}"])
                if ok:
                    params = json.dumps({"tokens": n, "hidden": hidden, "vocab": vocab, "dtype": dtype,
                                         "repeats": repeats, "impl": r["impl"]}, sort_keys=True)
                    for metric, unit in (("fwd_s", "s"), ("bwd_s", "s"), ("total_s", "s"), ("peak_mib", "MiB"),
                                         ("work_mib", "MiB"), ("baseline_slack_mib", "MiB"), ("time_ratio", "x"),
                                         ("peak_ratio", "x"), ("work_ratio", "x")):
                        if r[metric] is not None:
                            rows.append(make_row("kernels.logprobs", f"N={n}", path, metric, r[metric], unit,
                                                 params, tags))
        print(f"log-probs + entropy, forward + backward: hidden {hidden}, V={vocab}, {dtype}, median of {repeats} "
              "interleaved rounds, a fresh process per path and round "
              f"(ratios against {PATH_NAMES[BASELINE['logprobs']]})", file=out)
        print(format_table(["case", "path", "fwd s", "bwd s", "fwd+bwd s", "x time", "peak MiB", "x peak",
                            "w/o grads MiB", "x", "implementation"], table), file=out)
        print("peak: RSS high-water mark over one forward+backward above the inputs, in a fresh process per "
              "path; w/o grads: less the hidden and lm_head gradients every path returns", file=out)
        if "trl_1_16" in paths:
            print("TRL 1.16's fused head is trl.kernels.ChunkedLogProbFunction (add_fused_lm_head); TRL 1.9.2 "
                  "has none.", file=out)
        for n in tokens:
            ours = next((r for r in results if r.get("part") == "logprobs" and r["case"] == f"N={n}"
                         and r["path"] == "ogrpo" and "error" not in r), None)
            if ours and ours["peak_ratio"] is not None and ours["time_ratio"] is not None:
                met = ours["peak_ratio"] <= TARGETS["peak_ratio"] and ours["time_ratio"] <= TARGETS["time_ratio"]
                print(f"target N={n}: peak {ours['peak_ratio']:.2f}x <= {TARGETS['peak_ratio']}x and time "
                      f"{ours['time_ratio']:.2f}x <= {TARGETS['time_ratio']}x: {'MET' if met else 'NOT MET'}",
                      file=out)

    if "sample" in parts:
        table = []
        params = json.dumps({"batch": batch, "vocab": vocab, "history": history, "repeats": repeats})
        for case in SAMPLE_CASES:
            case_results = run_sample_case(case, batch, vocab, history, repeats)
            base = next((r for r in case_results if r["path"] == BASELINE["sample"] and "seconds" in r), None)
            for r in case_results:
                r["part"] = "sample"
                r["speedup"] = base["seconds"] / r["seconds"] if base and "seconds" in r else None
                results.append(r)
                table.append([case.name, PATH_NAMES[r["path"]], _fmt(r.get("seconds", math.nan) * 1e3, ".2f"),
                              _fmt(r["speedup"], ".2f"), r.get("error", "")])
                if "seconds" in r:
                    rows.append(make_row("kernels.sample", case.name, r["path"], "seconds", r["seconds"], "s",
                                         params, tags))
                    rows.append(make_row("kernels.sample", case.name, r["path"], "speedup", r["speedup"], "x",
                                         params, tags))
        print(f"\nsampling one token per row: batch {batch}, V={vocab}, {history} previous tokens, "
              f"T=0.7, penalty 1.1, median of {repeats}", file=out)
        print(format_table(["case", "path", "ms", "x faster", ""], table), file=out)
        for r in results:
            if r.get("part") == "sample" and r["path"] == "ogrpo" and r.get("speedup") is not None:
                met = r["speedup"] >= TARGETS["sample_speedup"]
                print(f"target {r['case']}: {r['speedup']:.2f}x >= {TARGETS['sample_speedup']}x faster: "
                      f"{'MET' if met else 'NOT MET'}", file=out)

    if csv_path and rows:
        path = append_rows(csv_path, rows)
        print(f"\n{len(rows)} rows appended to {path}", file=out)
    return results


def _prebuild(out: TextIO) -> None:
    """Build (or find) the CPU extension once here, so no child process times a compile."""
    try:
        _build.load_extension("linear_logprobs")
    except Exception as exc:  # noqa: BLE001 - the op falls back to its reference; the table says which ran
        print(f"note: the linear_logprobs extension did not build ({type(exc).__name__}); "
              "ogrpo runs its reference", file=out)


def _child_main(spec: str) -> int:
    case = LogprobCase(**json.loads(spec))
    print(RESULT_TAG + json.dumps(run_logprob_case(case)), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        raise SystemExit(_child_main(sys.argv[2]))
    raise SystemExit("usage: ogrpo bench kernels (this module's own entry point is for its child processes)")
