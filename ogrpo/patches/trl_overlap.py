"""TRL's GRPOTrainer on the split placement, pipelined (`ogrpo.overlap: lossless | one-step`; the mechanism and
its invariants are in ogrpo.train.overlap). No TRL file is edited; on the one trainer instance:

- `get_batch_samples` (transformers' Trainer) reads through a Lookahead, so the next optimizer step's generation
  batch can be seen before the loop takes it (the loop still gets every batch, in order);
- `_generate` stages the next batch's prompt ids (one-step), marks the client's training requests, and after
  the batch arrives checks and logs the policy version it was sampled with (`overlap/staleness`);
- `_generate_and_score_completions` starts the reward functions in a thread as soon as the completions exist
  and logs the importance-ratio statistics (`overlap/importance_ratio/*`, one-step);
- `_calculate_rewards` takes the thread's rewards; the module-level `gather` of TRL's trainer module defers its
  collective while it runs on that thread, and the main thread gathers, where TRL does;
- the main process's VLLMClient instance (its generate, weight push and prefix-cache reset) goes through
  ogrpo.train.overlap.Pipeline;
- a callback pushes the weights when the optimizer step ends and stages the next batch (lossless).
"""

from __future__ import annotations

import copy
import inspect
import threading
import time

from ogrpo.patches.target import moved, problems_of

NAME = "trl_overlap"
LIBRARY = "trl"
_GRPO = "trl.trainer.grpo_trainer"
_defer = threading.local()  # set on the reward thread: TRL's gather of the rewards waits for the main thread


def check() -> None:
    from ogrpo import compat

    gen = compat.vllm_generation_module().__name__
    problems = problems_of({
        f"{_GRPO}:GRPOTrainer._generate": ("prompts",),
        f"{_GRPO}:GRPOTrainer._generate_and_score_completions": ("inputs",),
        f"{_GRPO}:GRPOTrainer._calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
        f"{_GRPO}:GRPOTrainer._tokenize_prompts": ("prompts",),
        f"{_GRPO}:gather": None,
        "transformers:Trainer.get_batch_samples": ("epoch_iterator", "num_batches", "device"),
        "transformers:Trainer._get_num_items_in_batch": ("batch_samples", "device"),
        f"{gen}:VLLMGeneration.sync_weights": ("self",),
        f"{gen}:VLLMClient.generate": ("prompts",),
        f"{gen}:VLLMClient.reset_prefix_cache": ("self",),
    })
    if not problems:
        from trl.trainer import grpo_trainer
        from transformers import Trainer

        sources = {"GRPOTrainer._calculate_rewards": (grpo_trainer.GRPOTrainer._calculate_rewards,
                                                      "gather(rewards_per_func)"),
                   "GRPOTrainer._generate": (grpo_trainer.GRPOTrainer._generate,
                                             "return prompt_ids, completion_ids, tool_mask, completions"),
                   "Trainer.get_batch_samples": (Trainer.get_batch_samples, "next(epoch_iterator)")}
        for name, (fn, needle) in sources.items():
            if needle not in inspect.getsource(fn):
                problems.append(f"{name} no longer contains `{needle}`")
    if problems:
        raise moved(NAME, LIBRARY, problems)


class _State:
    def __init__(self, mode, lookahead, pipeline, timeline):
        self.mode, self.lookahead, self.pipeline, self.timeline = mode, lookahead, pipeline, timeline
        self.inputs = None  # the generation batch being scored (for the reward thread)
        self.rewards = None  # (inputs, prompts, completions, Future) of the reward thread
        self.staleness: list[int] = []


def install(trainer, mode: str, timeline=None) -> dict:
    """Pipeline `trainer` (built, not yet training) in `mode` (lossless | one-step). Raises OgrpoError where the
    mode cannot apply. Returns what was installed, for the manifest. `timeline`: ogrpo.train.profiler.Timeline."""
    from ogrpo.errors import OgrpoError
    from ogrpo.train import overlap

    if mode not in overlap.MAX_STALENESS:
        raise OgrpoError(f"ogrpo.overlap {mode!r}: install takes {' or '.join(overlap.MAX_STALENESS)}")
    problems = overlap.unsupported(trainer.args, trainer)
    if problems:
        raise OgrpoError(f"ogrpo.overlap {mode} cannot run: " + "; ".join(problems) + "; set ogrpo.overlap: off")
    check()
    from ogrpo.train.profiler import Timeline

    timeline = timeline or getattr(trainer, "_ogrpo_timeline", None) or Timeline()
    trainer._ogrpo_timeline = timeline  # the stage profiler reads the same spans
    pipeline = None
    if trainer.accelerator.is_main_process:
        pipeline = overlap.Pipeline(mode, lambda: trainer.state.global_step, timeline)
        pipeline.attach(trainer.vllm_generation.vllm_client)
    state = _State(mode, overlap.Lookahead(), pipeline, timeline)
    trainer._ogrpo_overlap = state
    _defer_reward_gather()
    _wrap(trainer, "get_batch_samples", lambda orig: _get_batch_samples(trainer, state))
    _wrap(trainer, "_generate", lambda orig: _generate(trainer, state, orig))
    _wrap(trainer, "_generate_and_score_completions", lambda orig: _score(trainer, state, orig))
    _wrap(trainer, "_calculate_rewards", lambda orig: _rewards(trainer, state, orig))
    trainer.add_callback(_callback(trainer, state))
    return {"mode": mode, "max_staleness": overlap.MAX_STALENESS[mode],
            "importance_sampling_correction": bool(getattr(trainer.args, "vllm_importance_sampling_correction",
                                                           False))}


