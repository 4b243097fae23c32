"""Per-step stage profile of a GRPOTrainer, taken at its stage boundaries.

The trainer's class calls the profiler: ogrpo.profile.hooks' layers of OgrpoGRPOTrainer (`StageTiming`:
`_generate`, `_calculate_rewards`, `_get_per_token_logps_and_entropies`, `_generate_and_score_completions`,
`training_step`; `PassCounting` beneath the overlap), and a TrainerCallback closes each optimizer step. Stages, in seconds per optimizer step:

- generation: rollouts (`_generate`: vLLM or HF generate, including the weight push to vLLM);
- reward: the reward functions (`_calculate_rewards`);
- logprobs: reference and old-policy log-probs computed while scoring the rollouts (no grad); 0 when TRL needs
  neither (beta 0 and no importance sampling);
- train: loss + backward (training_step minus rollout/scoring time) + clip + optimizer step + zero_grad;
- other: the rest of the step (padding, advantages, logging bookkeeping).

Waste per pass: every log-prob forward runs over the whole padded batch it is given (prompts left-padded,
completions padded to the longest). `pass_tokens` counts the positions each kind of pass computed ("score": the
reference and old-policy passes; "loss": the policy forward inside the loss), `pass_real_tokens` those its
attention mask keeps (a packed pass: those that are not filler, a prompt computed once for its rows counting
once), and `pad_share` = 1 - real / computed: the share of that pass's compute spent on padding.
The count sits beneath the overlap (ogrpo.profile.hooks.PassCounting): where `lossless` scores the groups as
they arrive, their own passes (each group padded to its own longest) are what is counted, not TRL's call of the
whole batch that the overlap then answers without a forward.

On the split placement (a separate vLLM server) each row also says how much of the step each device set sat
idle (`idle_share`: {"server": .., "trainer": ..}) from a Timeline of busy spans: the server is busy while it
generates (a request in flight, whichever thread sent it) or receives weights (the push); the trainer is idle
while its main thread waits on a generation request, busy otherwise (scoring, rewards, training, the push).
With `ogrpo.overlap` (ogrpo/overlap/pipeline.py) requests run beside the trainer and spans cross step boundaries;
each step counts the part inside it. The first TIMELINE_STEPS rows also carry the spans themselves (`lanes`:
per device set, [start s, end s, stage] relative to the step's start; `step_start_unix_s`: when it began):
the trainer lane's stages are score (reference/old-policy log-probs), reward, train (training_step), push and
wait (idle: its main thread blocked on the server); ogrpo.profile.timeline draws them. Every row carries
`batch_sha`, a digest of the step's training prompts and completions (this process's share of the batch): the
identity of the batch stream, which a resumed run must reproduce.

Memory, per step: the CUDA allocator's peak on GPU; resident set size (current and process peak) on CPU. Beside
it, the plan's trainer estimate and a measurement of the same thing (the memory model's calibration, see
docs/memory-calibration.md): `mem_estimate_gib` is the plan's per-process estimate without its runtime term
(CUDA context, allocator slack / interpreter), `mem_measured_gib` the peak bytes of live tensors in this
process during the step, `mem_measure` how:

- `cuda_max_memory_allocated`: torch.cuda.max_memory_allocated() over the step (every step, free);
- `cpu_live_tensor_peak`: on CPU torch keeps no allocator statistics, so the first MEASURE_STEPS steps are
  measured exactly (TensorPeak): the CPU allocator's allocations and frees, with their addresses, followed
  by torch's profiler (AllocationTrace: allocations only) from the moment the profiler is attached, through the
  DDP / DeepSpeed set-up, to the end of the last measured step; at each step's start the count is the storages of
  all live Python-visible tensors (a garbage-collector walk, each storage once) joined by address with the
  blocks allocated since attach and still live (what only C++ holds: DDP's buckets, DeepSpeed's buffers). A
  step's value is the count's maximum (`mem_step_start_gib`: the count when it began, `mem_peak_stage`: the
  stage the peak fell in). Later steps are not profiled (the trace costs memory and time); they carry the
  estimate only, and their RSS is the run's own (release_heap, run_peak_gib). Only the process that writes the
  profile (rank 0) measures.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

from ogrpo.patches.trl_vllm_wraps import wrap
from ogrpo.planner.memory import tensor_gib

STAGES = ("generation", "reward", "logprobs", "train")
GIB = 1024**3
MEASURE_STEPS = 3  # CPU steps whose live-tensor peak is measured: the first builds the optimizer state lazily
TIMELINE_STEPS = 8  # rows that carry their busy spans (profile.jsonl stays small on long runs)


class StageProfiler:
    def __init__(self, path: Path | None = None, memory_terms: dict | None = None,
                 measure_steps: int = MEASURE_STEPS):
        """`memory_terms`: the plan's trainer estimate (`plan.trainer.memory_terms`); without it the rows
        carry the measurement only."""
        self.path = Path(path) if path else None
        self.rows: list[dict] = []
        self.estimate = estimate_fields(memory_terms)
        self.measure_steps = measure_steps if self.path is not None else 0  # only the process that writes rows
        self._tensor_peak: TensorPeak | None = None
        self._step_start_bytes = 0
        self._measured = 0  # steps measured so far
        self._reset()
        self._scoring_depth = 0
        self._scoring_s = 0.0  # time inside rollout scoring during the current training_step
        self._trainer = None
        self.timeline: Timeline | None = None  # server mode only
        self.step_start_ns: int | None = None
        self.timeline_steps = TIMELINE_STEPS

    def _reset(self) -> None:
        self.acc = dict.fromkeys(STAGES, 0.0)
        self.tokens = 0
        self.logprob_passes = 0  # scoring calls in the step: the reference model, and the old policy when needed
        self.pass_tokens: dict[str, list] = {}  # "score" | "loss" -> [positions computed, positions kept]
        self.spans: list[tuple[str, int, int]] = []  # (stage, start, end) in unix ns: where a memory peak falls
        self.sequences = 0
        self.batch = None  # hashlib digest of the step's training batches
        self.step_start: float | None = None
        self.last_train_step_end: float | None = None

    # --- the trainer's hooks (ogrpo.profile.hooks: StageTiming, PassCounting) call these ------------------------
    def attach(self, trainer) -> "StageProfiler":
        """Profile `trainer`, a class with ogrpo.profile.hooks' layers in it (OgrpoGRPOTrainer, or `profiled(...)`
        of a plain GRPOTrainer): its hooks call this profiler from now on."""
        self._trainer = trainer
        if self.measure_steps > 0 and not _cuda():
            # from here, before train() wraps the model in DDP / DeepSpeed: their buffers are counted as made
            self._tensor_peak = TensorPeak().start()
        trainer.stage_profiler = self
        self._attach_timeline(trainer)
        trainer.add_callback(self.callback())
        return self

    def _attach_timeline(self, trainer) -> None:
        """Server mode: busy spans of the push (trainer and server) and of the main thread's generation requests
        (the trainer waits; the server generates, unless the overlap pipeline sent the request and records it).
        TRL's VLLMGeneration and VLLMClient are instances of TRL's classes the trainer builds: their methods are
        timed through ogrpo.patches.trl_vllm_wraps (the trainer's own are its class's)."""
        vg = getattr(trainer, "vllm_generation", None)
        if vg is None or getattr(vg, "mode", None) != "server":
            return
        self.timeline = trainer.timeline = getattr(trainer, "timeline", None) or Timeline()

        timeline = self.timeline
        drained: dict = {}  # end of the overlap pipeline's wait for the request in flight, within this push

        def timed_push(push):
            def sync_weights(*args, **kwargs):
                t0 = time.time_ns()
                drained.clear()
                try:
                    return push(*args, **kwargs)
                finally:
                    t1 = time.time_ns()
                    t0 = max(t0, drained.get("end", t0))  # the weights move once the server finished generating
                    timeline.record("trainer", "push", t0, t1)
                    timeline.record("server", "weights", t0, t1)

            return sync_weights

        wrap(vg, "sync_weights", "profiler", timed_push, kind="vllm_generation")
        client = getattr(vg, "vllm_client", None)
        if client is None:  # ranks other than the main process send no requests
            return
        pipeline = getattr(trainer, "overlap_pipeline", None)
        if pipeline is not None:  # a push first waits for the request in flight: the trainer idles on the server
            drain = pipeline.drain

            @functools.wraps(drain)
            def wait_for_requests(*args, **kwargs):
                t0 = time.time_ns()
                try:
                    return drain(*args, **kwargs)
                finally:
                    drained["end"] = t1 = time.time_ns()
                    timeline.record("trainer", "wait", t0, t1)

            pipeline.drain = wait_for_requests
        server_side = pipeline is None

        def timed_request(request):
            def generate(*args, **kwargs):
                t0 = time.time_ns()
                try:
                    return request(*args, **kwargs)
                finally:
                    t1 = time.time_ns()
                    timeline.record("trainer", "wait", t0, t1)
                    if server_side:
                        timeline.record("server", "generate", t0, t1)

            return generate

        wrap(client, "generate", "profiler", timed_request, kind="vllm_client")

    def timed(self, stage: str, fn, *args, **kwargs):
        t0, n0 = time.perf_counter(), time.time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            self.acc[stage] += time.perf_counter() - t0
            self._span(stage, n0, time.time_ns())

    # the profiler's stages as the trainer lane's (the overlap's reward thread records its own "reward")
    LANE_STAGE = {"reward": "reward", "logprobs": "score", "train": "train"}

    def _span(self, stage: str, n0: int, n1: int) -> None:
        self.spans.append((stage, n0, n1))
        if self.timeline is not None and stage in self.LANE_STAGE:
            self.timeline.record("trainer", self.LANE_STAGE[stage], n0, n1)

    def _note_batch(self, out) -> None:
        """Fold this generation's prompts and completions into the step's batch digest (training batches only)."""
        import hashlib

        model = getattr(self._trainer, "model", None)
        if model is not None and not model.training:
            return
        try:  # (prompt_ids, completion_ids, ...) in TRL 1.x: lists of token ids, or tensors
            ids = [[_ids(x) for x in out[0]], [_ids(x) for x in out[1]]]
        except (TypeError, IndexError):
            return
        if self.batch is None:
            self.batch = hashlib.sha256()
        self.batch.update(json.dumps(ids, separators=(",", ":")).encode())

    def generation(self, fn, *args, **kwargs):
        t0, n0 = time.perf_counter(), time.time_ns()
        out = fn(*args, **kwargs)
        self.acc["generation"] += time.perf_counter() - t0
        self.spans.append(("generation", n0, time.time_ns()))
        self._note_batch(out)
        try:  # (prompt_ids, completion_ids, ...) in TRL 1.x
            completion_ids = out[1]
            self.tokens += sum(len(c) for c in completion_ids)
            self.sequences += len(completion_ids)
        except (TypeError, IndexError):
            pass
        return out

    def counted_pass(self, fn, *args, computed=None, **kwargs):
        """The `passes` layer: the positions one forward that runs computes and those its mask keeps. `computed`:
        after the pass, (positions computed, positions not filler) when not its padded rows' (a packed pass, which
        may compute a shared prompt once), else None."""
        # (model, input_ids, attention_mask, ...) in both TRL lines' _get_per_token_logps_and_entropies
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        out = fn(*args, **kwargs)
        if mask is not None and hasattr(mask, "numel"):
            counts = self.pass_tokens.setdefault("score" if self._scoring_depth else "loss", [0, 0])
            positions = computed() if computed is not None else None
            if positions is None:
                counts[0] += int(mask.numel())
                counts[1] = counts[1] + mask.sum()  # a tensor until the step closes: no device sync per pass
            else:  # (computed, not filler): a shared prompt is computed once, and counts once
                counts[0] += positions[0]
                counts[1] = counts[1] + positions[1]
        return out

    def count_positions(self, computed: int, real: int) -> None:
        """A pass's positions counted where it runs outside `counted_pass` (a completion's prefix scored in
        pieces through a key/value cache, ogrpo.overlap.prefixes: every position computed is a real one)."""
        counts = self.pass_tokens.setdefault("score" if self._scoring_depth else "loss", [0, 0])
        counts[0] += int(computed)
        counts[1] = counts[1] + int(real)

    def logprob_pass(self, fn, *args, **kwargs):
        if self._scoring_depth == 0:  # the policy forward inside the loss: counted in "train"
            return fn(*args, **kwargs)
        self.logprob_passes += 1
        return self.timed("logprobs", fn, *args, **kwargs)

    def ahead_begin(self) -> int:
        """A group's loss forward/backward, trained ahead inside the wait for generation
        (ogrpo.overlap.train_ahead): its forward is the loss's (not a scoring pass), its time the train stage's."""
        depth, self._scoring_depth = self._scoring_depth, 0
        return depth

    def ahead_end(self, depth: int, t0_ns: int) -> None:
        self._scoring_depth = depth
        self.acc["train"] += (time.time_ns() - t0_ns) / 1e9

    def scoring(self, fn, *args, **kwargs):
        self._scoring_depth += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._scoring_depth -= 1
            self._scoring_s += time.perf_counter() - t0

    def training_step(self, fn, *args, **kwargs):
        self._scoring_s = 0.0
        t0, n0 = time.perf_counter(), time.time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            self.acc["train"] += (t1 - t0) - self._scoring_s
            self.last_train_step_end = t1
            self._span("train", n0, time.time_ns())

    # --- step boundaries ---------------------------------------------------------------------------------------
    def callback(self):
        from transformers import TrainerCallback

        prof = self

        class ProfilerCallback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                prof._reset()
                if _cuda():
                    import torch

                    torch.cuda.reset_peak_memory_stats()
                elif prof._measured < prof.measure_steps:
                    if prof._tensor_peak is not None and prof._tensor_peak.running:
                        prof._tensor_peak.window(rebase=True)  # set-up since the last step: not its peak
                    else:  # no follow-up since attach: from a walk of the live tensors
                        prof._tensor_peak = TensorPeak().start()
                    prof._step_start_bytes = prof._tensor_peak.live
                prof.step_start = time.perf_counter()  # after the baseline walk: not step time
                prof.step_start_ns = time.time_ns()

            def on_step_end(self, args, state, control, **kwargs):
                prof.close_step(state.global_step, state.is_world_process_zero)

            def on_train_end(self, args, state, control, **kwargs):
                prof.finish()  # a run shorter than measure_steps ends with the profiler still recording

        return ProfilerCallback()

    def finish(self) -> None:
        if self._tensor_peak is not None and self._tensor_peak.running:
            self._tensor_peak.stop()

    def _stage_at(self, t_ns: int | None) -> str:
        """The innermost stage running at t_ns; outside every training_step: the optimizer step."""
        for stage in ("generation", "reward", "logprobs", "train"):  # innermost first
            if t_ns is not None and any(s == stage and a <= t_ns <= b for s, a, b in self.spans):
                return "loss_backward" if stage == "train" else stage
        return "optimizer"

    def close_step(self, step: int, write: bool = True) -> dict:
        now = time.perf_counter()
        if self.last_train_step_end is not None:
            self.acc["train"] += now - self.last_train_step_end  # clip + optimizer.step + scheduler + zero_grad
        total = now - (self.step_start if self.step_start is not None else now)
        row = {"step": step, **{f"{s}_s": round(v, 6) for s, v in self.acc.items()},
               "other_s": round(max(0.0, total - sum(self.acc.values())), 6), "step_s": round(total, 6),
               "completion_tokens": self.tokens, "completions": self.sequences,
               "logprob_passes": self.logprob_passes, **pass_waste(self.pass_tokens),
               "gen_tokens_per_s": round(self.tokens / self.acc["generation"], 2) if self.acc["generation"] else 0.0,
               "tokens_per_s": round(self.tokens / total, 2) if total else 0.0}
        if self.batch is not None:
            row["batch_sha"] = self.batch.hexdigest()[:16]
        if self.timeline is not None and self.step_start_ns is not None:
            row.update(self.timeline.window(self.step_start_ns, time.time_ns(),
                                            lanes=len(self.rows) < self.timeline_steps))
        row.update(memory_row())
        row.update(self.estimate)
        if row["device"] == "cuda":
            row.update(mem_measured_gib=row["peak_mem_gib"], mem_measure="cuda_max_memory_allocated")
        elif self._tensor_peak is not None and self._tensor_peak.running:
            self._measured += 1
            peak = self._tensor_peak.window(keep_going=self._measured < self.measure_steps)
            # what persists across steps (weights, optimizer state, buckets) vs the step's own peak, and when
            row.update(mem_measured_gib=round(peak / GIB, 6), mem_measure=TensorPeak.METHOD,
                       mem_step_start_gib=round(self._step_start_bytes / GIB, 6),
                       mem_peak_stage=self._stage_at(self._tensor_peak.peak_ns))
        self.rows.append(row)
        if write and self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        self._reset()
        return row


class Timeline:
    """Busy spans of the split placement's two device sets, in unix ns, recorded from any thread: lane "server"
    (generate, weights) and lane "trainer" (push, reward, and "wait": its main thread blocked on the server).
    A span still open (a request in flight) counts up to the end of each window that asks."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.spans: list[tuple[str, str, int, int]] = []
        self.open_spans: dict[int, tuple[str, str, int]] = {}
        self.notes: dict = {}

    def record(self, lane: str, stage: str, t0_ns: int, t1_ns: int) -> None:
        with self._lock:
            self.spans.append((lane, stage, t0_ns, t1_ns))

    def open(self, lane: str, stage: str) -> int:
        with self._lock:
            span = next(self._ids)
            self.open_spans[span] = (lane, stage, time.time_ns())
            return span

    def close(self, span: int) -> None:
        with self._lock:
            lane, stage, t0 = self.open_spans.pop(span)
            self.spans.append((lane, stage, t0, time.time_ns()))

    def note(self, **values) -> None:
        """Per-step values for the next row (the overlap pipeline's staleness and sampled version)."""
        self.notes.update(values)

    def window(self, start_ns: int, end_ns: int, lanes: bool = False) -> dict:
        """The step [start_ns, end_ns]: seconds the server was busy, seconds the trainer waited on it, each set's
        idle share, the notes, and with `lanes` the spans themselves (clipped to the step, seconds from its
        start); spans that ended inside it are dropped."""
        with self._lock:
            spans = self.spans + [(lane, stage, t0, end_ns) for lane, stage, t0 in self.open_spans.values()]
            self.spans = [sp for sp in self.spans if sp[3] > end_ns]
            notes, self.notes = self.notes, {}
        total = max(end_ns - start_ns, 1)

        def busy(keep) -> int:
            return _union_ns([(max(a, start_ns), min(b, end_ns)) for lane, stage, a, b in spans
                              if keep(lane, stage) and b > start_ns and a < end_ns])

        server = busy(lambda lane, stage: lane == "server")
        # under `lossless` the main thread scores finished groups inside its wait for the rest, and the reward
        # thread runs beside it: the trainer idles only while it waits and does nothing else
        # ("train" is TRL's whole training_step, which holds the wait for generation itself: not counted here)
        working = busy(lambda lane, stage: lane == "trainer" and stage in BUSY_IN_WAIT)
        wait = busy(lambda lane, stage: lane == "trainer" and stage in ("wait", *BUSY_IN_WAIT)) - working
        row = {"server_busy_s": round(server / 1e9, 6), "trainer_wait_s": round(wait / 1e9, 6),
               "idle_share": {"server": round(1 - server / total, 4), "trainer": round(wait / total, 4)}, **notes}
        if lanes:
            row["step_start_unix_s"] = start_ns / 1e9
            row["step_span_s"] = round(total / 1e9, 6)
            row["lanes"] = {lane: sorted([round((max(a, start_ns) - start_ns) / 1e9, 6),
                                          round((min(b, end_ns) - start_ns) / 1e9, 6), stage]
                                         for ln, stage, a, b in spans if ln == lane and b > start_ns and a < end_ns)
                            for lane in LANES}
        return row


