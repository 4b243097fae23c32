"""OgrpoGRPOTrainer's overlap layer (`ogrpo.overlap: lossless | one-step` on the split placement; the mechanism
and its invariants are in ogrpo.overlap.pipeline). The layer's methods (`Overlapped`) are the trainer's:

- `get_batch_samples` (transformers' Trainer) reads through a Lookahead, so the next optimizer step's generation
  batch can be seen before the loop takes it (the loop still gets every batch, in order);
- `_generate` stages the next batch's prompt ids (one-step), marks the client's training requests, and after
  the batch arrives checks and logs the policy version it was sampled with (`overlap/staleness`);
- `_generate_and_score_completions` starts the reward functions in a thread as soon as the completions exist
  and logs the importance-ratio statistics (`overlap/importance_ratio/*`, one-step);
- `_calculate_rewards` takes the thread's rewards; TRL's module-level `gather` defers its collective while it
  runs on that thread (ogrpo.patches.trl_overlap), and the main thread gathers, where TRL does;
- lossless, a server that batches concurrent requests: the batch streams group by group (ogrpo.overlap.pipeline
  Stream, GroupWork; the per-group work is in ogrpo.overlap.streaming). Each finished group's rewards run on the
  reward thread and its old-policy/reference log-probs on the main thread while the server generates the rest.
  With several trainer processes the main process broadcasts each finished group as it arrives, and the other
  ranks take the groups one by one (RankGroups, through ogrpo.patches.trl_overlap's broadcast). Under ZeRO-3
  the ranks' per-group passes and the choice to use them are kept in step, since every forward is a collective;
  `_get_per_token_logps_and_entropies` and `_calculate_rewards` then hand TRL those results, after checking that
  TRL's own batch tensors and completions are exactly the ones the groups were scored on (else TRL computes them
  as it would). `overlap/groups_early` logs how many groups were worked on before the last one arrived (the
  least over the ranks, as `overlap/streamed_passes` and `overlap/streamed_rewards`);
  `overlap/rewards_ahead` is 1 where the reward functions ran beside the log-prob passes (streamed or whole
  batch), 0 where TRL ran them on the main thread (a reward model);
- the main process's VLLMClient instance (its generate, weight push and prefix-cache reset) goes through
  ogrpo.overlap.pipeline.Pipeline;
- a callback pushes the weights when the optimizer step ends and stages the next batch (lossless).
Off (`overlap` None), every method is TRL's.
"""

from __future__ import annotations

import copy
import time

from ogrpo.errors import OgrpoError
from ogrpo.overlap import streaming, train_ahead
from ogrpo.overlap import pipeline as overlap
from ogrpo.overlap.pipeline import _spawn
from ogrpo.patches import trl_overlap as trl_collectives
from ogrpo.profile.profiler import Timeline
from ogrpo.serve import deadline


class OverlapState:
    def __init__(self, mode, lookahead, pipeline, timeline):
        self.mode, self.lookahead, self.pipeline, self.timeline = mode, lookahead, pipeline, timeline
        self.inputs = None  # the generation batch being scored (for the reward thread)
        self.rewards = None  # (inputs, prompts, completions, Future) of the reward thread
        self.staleness: list[int] = []
        self.work = None  # the streamed batch's GroupWork (ogrpo.overlap.pipeline), while it is scored
        self.streams = False  # lossless batches come back group by group (the plan's overlap.stream)
        self.completions = False  # ... and each group's completions one by one (Overlapped.stream_completions)
        self.lockstep = False  # several ranks whose forward passes are collectives (ZeRO-3)
        self.train_ahead = False  # the groups' loss forward/backward while the rest generate (train_ahead)
        self.train_ahead_fallbacks: list[str] = []  # why a batch's groups' gradients were dropped
        self.early_backward = True  # a group's completions' backward as each ends, where the loss allows
        # (the plan's overlap.early_backward: off where no group's gradient sums would fit)
        self.early_backward_groups: int | None = None  # open groups holding their sums at once (None: every one)
        self.early_backward_redone: list[str] = []  # why a group's early rows ran their backward again
        self.capture = None  # the forwards of a group trained ahead: [(log-probs, entropies)]
        self.forwards = None  # the chunk's rows whose loss forward ran as they ended (train_ahead.Forward)
        self.forwards_answered = 0  # such rows whose forward the chunk's loss took
        self.prefixes = False  # completions' scoring passes run on their prefixes (ogrpo.overlap.prefixes)
        self.prefix_forwards = False  # and their loss forwards (ogrpo.overlap.train_ahead)
        self.replay = None  # ogrpo.overlap.train_ahead.Replay: TRL's micro-batches answered from the groups
        # DeepSpeed (ogrpo.overlap.deepspeed_ahead): the loss the Trainer backwards next is a replayed micro-batch's,
        # and whether the groups gave the step a gradient the engine must show
        self.replayed = False
        self.trained_norm_expected = False
        self.gradient_divisor = 1.0  # dapo, cispo, vespo: what the step divides the groups' gradients by


