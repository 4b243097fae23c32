"""Per-step stage profile of a GRPOTrainer, taken by hooking the trainer instance at stage boundaries.

No TRL source is patched: `attach` wraps bound methods on the one trainer instance (`_generate`,
`_calculate_rewards`, `_get_per_token_logps_and_entropies`, `_generate_and_score_completions`, `training_step`)
and a TrainerCallback closes each optimizer step. Stages, in seconds per optimizer step:

- generation: rollouts (`_generate`: vLLM or HF generate, including the weight push to vLLM);
- reward: the reward functions (`_calculate_rewards`);
- logprobs: reference and old-policy log-probs computed while scoring the rollouts (no grad); 0 when TRL needs
  neither (beta 0 and no importance sampling);
- train: loss + backward (training_step minus rollout/scoring time) + clip + optimizer step + zero_grad;
- other: the rest of the step (padding, advantages, logging bookkeeping).

Memory: the CUDA allocator's peak for the step on GPU; resident set size (current and process peak) on CPU.
"""

from __future__ import annotations

import functools
import json
import resource
import sys
import time
from pathlib import Path

STAGES = ("generation", "reward", "logprobs", "train")
GIB = 1024**3


class StageProfiler:
    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path else None
        self.rows: list[dict] = []
        self._reset()
        self._scoring_depth = 0
        self._scoring_s = 0.0  # time inside rollout scoring during the current training_step
        self._trainer = None

    def _reset(self) -> None:
        self.acc = dict.fromkeys(STAGES, 0.0)
        self.tokens = 0
        self.sequences = 0
        self.step_start: float | None = None
        self.last_train_step_end: float | None = None

    # --- hooks on the trainer instance -------------------------------------------------------------------------
    def attach(self, trainer) -> "StageProfiler":
        self._trainer = trainer
        self._wrap(trainer, "_generate", self._on_generate)
        self._wrap(trainer, "_calculate_rewards", self._timed("reward"))
        self._wrap(trainer, "_get_per_token_logps_and_entropies", self._on_logps)
        self._wrap(trainer, "_generate_and_score_completions", self._on_scoring)
        self._wrap(trainer, "training_step", self._on_training_step)
        trainer.add_callback(self.callback())
        return self

    @staticmethod
    def _wrap(trainer, name: str, make) -> None:
        original = getattr(trainer, name, None)
        if original is None:
            raise RuntimeError(f"GRPOTrainer has no {name}; update ogrpo/train/profiler.py for this TRL version")
        wrapped = make(original)
        functools.update_wrapper(wrapped, original)
        setattr(trainer, name, wrapped)

    def _timed(self, stage: str):
        def make(fn):
            def inner(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.acc[stage] += time.perf_counter() - t0
            return inner
        return make

    def _on_generate(self, fn):
        def inner(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.acc["generation"] += time.perf_counter() - t0
            try:  # (prompt_ids, completion_ids, ...) in TRL 1.x
                completion_ids = out[1]
                self.tokens += sum(len(c) for c in completion_ids)
                self.sequences += len(completion_ids)
            except (TypeError, IndexError):
                pass
            return out
        return inner

    def _on_logps(self, fn):
        def inner(*args, **kwargs):
            if self._scoring_depth == 0:  # the policy forward inside the loss: counted in "train"
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc["logprobs"] += time.perf_counter() - t0
        return inner

    def _on_scoring(self, fn):
        def inner(*args, **kwargs):
            self._scoring_depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._scoring_depth -= 1
                self._scoring_s += time.perf_counter() - t0
        return inner

    def _on_training_step(self, fn):
        def inner(*args, **kwargs):
            self._scoring_s = 0.0
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                self.acc["train"] += (t1 - t0) - self._scoring_s
                self.last_train_step_end = t1
        return inner

    # --- step boundaries ---------------------------------------------------------------------------------------
    def callback(self):
        from transformers import TrainerCallback

        prof = self

        class ProfilerCallback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                prof._reset()
                prof.step_start = time.perf_counter()
                if _cuda():
                    import torch

                    torch.cuda.reset_peak_memory_stats()

            def on_step_end(self, args, state, control, **kwargs):
                prof.close_step(state.global_step, state.is_world_process_zero)

        return ProfilerCallback()

    def close_step(self, step: int, write: bool = True) -> dict:
        now = time.perf_counter()
        if self.last_train_step_end is not None:
            self.acc["train"] += now - self.last_train_step_end  # clip + optimizer.step + scheduler + zero_grad
        total = now - (self.step_start if self.step_start is not None else now)
        row = {"step": step, **{f"{s}_s": round(v, 6) for s, v in self.acc.items()},
               "other_s": round(max(0.0, total - sum(self.acc.values())), 6), "step_s": round(total, 6),
               "completion_tokens": self.tokens, "completions": self.sequences,
               "gen_tokens_per_s": round(self.tokens / self.acc["generation"], 2) if self.acc["generation"] else 0.0,
               "tokens_per_s": round(self.tokens / total, 2) if total else 0.0}
        row.update(memory_row())
        self.rows.append(row)
        if write and self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        self._reset()
        return row


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def memory_row() -> dict:
    if _cuda():
        import torch

        return {"device": "cuda", "peak_mem_gib": round(torch.cuda.max_memory_allocated() / GIB, 4)}
    import psutil

    rss = psutil.Process().memory_info().rss
    # ru_maxrss is KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"device": "cpu", "rss_gib": round(rss / GIB, 4), "peak_mem_gib": round(peak / GIB, 4)}


def summarize(rows: list[dict]) -> dict:
    """Totals and per-step means by stage, the share of step time, peak memory and generation throughput."""
    if not rows:
        return {"steps": 0}
    total_step = sum(r["step_s"] for r in rows)
    out = {"steps": len(rows), "step_s_mean": total_step / len(rows), "stages": {}}
    for stage in (*STAGES, "other"):
        tot = sum(r[f"{stage}_s"] for r in rows)
        out["stages"][stage] = {"total_s": tot, "mean_s": tot / len(rows),
                                "share": tot / total_step if total_step else 0.0}
    gen = sum(r["generation_s"] for r in rows)
    toks = sum(r["completion_tokens"] for r in rows)
    out["gen_tokens_per_s"] = toks / gen if gen else 0.0
    out["peak_mem_gib"] = max(r["peak_mem_gib"] for r in rows)
    out["device"] = rows[-1].get("device")
    return out


def render_table(rows: list[dict], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    s = summarize(rows)
    if not s["steps"]:
        console.print("no steps profiled")
        return
    table = Table(title=f"Stage profile ({s['steps']} steps, {s['step_s_mean']:.3f} s/step)")
    table.add_column("stage")
    table.add_column("total s", justify="right")
    table.add_column("s/step", justify="right")
    table.add_column("share", justify="right")
    for stage, v in s["stages"].items():
        table.add_row(stage, f"{v['total_s']:.3f}", f"{v['mean_s']:.4f}", f"{100 * v['share']:.1f}%")
    mem = "GPU allocator peak" if s["device"] == "cuda" else "peak RSS"
    console.print(table)
    console.print(f"{mem} {s['peak_mem_gib']:.2f} GiB · generation {s['gen_tokens_per_s']:.0f} completion tok/s",
                  soft_wrap=True)