LANES = ("server", "trainer")
IDLE_STAGES = {"trainer": ("wait",)}  # a lane's stages that are idle time (the server has none: busy or not)
# trainer work that can run while its main thread waits on the server (a group's passes, rewards, loss backward)
BUSY_IN_WAIT = ("score", "reward", "train_ahead")


def lane_busy_share(lane: str, spans: list, span_s: float) -> float:
    """Share of a step a lane was busy, from its `lanes` entry: the server while any span runs; the trainer
    except while it waits on the server (what `idle_share` counts, recomputed from the spans)."""
    if span_s <= 0:
        return 0.0
    idle = IDLE_STAGES.get(lane)
    if idle is None:
        return _union_ns([(int(a * 1e9), int(b * 1e9)) for a, b, _ in spans]) / 1e9 / span_s
    both = _union_ns([(int(a * 1e9), int(b * 1e9)) for a, b, stage in spans if stage in (*idle, *BUSY_IN_WAIT)])
    working = _union_ns([(int(a * 1e9), int(b * 1e9)) for a, b, stage in spans if stage in BUSY_IN_WAIT])
    return 1 - (both - working) / 1e9 / span_s  # idle: waiting and doing nothing else


def _ids(x) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def estimate_fields(memory_terms: dict | None) -> dict:
    """The plan's per-process trainer estimate as profile fields: the tensor part (what both measurements
    see) and the runtime term (CUDA context and allocator slack, or the CPU interpreter) neither sees."""
    terms = (memory_terms or {}).get("terms")
    if not terms:
        return {}

    return {"mem_estimate_gib": round(tensor_gib(terms), 6), "mem_runtime_gib": round(terms.get("runtime", 0.0), 3)}