class Overlapped:
    """The overlap's layer of OgrpoGRPOTrainer: between the profiler above (which times what the trainer waits
    for) and the pass counting and kernel beneath (the forwards that run). Off until `pipeline_generation`."""

    overlap: OverlapState | None = None

    @property
    def overlap_pipeline(self):
        return self.overlap.pipeline if self.overlap is not None else None

    def pipeline_generation(self, mode: str, stream: bool = False) -> dict:
        """Pipeline this trainer (built, not yet training) in `mode` (lossless | one-step). Raises OgrpoError
        where the mode cannot apply. Returns what was set up, for the manifest. `stream`: lossless batches come
        back group by group (the plan's `overlap.stream`, ogrpo/planner/overlap_stream.py)."""
        return install(self, mode, stream)

    def train_groups_ahead(self) -> str | None:
        """Train each streamed group as it arrives (ogrpo.overlap.train_ahead); returns why not, else None."""
        state = self.overlap
        if state is None or not state.streams:
            return "the batch does not come back group by group (overlap.stream)"
        reason = train_ahead.why_not(self)
        state.train_ahead = reason is None
        return reason

    def stream_completions(self) -> dict | None:
        """Once every layer is on: whether a streamed batch's completions come back one by one (each one's passes,
        and its loss forward where train-ahead runs, as it ends) or group by group; for the manifest's overlap."""
        state = self.overlap
        if state is None or not state.streams:
            return None
        reason = streaming.completions_stream(self)
        state.completions = reason is None
        return {"stream_unit": "completion" if reason is None else "group", "stream_unit_reason": reason}

    def stream_prefixes(self) -> dict | None:
        """Once the padding-free layer is on too: whether streamed completions' scoring passes run on their
        prefixes as they generate (ogrpo.overlap.prefixes); for the manifest's overlap."""
        state = self.overlap
        if state is None or not state.streams:
            return None
        why = streaming.prefix_passes(self) if state.completions else "the completions come back with their groups"
        state.prefixes = why is None
        if state.pipeline is not None:
            state.pipeline.prefix_tokens = state.prefixes
        forwards = train_ahead.prefix_forwards_why_not(self) if why is None else "no prefix passes"
        state.prefix_forwards = forwards is None
        return {"prefix_passes": why is None, "prefix_passes_reason": why, "prefix_forwards": forwards is None,
                "prefix_forwards_reason": forwards}

    # what runs beneath this layer: the reward thread and the per-group passes call it, as TRL's batch would
    def rewards_beneath(self, *args, **kwargs):
        return super()._calculate_rewards(*args, **kwargs)

    def logps_beneath(self, *args, **kwargs):
        return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if self.overlap is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batches = self.overlap.lookahead.take(epoch_iterator, num_batches)
        return batches, self._get_num_items_in_batch(batches, device)

    def _generate(self, prompts, *args, **kwargs):
        inner = super()._generate
        if self.overlap is None or args or kwargs:
            return inner(prompts, *args, **kwargs)
        return generate(self, self.overlap, inner, prompts)

    def _generate_and_score_completions(self, inputs, *args, **kwargs):
        inner = super()._generate_and_score_completions
        if self.overlap is None or args or kwargs:
            return inner(inputs, *args, **kwargs)
        return score(self, self.overlap, inner, inputs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        inner = super()._calculate_rewards
        if self.overlap is None:
            return inner(inputs, prompts, completions, completion_ids_list)
        return rewards(self, self.overlap, inner, inputs, prompts, completions, completion_ids_list)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args,
                                           **kwargs):
        inner = super()._get_per_token_logps_and_entropies
        state = self.overlap
        out = None
        if state is not None:
            if state.replay is not None and state.replay.current is not None:  # a micro-batch trained ahead
                logps, entropies = state.replay.answer(input_ids, logits_to_keep)
                return logps, (entropies if kwargs.get("compute_entropy") else None), None
            out = streaming.streamed_logps(self, state, model, input_ids, attention_mask, logits_to_keep, args, kwargs)
            if out is None and state.forwards:  # a chunk of a group trained ahead, some rows forwarded already
                out = train_ahead.answer_forwards(self, state.forwards, model, input_ids, attention_mask,
                                                  logits_to_keep, args, kwargs)
                state.forwards_answered += len(state.forwards) if out is not None else 0
        if out is None:
            out = inner(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if state is not None and state.capture is not None:  # a group's loss forward, trained ahead
            state.capture.append((out[0].detach(), out[1].detach() if out[1] is not None else None))
        return out

    def _compute_loss(self, model, inputs, *args, **kwargs):
        state = self.overlap
        replay = state.replay if state is not None else None
        if replay is None or train_ahead.ROW_KEY not in inputs or not self.model.training:
            return super()._compute_loss(model, inputs, *args, **kwargs)
        replay.current = inputs  # TRL's loss and metrics, on the groups' log-probs: no forward, no weight's grad
        try:
            loss = super()._compute_loss(model, inputs, *args, **kwargs)
            state.replayed = bool(getattr(self, "is_deepspeed_enabled", False))
            return loss
        finally:
            replay.current = None
            replay.left -= 1
            if replay.left <= 0:
                state.replay = None

    # reward functions' logging, collected per group on the reward thread and replayed in batch order
    def _log_completion_extra(self, *args):
        if not streaming.kept_logging("extra", args):
            return super()._log_completion_extra(*args)

    def _log_metric(self, *args):
        if not streaming.kept_logging("metric", args):
            return super()._log_metric(*args)


def install(trainer, mode: str, stream: bool) -> dict:
    if mode not in overlap.MAX_STALENESS:
        raise OgrpoError(f"ogrpo.overlap {mode!r}: install takes {' or '.join(overlap.MAX_STALENESS)}")
    problems = overlap.unsupported(trainer.args, trainer)
    if problems:
        raise OgrpoError(f"ogrpo.overlap {mode} cannot run: " + "; ".join(problems) + "; set ogrpo.overlap: off")
    trl_collectives.check()

    timeline = trainer.timeline = trainer.timeline or Timeline()  # the stage profiler reads the same spans
    streams = mode == overlap.LOSSLESS and stream  # the plan's: the same on every rank
    pipeline = None
    if trainer.accelerator.is_main_process:
        split = streaming.splitter(trainer, lambda: trainer.overlap.completions) if streams else None
        pipeline = overlap.Pipeline(mode, lambda: trainer.state.global_step, timeline, split=split)
        pipeline.attach(trainer.vllm_generation.vllm_client)
    state = OverlapState(mode, overlap.Lookahead(), pipeline, timeline)
    state.streams = streams
    if streams and trainer.accelerator.num_processes > 1:
        state.lockstep = bool(getattr(trainer, "is_deepspeed_enabled", False)
                              or getattr(trainer, "is_fsdp_enabled", False))
        trl_collectives.hand_groups_over()
    trl_collectives.defer_reward_gather()
    trainer.overlap = state
    trainer.add_callback(_callback(trainer, state))
    return {"mode": mode, "max_staleness": overlap.MAX_STALENESS[mode],
            "importance_sampling_correction": bool(getattr(trainer.args, "vllm_importance_sampling_correction",
                                                           False))}


def _stage_next(trainer, state) -> None:
    """Every rank: the next generation batch's prompt ids, gathered; rank 0 stages the unique ones (TRL sends
    each prompt once with n=num_generations). Nothing is staged unless every rank has its next batch."""
    from accelerate.utils import gather_object

    batch = state.lookahead.peek()
    local = None
    if batch is not None:
        prompts = [x["prompt"] for x in batch]
        local = [list(ids) for ids in trainer._tokenize_prompts(copy.deepcopy(prompts))[0]]
    everyone = gather_object([local])
    if state.pipeline is not None:
        if any(part is None for part in everyone):
            state.pipeline.stage(None)
        else:
            ids = [p for part in everyone for p in part]
            state.pipeline.stage(ids[::trainer.num_generations])


def generate(trainer, state, original, prompts):
    from accelerate.utils import broadcast_object_list

    if not trainer.model.training:
        return original(prompts)
    step = trainer.state.global_step
    if state.mode == overlap.ONE_STEP and step + 1 < trainer.state.max_steps:
        _stage_next(trainer, state)
    work = streaming.group_work(trainer, state, prompts)
    state.work = work
    if state.pipeline is not None:
        state.pipeline.active = True
        state.pipeline.on_group = work.arrived if work is not None else None
        state.pipeline.on_part = work.part_arrived if work is not None and (work.row_fn or work.then_part) else None
        # which completions go with their groups depends on timing: only where that already decides the rounding
        state.pipeline.regroup = work is not None and work.ahead is not None
        # one process trains its pending groups the moment their rewards are done (several: RankGroups decides)
        state.pipeline.side = work.ahead if work is not None and trainer.accelerator.num_processes == 1 else None
    if state.streams and trainer.accelerator.num_processes > 1:
        streaming.rank_groups(trainer, state, work, prompts)
    try:
        out = original(prompts)
        if work is not None and work.ahead is not None:
            work.ahead.finish()  # every group is in: the ones whose rewards came last
    finally:
        trl_collectives.handoff.groups = None
        if state.pipeline is not None:
            state.pipeline.active = False
            state.pipeline.on_group = state.pipeline.on_part = state.pipeline.side = None
    version = broadcast_object_list([state.pipeline.consumed_version if state.pipeline else None])[0]
    staleness = overlap.check_staleness(state.mode, step, version)
    state.staleness.append(staleness)
    trainer._metrics["train"]["overlap/staleness"].append(float(staleness))
    trainer._metrics["train"]["overlap/sampled_version"].append(float(version))
    if state.timeline is not None:
        state.timeline.note(staleness=staleness, sampled_version=version)
    if state.inputs is not None and streaming.rewards_can_run_ahead(trainer) and \
            not (work is not None and work.rewards):
        _start_rewards(trainer, state, prompts, completions=out[3], completion_ids=out[1])
    return out


def _log_streamed(trainer, state) -> None:
    """What the streamed groups gave TRL instead of its own computation: `overlap/streamed_passes`, `_rewards`,
    `overlap/groups_early` and `overlap/completions_early` (completions whose passes ran as each ended), the least
    over the ranks (each rank streams its own groups)."""
    work = state.work
    counts = [float(len(work.taken)), float(work.used_rewards), float(work.early()),
              float(sum(len(rows) for rows in work.rows.values()))] if work is not None else None
    if state.streams and trainer.accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        everyone = gather_object([counts])
        counts = None if None in everyone else [min(c) for c in zip(*everyone)]
    if counts is not None:
        for name, value in zip(("streamed_passes", "streamed_rewards", "groups_early", "completions_early"),
                               counts):
            trainer._metrics["train"][f"overlap/{name}"].append(value)
    if state.completions and state.pipeline is not None:  # 0: the trainer was the bottleneck, groups took theirs
        trainer._metrics["train"]["overlap/completions_alone"].append(float(state.pipeline.parts_alone))
    if state.prefixes and work is not None:  # completions scored on their prefixes as they streamed
        trainer._metrics["train"]["overlap/prefix_passes"].append(float(work.prefix_used))
        if state.prefix_forwards:  # and their loss forwards
            trainer._metrics["train"]["overlap/prefix_forwards"].append(float(work.prefix_forwards))


def _start_rewards(trainer, state, prompts, completions, completion_ids) -> None:
    inputs = state.inputs

    def run():
        trl_collectives.deferred.on = True
        t0 = time.time_ns()
        try:
            return trainer.rewards_beneath(inputs, prompts, completions, completion_ids)
        finally:
            trl_collectives.deferred.on = False
            if state.timeline is not None:
                state.timeline.record("trainer", "reward", t0, time.time_ns())

    state.rewards = (inputs, prompts, completions, _spawn(run, "ogrpo-overlap-rewards"))


def rewards(trainer, state, original, inputs, prompts, completions, completion_ids_list):
    streamed = streaming.streamed_rewards(trainer, state, inputs, prompts, completions, completion_ids_list)
    ahead = trainer._metrics["train"]["overlap/rewards_ahead"] if trainer.model.training else []
    if streamed is not None:
        ahead.append(1.0)
        return trl_collectives.real_gather()(streamed)
    pending, state.rewards = state.rewards, None
    if pending is not None and pending[0] is inputs and pending[1] is prompts and pending[2] is completions:
        ahead.append(1.0)
        return trl_collectives.real_gather()(pending[3].result())
    ahead.append(0.0)
    return original(inputs, prompts, completions, completion_ids_list)


def score(trainer, state, original, inputs):
    state.inputs = inputs if trainer.model.training else None
    try:
        out = original(inputs)
        if trainer.model.training:
            _log_streamed(trainer, state)
            if state.work is not None and state.work.ahead is not None:
                state.replay = state.work.ahead.adopt(out)
    finally:
        state.inputs = None
        work, state.work = state.work, None
        if work is not None:
            work.wait()  # a reward thread never outlives its batch
        if state.rewards is not None:  # never taken (an error in between): do not leave it for the next batch
            state.rewards[3].exception()
            state.rewards = None
    if state.mode == overlap.ONE_STEP and trainer.model.training:
        _log_ratios(trainer, out)
    return out


def _log_ratios(trainer, out: dict) -> None:
    import torch

    old, sampled = out.get("old_per_token_logps"), out.get("sampling_per_token_logps")
    if old is None or sampled is None:
        return
    mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
    counts = overlap.ratio_counts(old, sampled, mask, getattr(trainer, "vllm_importance_sampling_clip_min", None),
                                  getattr(trainer, "vllm_importance_sampling_clip_max", None),
                                  getattr(trainer, "vllm_importance_sampling_mode", "") in
                                  ("sequence_mask", "sequence_truncate"))
    rows = trainer.accelerator.gather(torch.tensor([counts], dtype=torch.float64, device=old.device))
    for key, value in overlap.ratio_stats(rows.view(-1, 5).tolist()).items():
        trainer._metrics["train"][f"overlap/importance_ratio/{key}"].append(value)


def _callback(trainer, state):
    from transformers import TrainerCallback

    class OverlapCallback(TrainerCallback):
        def on_step_end(self, args, st, control, **kwargs):
            # lossless: the weights are final once the optimizer has stepped; the push and the next request go
            # out now, before logging, evaluation and checkpointing, instead of when the next batch is scored
            if state.mode != overlap.LOSSLESS or st.global_step >= st.max_steps or control.should_training_stop:
                return

            if deadline.stopping.is_set():  # SIGTERM: training stops after this step (saved without the server,
                return  # which got the same signal); a resumed run pushes its own weights first
            _stage_next(trainer, state)
            trainer.vllm_generation.sync_weights()
            trainer._last_loaded_step = st.global_step

        def on_train_end(self, args, st, control, **kwargs):
            if state.pipeline is not None:
                state.pipeline.close()

    return OverlapCallback()