def _wrap(trainer, name: str, make) -> None:
    import functools

    original = getattr(trainer, name)
    wrapped = make(original)
    functools.update_wrapper(wrapped, original)
    setattr(trainer, name, wrapped)


def _defer_reward_gather() -> None:
    """TRL gathers the rewards across ranks at the end of `_calculate_rewards`; on the reward thread that
    collective would run beside the main thread's (DDP's, ZeRO-3's): there it returns the local tensor and the
    main thread gathers it when it takes the rewards, where TRL would have. Idempotent."""
    import importlib

    mod = importlib.import_module(_GRPO)
    if getattr(mod.gather, "_ogrpo_original", None) is not None:
        return
    real = mod.gather

    def gather(tensor):
        return tensor if getattr(_defer, "on", False) else real(tensor)

    gather._ogrpo_original = real
    mod.gather = gather


def _real_gather():
    import importlib

    g = importlib.import_module(_GRPO).gather
    return getattr(g, "_ogrpo_original", g)


def _get_batch_samples(trainer, state):
    def get_batch_samples(epoch_iterator, num_batches, device):
        batches = state.lookahead.take(epoch_iterator, num_batches)
        return batches, trainer._get_num_items_in_batch(batches, device)

    return get_batch_samples


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


def _generate(trainer, state, original):
    from accelerate.utils import broadcast_object_list

    from ogrpo.train import overlap

    def _generate(prompts):
        if not trainer.model.training:
            return original(prompts)
        step = trainer.state.global_step
        if state.mode == overlap.ONE_STEP and step + 1 < trainer.state.max_steps:
            _stage_next(trainer, state)
        if state.pipeline is not None:
            state.pipeline.active = True
        try:
            out = original(prompts)
        finally:
            if state.pipeline is not None:
                state.pipeline.active = False
        version = broadcast_object_list([state.pipeline.consumed_version if state.pipeline else None])[0]
        staleness = overlap.check_staleness(state.mode, step, version)
        state.staleness.append(staleness)
        trainer._metrics["train"]["overlap/staleness"].append(float(staleness))
        trainer._metrics["train"]["overlap/sampled_version"].append(float(version))
        if state.timeline is not None:
            state.timeline.note(staleness=staleness, sampled_version=version)
        if state.inputs is not None and _rewards_can_run_ahead(trainer):
            _start_rewards(trainer, state, prompts, completions=out[3], completion_ids=out[1])
        return out

    return _generate


def _rewards_can_run_ahead(trainer) -> bool:
    import torch

    # a reward model runs on the trainer's device: left on the main thread
    return not any(isinstance(f, torch.nn.Module) for f in trainer.reward_funcs)


def _start_rewards(trainer, state, prompts, completions, completion_ids) -> None:
    from ogrpo.train.overlap import _spawn

    inputs, original = state.inputs, trainer._ogrpo_calculate_rewards

    def run():
        _defer.on = True
        t0 = time.time_ns()
        try:
            return original(inputs, prompts, completions, completion_ids)
        finally:
            _defer.on = False
            if state.timeline is not None:
                state.timeline.record("trainer", "reward", t0, time.time_ns())

    state.rewards = (inputs, prompts, completions, _spawn(run, "ogrpo-overlap-rewards"))


def _rewards(trainer, state, original):
    trainer._ogrpo_calculate_rewards = original

    def _calculate_rewards(inputs, prompts, completions, completion_ids_list):
        pending, state.rewards = state.rewards, None
        if pending is not None and pending[0] is inputs and pending[1] is prompts and pending[2] is completions:
            return _real_gather()(pending[3].result())
        return original(inputs, prompts, completions, completion_ids_list)

    return _calculate_rewards


def _score(trainer, state, original):
    from ogrpo.train import overlap

    def _generate_and_score_completions(inputs):
        state.inputs = inputs if trainer.model.training else None
        try:
            out = original(inputs)
        finally:
            state.inputs = None
            if state.rewards is not None:  # never taken (an error in between): do not leave it for the next batch
                state.rewards[3].exception()
                state.rewards = None
        if state.mode == overlap.ONE_STEP and trainer.model.training:
            _log_ratios(trainer, out)
        return out

    return _generate_and_score_completions


def _log_ratios(trainer, out: dict) -> None:
    import torch

    from ogrpo.train import overlap

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

    from ogrpo.train import overlap

    class OverlapCallback(TrainerCallback):
        def on_step_end(self, args, st, control, **kwargs):
            # lossless: the weights are final once the optimizer has stepped; the push and the next request go
            # out now, before logging, evaluation and checkpointing, instead of when the next batch is scored
            if state.mode != overlap.LOSSLESS or st.global_step >= st.max_steps or control.should_training_stop:
                return
            _stage_next(trainer, state)
            trainer.vllm_generation.sync_weights()
            trainer._last_loaded_step = st.global_step

        def on_train_end(self, args, st, control, **kwargs):
            if state.pipeline is not None:
                state.pipeline.close()

    return OverlapCallback()