class TensorPeak:
    """Live CPU tensor bytes, followed exactly. torch.profiler (profile_memory=True) reports each allocation and
    free of the CPU allocator with its address, but a free only for a block allocated while it was recording;
    so a count starts from a walk over the live tensors (through the garbage collector, each storage once) and
    is re-based at each window on the same walk joined, by address, with the blocks allocated since start()
    and not yet freed: those include what only C++ holds (DDP's gradient buckets, DeepSpeed's buffers), which
    no walk over Python objects finds. Started before the trainer wraps the model, the count sees them made.
    window() closes the span since the last one and returns its peak."""

    METHOD = "cpu_live_tensor_peak"

    def start(self) -> "TensorPeak":
        self.blocks: dict[int, int] = {}  # address -> bytes of the blocks allocated since start(), still live
        self.baseline = self.live = sum(live_storages().values())
        self.peak_ns: int | None = None
        self._begin()
        return self

    def _begin(self) -> None:
        global _RECORDING
        # torch's profiler is one per process: a second one started over a running one corrupts both (the
        # first's callbacks are gone when it stops, "Requested callback is not found", then a segfault).
        if _RECORDING is not None and _RECORDING is not self:
            _RECORDING.abandon()
        # kineto logs every start and stop ("USDT: ... profiler_start") at a level above ERROR: 6 is silent; read
        # at the first start, and a user's own KINETO_LOG_LEVEL wins
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self._prof = AllocationTrace().start()
        _RECORDING = self

    def abandon(self) -> None:
        """Stop recording without counting (the process ends, or another measurement takes over)."""
        global _RECORDING
        prof, self._prof = getattr(self, "_prof", None), None
        if _RECORDING is self:
            _RECORDING = None
        if prof is not None:
            prof.stop()

    def window(self, keep_going: bool = True, rebase: bool = False) -> int:
        """Peak live bytes since the last window (or start); then, with `rebase`, the count re-based on a walk
        (a step's start); goes on following unless keep_going is False."""
        prof = self._prof
        self.abandon()
        peak, self.peak_ns = self.live, None
        allocations, prof = _allocations(prof.result), None
        for t_ns, ptr, nbytes in allocations:
            self.live += nbytes
            if nbytes > 0:
                self.blocks[ptr] = nbytes
            else:
                self.blocks.pop(ptr, None)
            if self.live > peak:
                peak, self.peak_ns = self.live, t_ns  # unix ns, like the profiler's stage spans
        del allocations
        release_heap()
        if rebase:
            walk = live_storages()
            self.live = sum(walk.values()) + sum(n for ptr, n in self.blocks.items() if ptr not in walk)
        if keep_going:
            self._begin()
        return peak

    def stop(self) -> int:
        return self.window(keep_going=False)

    @property
    def running(self) -> bool:
        return getattr(self, "_prof", None) is not None


_RECORDING: TensorPeak | None = None  # the one TensorPeak whose profiler records now


@atexit.register
def _stop_recording() -> None:
    # A torch.profiler still recording when the interpreter tears down segfaults in kineto's destructor (rc 139
    # after a clean run): whatever way the process ends (an exception, a preemption's exit, a short run), stop it.
    if _RECORDING is not None:
        _RECORDING.abandon()


class AllocationTrace:
    """torch's profiler recording the CPU allocator's allocations and frees. Its operator callbacks are limited to
    the user scope (`record_function` blocks); allocations are reported apart from those callbacks, so the trace
    holds a step's allocations, not every operator it ran. A `lossless` step that scores each completion alone runs
    tens of thousands of operators, and recording them took 2.6x the memory (0.50 against 0.19 GiB for the same
    90,000 allocations). Where that private entry point is missing or changed: torch.profiler.profile, which
    records the operators too."""

    def __init__(self):
        self.result = None  # torch's profiler result once stopped (its event tree), None if nothing was recorded
        self._public = None

    def start(self) -> "AllocationTrace":
        import torch
        from torch._C import _profiler as tp
        from torch.profiler import ProfilerActivity

        activities = {ProfilerActivity.CPU}
        try:
            config = tp.ProfilerConfig(tp.ProfilerState.KINETO, False, True, False, False, False,
                                       tp._ExperimentalConfig())  # input shapes, memory, stack, flops, modules
            torch._C._autograd._prepare_profiler(config, activities)
            torch._C._autograd._enable_profiler(config, activities, {tp.RecordScope.USER_SCOPE})
        except (AttributeError, TypeError):
            from torch.profiler import profile

            self._public = profile(activities=list(activities), profile_memory=True)
            self._public.__enter__()
        return self

    def stop(self):
        if self._public is None:
            import torch

            self.result = torch._C._autograd._disable_profiler()
        else:
            self._public.__exit__(None, None, None)
            self.result = self._public.profiler.kineto_results if self._public.profiler else None
            self._public = None
        return self.result


def _allocations(result) -> list[tuple[int, int, int]]:
    """(time ns, address, +bytes allocated / -bytes freed) of the CPU allocator in a profiler result, in order."""
    from torch._C._profiler import _EventType

    out, stack = [], list(result.experimental_event_tree()) if result is not None else []
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            if f.device.type == "cpu" and f.alloc_size:
                out.append((node.start_time_ns, f.ptr, f.alloc_size))
    out.sort(key=lambda x: x[0])
    return out


def live_storages() -> dict[int, int]:
    """Address -> bytes of the CPU storages that live Python-visible tensors (parameters, buffers, optimizer
    state, DeepSpeed's flat partitions, ...) hold, each storage once however many views share it."""
    import gc

    import torch

    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # not isinstance: that reads __class__ of lazy proxies
            continue
        try:
            st = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, functional or meta wrappers hold no storage
            continue
        if st.device.type == "cpu" and st.data_ptr():
            storages[st.data_ptr()] = max(storages.get(st.data_ptr(), 0), st.nbytes())
    return storages


def live_tensor_bytes() -> int:
    return sum(live_storages().values())


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def memory_row() -> dict:
    if _cuda():
        import torch

        return {"device": "cuda", "peak_mem_gib": round(torch.cuda.max_memory_allocated() / GIB, 4)}
    import psutil

    rss = psutil.Process().memory_info().rss
    return {"device": "cpu", "rss_gib": round(rss / GIB, 4), "peak_mem_gib": round(_peak_rss() / GIB, 4)}


def _peak_rss() -> int:
    """The process's resident high-water mark: the kernel's VmHWM, which release_heap resets (ru_maxrss keeps
    the highest mark of any thread that ever exited, so it cannot be reset); ru_maxrss where there is no /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    # ru_maxrss is KiB on Linux, bytes on macOS.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def release_heap() -> None:
    """After a measured window: give the heap the profiler's trace took back, and start the resident high-water
    mark again from here. The trace (its finalization, the events read from it) is the measurement's own memory,
    larger the more a step allocates (a step that scores each completion alone allocates several times as often
    as one that scores a batch): freed, glibc keeps the pages, so it would count as the run's peak RSS in every
    step after. A step measured still records its own trace; the steps after it
    show the run alone (run_peak_gib)."""
    import gc

    gc.collect()  # the profiler's Python objects hold the events through reference cycles
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux >= 4.0: resets VmHWM to the current RSS
    except OSError:
        pass


def run_peak_gib(rows: list[dict]) -> float:
    """A run's peak memory from its profile rows: on CPU, over the steps the live-tensor measurement did not record
    where there are any (its trace inflates the RSS of the steps it records, release_heap); else every step."""
    clean = [r for r in rows if r.get("mem_measure") != TensorPeak.METHOD]
    return max(r.get("peak_mem_gib", 0.0) for r in (clean or rows))


def pass_waste(counts: dict[str, list[int]]) -> dict:
    """pass_tokens, pass_real_tokens and pad_share per kind of pass ({} when no pass ran)."""
    if not counts:
        return {}
    counts = {k: (int(c[0]), int(c[1])) for k, c in counts.items()}
    return {"pass_tokens": {k: c[0] for k, c in counts.items()},
            "pass_real_tokens": {k: c[1] for k, c in counts.items()},
            "pad_share": {k: round(1 - c[1] / c[0], 6) if c[0] else 0.0 for k, c in counts.items()}}


def pad_shares(rows: list[dict]) -> dict[str, float]:
    """pad_share per kind of pass over ROWS: padded positions over all positions computed."""
    counts: dict[str, list[int]] = {}
    for r in rows:
        for kind, n in (r.get("pass_tokens") or {}).items():
            c = counts.setdefault(kind, [0, 0])
            c[0] += n
            c[1] += r["pass_real_tokens"][kind]
    return pass_waste(counts).get("pad_share", {})


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
    out["peak_mem_gib"] = run_peak_gib(rows)
    idle = [r["idle_share"] for r in rows if isinstance(r.get("idle_share"), dict)]
    if idle:
        out["idle_share"] = {lane: sum(i[lane] for i in idle) / len(idle) for lane in ("server", "trainer")}
    shares = pad_shares(rows)
    if shares:
        out["pad_share"] = shares
    out["device"] = rows[-1].get("device")
    out.update(memory_calibration(rows))
    return out


def memory_calibration(rows: list[dict]) -> dict:
    """The plan's estimate against the largest measured step (the manifest's record for calibration)."""
    measured = [r for r in rows if r.get("mem_measured_gib") is not None]
    out = {k: rows[-1][k] for k in ("mem_estimate_gib", "mem_runtime_gib") if k in rows[-1]}
    if measured:
        top = max(measured, key=lambda r: r["mem_measured_gib"])
        out.update(mem_measured_gib=top["mem_measured_gib"], mem_measure=top["mem_measure"],
                   mem_measured_step=top["step"], mem_measured_steps=len(measured))
        if out.get("mem_estimate_gib"):
            out["mem_measured_over_estimate"] = round(top["mem_measured_gib"] / out["mem_estimate_gib"], 4)
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
    if "pad_share" in s:
        names = {"score": "scoring passes", "loss": "loss forward"}
        console.print("padding computed (pad_share): " + " · ".join(
            f"{names.get(k, k)} {100 * v:.1f}%" for k, v in s["pad_share"].items()), soft_wrap=True)
    if "idle_share" in s:
        console.print(f"idle share of the step: server {100 * s['idle_share']['server']:.1f}% · trainer "
                      f"{100 * s['idle_share']['trainer']:.1f}%", soft_wrap=True)
