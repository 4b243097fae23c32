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
- lossless, a server that batches concurrent requests: the batch streams group by group (ogrpo.train.overlap.Stream,
  GroupWork). Each finished group's rewards run on the reward thread and its old-policy/reference log-probs on the
  main thread while the server generates the rest. With several trainer processes the main process broadcasts
  each finished group (its completion ids) as it arrives, inside its wait for the server, while the other ranks,
  instead of waiting in TRL's one broadcast of the whole batch, take the groups one by one and work on their own
  (ogrpo.train.overlap.RankGroups); TRL's broadcast then runs as before. Under ZeRO-3 the ranks' per-group passes
  and the choice to use them are kept in step, since every forward is a collective;
  `_get_per_token_logps_and_entropies` and `_calculate_rewards` then hand TRL those results, after checking that
  TRL's own batch tensors and completions are exactly the ones the groups were scored on (else TRL computes them
  as it would). `overlap/groups_early` logs how many groups were worked on before the last one arrived (the
  least over the ranks, as `overlap/streamed_passes` and `overlap/streamed_rewards`);
  `overlap/rewards_ahead` is 1 where the reward functions ran beside the log-prob passes (streamed or whole
  batch), 0 where TRL ran them on the main thread (a reward model);
- the main process's VLLMClient instance (its generate, weight push and prefix-cache reset) goes through
  ogrpo.train.overlap.Pipeline;
- a callback pushes the weights when the optimizer step ends and stages the next batch (lossless).
"""

from __future__ import annotations

import copy
import inspect
import threading
import time

from ogrpo.patches.target import moved, problems_of, trl_generation_module

NAME = "trl_overlap"
LIBRARY = "trl"
_GRPO = "trl.trainer.grpo_trainer"
_defer = threading.local()  # set on the reward thread: TRL's gather of the rewards waits for the main thread


def check() -> None:
    gen = trl_generation_module(NAME)
    problems = problems_of({
        f"{_GRPO}:GRPOTrainer._generate": ("prompts",),
        f"{_GRPO}:GRPOTrainer._generate_and_score_completions": ("inputs",),
        f"{_GRPO}:GRPOTrainer._calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
        f"{_GRPO}:GRPOTrainer._tokenize_prompts": ("prompts",),
        f"{_GRPO}:GRPOTrainer._get_per_token_logps_and_entropies": ("model", "input_ids", "attention_mask",
                                                                     "logits_to_keep", "batch_size"),
        f"{_GRPO}:gather": None,
        f"{_GRPO}:disable_gradient_checkpointing": None,
        f"{gen}:broadcast_object_list": None,
        "trl.data_utils:is_conversational": None,
        "transformers:Trainer.get_batch_samples": ("epoch_iterator", "num_batches", "device"),
        "transformers:Trainer._get_num_items_in_batch": ("batch_samples", "device"),
        f"{gen}:VLLMGeneration.sync_weights": ("self",),
        f"{gen}:VLLMClient.generate": ("prompts",),
        f"{gen}:VLLMClient.reset_prefix_cache": ("self",),
    })
    if not problems:
        import importlib

        from trl.trainer import grpo_trainer
        from transformers import Trainer

        sources = {"GRPOTrainer._calculate_rewards": (grpo_trainer.GRPOTrainer._calculate_rewards,
                                                      "gather(rewards_per_func)"),
                   "GRPOTrainer._generate": (grpo_trainer.GRPOTrainer._generate,
                                             "return prompt_ids, completion_ids, tool_mask, completions"),
                   "Trainer.get_batch_samples": (Trainer.get_batch_samples, "next(epoch_iterator)"),
                   # every rank reaches this broadcast after the main process's request: where the groups are handed
                   # over (RankGroups), the ranks that wait in it take them first
                   "VLLMGeneration.generate": (importlib.import_module(gen).VLLMGeneration.generate,
                                               "broadcast_object_list(obj_list, from_process=0)"),
                   # the per-group passes build what TRL's batch pass reads (a mismatch only loses the overlap)
                   "GRPOTrainer._generate_and_score_completions": (
                       grpo_trainer.GRPOTrainer._generate_and_score_completions,
                       "torch.cat([prompt_ids, completion_ids], dim=1)")}
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
        self.work = None  # the streamed batch's GroupWork (ogrpo.train.overlap), while it is scored
        self.logps = None  # the trainer's log-prob pass as installed before the overlap
        self.streams = False  # lossless batches come back group by group (the plan's overlap.stream)
        self.lockstep = False  # several ranks whose forward passes are collectives (ZeRO-3)


def install(trainer, mode: str, timeline=None, server_dp: int = 1) -> dict:
    """Pipeline `trainer` (built, not yet training) in `mode` (lossless | one-step). Raises OgrpoError where the
    mode cannot apply. Returns what was installed, for the manifest. `timeline`: ogrpo.train.profiler.Timeline;
    `server_dp`: the server's data-parallel engines (the plan's)."""
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
    streams = mode == overlap.LOSSLESS and _streams(trainer, server_dp)  # the same on every rank
    pipeline = None
    if trainer.accelerator.is_main_process:
        split = _splitter(trainer) if streams else None
        pipeline = overlap.Pipeline(mode, lambda: trainer.state.global_step, timeline, split=split)
        pipeline.attach(trainer.vllm_generation.vllm_client)
    state = _State(mode, overlap.Lookahead(), pipeline, timeline)
    state.streams = streams
    if streams and trainer.accelerator.num_processes > 1:
        state.lockstep = bool(getattr(trainer, "is_deepspeed_enabled", False)
                              or getattr(trainer, "is_fsdp_enabled", False))
        _hand_groups_over()
    trainer._ogrpo_overlap = state
    _defer_reward_gather()
    _wrap(trainer, "get_batch_samples", lambda orig: _get_batch_samples(trainer, state))
    _wrap(trainer, "_generate", lambda orig: _generate(trainer, state, orig))
    _wrap(trainer, "_generate_and_score_completions", lambda orig: _score(trainer, state, orig))
    _wrap(trainer, "_calculate_rewards", lambda orig: _rewards(trainer, state, orig))
    state.logps = trainer._get_per_token_logps_and_entropies  # O-GRPO's kernel, where installed (before this)
    _wrap(trainer, "_get_per_token_logps_and_entropies", lambda orig: _logps(trainer, state, orig))
    for name, key in (("_log_completion_extra", "extra"), ("_log_metric", "metric")):
        if hasattr(trainer, name):  # reward functions' logging, collected per group and replayed in batch order
            _wrap(trainer, name, lambda orig, key=key: _sunk(orig, key))
    trainer.add_callback(_callback(trainer, state))
    return {"mode": mode, "max_staleness": overlap.MAX_STALENESS[mode],
            "importance_sampling_correction": bool(getattr(trainer.args, "vllm_importance_sampling_correction",
                                                           False))}


def _wrap(trainer, name: str, make) -> None:
    from ogrpo.patches.trl_trainer_wraps import wrap

    wrap(trainer, name, "overlap", make)  # the `overlap` layer: its place among the others is stated there


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
        work = _group_work(trainer, state, prompts)
        state.work = work
        if state.pipeline is not None:
            state.pipeline.active = True
            state.pipeline.on_group = work.arrived if work is not None else None
        if state.streams and trainer.accelerator.num_processes > 1:
            _rank_groups(trainer, state, work, prompts)
        try:
            out = original(prompts)
        finally:
            _handoff.groups = None
            if state.pipeline is not None:
                state.pipeline.active = False
                state.pipeline.on_group = None
        version = broadcast_object_list([state.pipeline.consumed_version if state.pipeline else None])[0]
        staleness = overlap.check_staleness(state.mode, step, version)
        state.staleness.append(staleness)
        trainer._metrics["train"]["overlap/staleness"].append(float(staleness))
        trainer._metrics["train"]["overlap/sampled_version"].append(float(version))
        if state.timeline is not None:
            state.timeline.note(staleness=staleness, sampled_version=version)
        if state.inputs is not None and _rewards_can_run_ahead(trainer) and not (work is not None and work.rewards):
            _start_rewards(trainer, state, prompts, completions=out[3], completion_ids=out[1])
        return out

    return _generate


def _log_streamed(trainer, state) -> None:
    """What the streamed groups gave TRL instead of its own computation: `overlap/streamed_passes`, `_rewards` and
    `overlap/groups_early`, the least over the ranks (each rank streams its own groups)."""
    work = state.work
    counts = [float(len(work.taken)), float(work.used_rewards), float(work.early())] if work is not None else None
    if state.streams and trainer.accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        everyone = gather_object([counts])
        counts = None if None in everyone else [min(c) for c in zip(*everyone)]
    if counts is not None:
        for name, value in zip(("streamed_passes", "streamed_rewards", "groups_early"), counts):
            trainer._metrics["train"][f"overlap/{name}"].append(value)


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
        streamed = _streamed_rewards(trainer, state, inputs, prompts, completions, completion_ids_list)
        ahead = trainer._metrics["train"]["overlap/rewards_ahead"] if trainer.model.training else []
        if streamed is not None:
            ahead.append(1.0)
            return _real_gather()(streamed)
        pending, state.rewards = state.rewards, None
        if pending is not None and pending[0] is inputs and pending[1] is prompts and pending[2] is completions:
            ahead.append(1.0)
            return _real_gather()(pending[3].result())
        ahead.append(0.0)
        return original(inputs, prompts, completions, completion_ids_list)

    return _calculate_rewards


def _score(trainer, state, original):
    from ogrpo.train import overlap

    def _generate_and_score_completions(inputs):
        state.inputs = inputs if trainer.model.training else None
        try:
            out = original(inputs)
            if trainer.model.training:
                _log_streamed(trainer, state)
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

    return _generate_and_score_completions


# ---- lossless streaming: the groups' rewards and log-prob passes ------------------------------------------------
# Every reading of TRL's internals for the per-group work is in this section (the same on TRL 1.9.2 and 1.16:
# _tokenize_prompts, processing_class.batch_decode, `pad_to_multiple_of`, `mask_truncated_completions`, the
# old/ref pass conditions of _generate_and_score_completions, `disable_gradient_checkpointing`). What it gets
# wrong only costs the overlap: TRL's own tensors and completions are compared before a result is used.
_REF_FILL = -1e4  # reference log-prob past a sequence's end (masked): exp(ref - logp) stays 0, never inf x 0
_OLD_FILL = 0.0  # old-policy log-prob there: exp(logp - old) <= 1


def _streams(trainer, server_dp: int = 1) -> bool:
    """Whether lossless batches come back group by group: the plan's `overlap.stream`, decided by the same rule
    (this TRL line's server, the trainer processes and their share of each batch)."""
    import trl

    from ogrpo.planner.overlap_stream import GROUPS, decide

    args = trainer.args
    rows = args.per_device_train_batch_size * (args.steps_per_generation or args.gradient_accumulation_steps)
    return decide(trl.__version__, trainer.accelerator.num_processes, rows, trainer.num_generations,
                  server_dp)[0] == GROUPS


def _splitter(trainer):
    """The main process's pipeline `split`: one request per prompt group."""
    import trl

    from ogrpo import compat
    from ogrpo.serve.client import group_calls

    flavor = compat.server_flavor(trl.__version__)
    client = trainer.vllm_generation.vllm_client
    return lambda prompts, sampling: group_calls(client, prompts, sampling, flavor)


_handoff = threading.local()  # the batch whose groups the main process hands over (RankGroups), until TRL's broadcast


def _hand_groups_over() -> None:
    """TRL's broadcast of the generated batch, where a batch's groups are handed over first: the main process
    ends its per-group broadcasts with None, the other ranks take groups until that None; then TRL's own
    broadcast runs on every rank as before. Idempotent."""
    import importlib

    from ogrpo.patches.target import trl_generation_module

    mod = importlib.import_module(trl_generation_module(NAME))
    if getattr(mod.broadcast_object_list, "_ogrpo_original", None) is not None:
        return
    real = mod.broadcast_object_list

    def broadcast_object_list(object_list, from_process=0):
        groups, _handoff.groups = getattr(_handoff, "groups", None), None
        if groups is not None:
            from accelerate.state import PartialState

            if PartialState().is_main_process:
                real([None], from_process=0)
            else:
                while True:
                    item = [None]
                    real(item, from_process=0)
                    if item[0] is None:
                        break
                    groups.arrived(*item[0])
        return real(object_list, from_process=from_process)

    broadcast_object_list._ogrpo_original = real
    mod.broadcast_object_list = broadcast_object_list


def _rank_groups(trainer, state, work, prompts):
    """This rank's RankGroups for the batch; on the main process, the pipeline's `on_group` hands each finished
    group to every rank. Under lockstep the ranks score per group only if all of them can (one collective)."""
    from accelerate.utils import broadcast_object_list, gather_object

    from ogrpo.train.overlap import RankGroups

    acc = trainer.accelerator
    if state.lockstep:
        everyone = gather_object([work is not None and work.score_fn is not None])
        if work is not None and not all(everyone):
            work.score_fn = None
    groups = RankGroups(work, acc.process_index, acc.num_processes, len(prompts) // trainer.num_generations,
                        state.lockstep)
    _handoff.groups = groups
    if state.pipeline is not None:
        def hand_over(index, answer):
            broadcast_object_list([(index, {"completion_ids": answer["completion_ids"]})], from_process=0)
            groups.arrived(index, answer)

        state.pipeline.on_group = hand_over
    return groups


def _group_work(trainer, state, prompts):
    """This rank's GroupWork for this training batch, or None where it cannot stream: images, a batch that is not
    whole groups, or nothing to do ahead."""
    from ogrpo.train.overlap import GroupWork

    inputs = state.inputs
    if not state.streams or inputs is None:
        return None
    n = trainer.num_generations
    if not prompts or len(prompts) % n or any(k in inputs[0] for k in ("image", "images")):
        return None
    reward = _group_reward(trainer, state, inputs, prompts, n) if _rewards_can_run_ahead(trainer) else None
    score = _group_score(trainer, state, prompts) if _can_score_groups(trainer) else None
    if reward is None and score is None:
        return None
    work = GroupWork(reward, score)
    work.batch = (inputs, prompts)  # what the groups' rewards were computed for
    work.used_rewards = False
    return work


def _decoder(trainer, prompts):
    """TRL's decoding of completion ids (per sequence, so a group decodes alone as in the batch); None where TRL
    parses responses with the tokenizer's response template (tool calls)."""
    from trl.data_utils import is_conversational

    conversational = is_conversational({"prompt": prompts[0]})
    tokenizer = getattr(trainer, "_tokenizer", None) or trainer.processing_class
    if conversational and (getattr(tokenizer, "response_template", None) is not None
                           or getattr(tokenizer, "response_schema", None) is not None):
        return None

    def decode(ids):
        texts = trainer.processing_class.batch_decode(ids, skip_special_tokens=True)
        return [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts

    return decode


def _group_reward(trainer, state, inputs, prompts, n):
    decode = _decoder(trainer, prompts)
    if decode is None:
        return None

    def reward(index, answer):
        from collections import defaultdict

        ids = answer["completion_ids"]
        part = slice(index * n, (index + 1) * n)
        completions = decode(ids)
        sink = defaultdict(list)
        _defer.on, _defer.sink = True, sink
        t0 = time.time_ns()
        try:
            rewards = trainer._ogrpo_calculate_rewards(inputs[part], prompts[part], completions, ids)
        finally:
            _defer.on, _defer.sink = False, None
            if state.timeline is not None:
                state.timeline.record("trainer", "reward", t0, time.time_ns())
        return completions, ids, rewards, sink

    return reward


def _sunk(original, key):
    def log(*args):
        sink = getattr(_defer, "sink", None)
        if sink is None:
            return original(*args)
        sink[key].append(args)

    return log


def _streamed_rewards(trainer, state, inputs, prompts, completions, completion_ids_list):
    """The groups' rewards (local rows, not yet gathered) when they were computed on exactly these completions."""
    import torch

    work = state.work
    if work is None or work.reward_fn is None or work.batch[0] is not inputs or work.batch[1] != prompts \
            or len(prompts) % trainer.num_generations:
        return None
    results = work.reward_results(len(prompts) // trainer.num_generations)
    if results is None:
        return None
    if [c for r in results for c in r[0]] != list(completions) or \
            [list(c) for r in results for c in r[1]] != [list(c) for c in completion_ids_list]:
        return None
    extra, metric = getattr(trainer, "_log_completion_extra", None), getattr(trainer, "_log_metric", None)
    values: dict = {}
    for _, _, _, sink in results:  # in batch order, as one call on the batch would have logged them
        for column, column_values in sink.get("extra", ()):
            extra(column, column_values)
        for name, value in sink.get("metric", ()):
            values.setdefault(name, []).append(value)
    for name, vals in values.items():  # one value per batch, as TRL's one call: the groups' mean
        metric(name, sum(vals) / len(vals))
    work.used_rewards = True
    return torch.cat([r[2] for r in results], dim=0)


def _wants_old(trainer) -> bool:
    args = trainer.args
    every = args.steps_per_generation * trainer.num_iterations
    return bool(args.gradient_accumulation_steps % every != 0
                or (trainer.use_vllm and getattr(trainer, "vllm_importance_sampling_correction", False)))


def _wants_ref(trainer) -> bool:
    return trainer.beta != 0.0 and getattr(trainer, "ref_model", None) is not None  # PEFT's ref: left to TRL


def _can_score_groups(trainer) -> bool:
    """Per-group passes give TRL's numbers only where a pass draws no random numbers (dropout, in train mode) and
    reads only token ids (no vision inputs)."""
    import torch

    if getattr(trainer, "_is_vlm", False) or not (_wants_old(trainer) or _wants_ref(trainer)):
        return False
    model = trainer.model
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return False
    config = getattr(model, "config", None)
    items = config.to_dict().items() if hasattr(config, "to_dict") else ()
    return not any("dropout" in k and isinstance(v, (int, float)) and v > 0 for k, v in items)


def _group_score(trainer, state, prompts):
    import importlib

    import torch

    grpo = importlib.import_module(_GRPO)
    prompt_ids = trainer._tokenize_prompts(copy.deepcopy(prompts))[0]
    width = max(len(p) for p in prompt_ids)
    multiple = getattr(trainer, "pad_to_multiple_of", None)
    if multiple:
        width = -(-width // multiple) * multiple
    tokenizer = getattr(trainer, "_tokenizer", None) or trainer.processing_class
    pad_id = tokenizer.pad_token_id
    eos = set(getattr(trainer, "eos_token_ids", None) or [tokenizer.eos_token_id]) | {pad_id}
    want_old, want_ref = _wants_old(trainer), _wants_ref(trainer)
    device = trainer.accelerator.device

    def score(index, answer):
        prompt, completions = prompt_ids[index * trainer.num_generations], answer["completion_ids"]
        # at least one column, so a group of empty completions still runs its pass (lockstep: every rank runs as
        # many as the others); the extra column is masked, as TRL's right padding would be
        length = max(1, max(len(c) for c in completions))
        n = len(completions)
        ids = torch.full((n, width + length), pad_id, dtype=torch.long)
        mask = torch.zeros((n, width + length), dtype=torch.long)
        ids[:, width - len(prompt):width] = torch.tensor(prompt)
        mask[:, width - len(prompt):width] = 1
        for row, c in enumerate(completions):
            if not c:
                continue
            ids[row, width:width + len(c)] = torch.tensor(c)
            truncated = trainer.mask_truncated_completions and c[-1] not in eos
            mask[row, width:width + len(c)] = 0 if truncated else 1
        ids, mask = ids.to(device), mask.to(device)
        out = {"ids": ids, "mask": mask, "length": length, "old": None, "ref": None}
        batch = trainer.args.per_device_train_batch_size
        t0 = time.time_ns()
        with torch.no_grad(), grpo.disable_gradient_checkpointing(trainer.model,
                                                                  trainer.args.gradient_checkpointing_kwargs):
            if want_old:
                out["old"] = state.logps(trainer.model, ids, mask, length, batch_size=batch)[0]
            if want_ref:
                out["ref"] = state.logps(trainer.ref_model, ids, mask, length, batch_size=batch)[0]
        if state.timeline is not None:  # busy inside the main thread's wait for the server
            state.timeline.record("trainer", "score", t0, time.time_ns())
        return out

    return score


def _logps(trainer, state, original):
    def _get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        work = state.work
        # batch_size comes by keyword (TRL 1.16) or fifth (TRL 1.9.2's old-policy pass); nothing else may come
        if work is not None and work.score_fn is not None and len(args) <= 1 and _plain(kwargs):
            kind = "old" if model is trainer.model else "ref" if model is getattr(trainer, "ref_model", None) \
                else None
            # only the first pass on a model can be the one the groups scored: with LoRA the reference pass runs
            # on trainer.model too (adapters disabled), after the old-policy pass
            if kind is not None and kind not in work.tried:
                work.tried.add(kind)
                out = _assembled(trainer, work, kind, input_ids, attention_mask, logits_to_keep)
                if state.lockstep:  # TRL's pass is a collective: every rank takes the groups' result, or none does
                    from accelerate.utils import gather_object

                    if not all(gather_object([out is not None])):
                        out = None
                if out is not None:
                    work.taken.add(kind)
                    return out, None, None
        return original(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    return _get_per_token_logps_and_entropies


def _plain(kwargs) -> bool:
    import torch

    return not torch.is_grad_enabled() and all(v is None or v is False for k, v in kwargs.items()
                                               if k != "batch_size")


def _assembled(trainer, work, kind, input_ids, attention_mask, logits_to_keep):
    """The groups' `kind` log-probs as TRL's batch pass returns them, when TRL's batch is exactly the groups' rows
    (the same prompt padding; completions right-padded to `logits_to_keep`); None otherwise."""
    import torch
    import torch.nn.functional as F

    n = trainer.num_generations
    groups = input_ids.size(0) // n
    parts = [work.scores.get(i) for i in range(groups)]
    if input_ids.size(0) % n or any(p is None or p[kind] is None for p in parts):
        return None
    tokenizer = getattr(trainer, "_tokenizer", None) or trainer.processing_class
    width = input_ids.size(1) - logits_to_keep
    ids, mask, logps = [], [], []
    fill = _OLD_FILL if kind == "old" else _REF_FILL
    for p in parts:
        extra = logits_to_keep - p["length"]
        if extra < 0 or p["ids"].size(1) - p["length"] != width:
            return None
        ids.append(F.pad(p["ids"], (0, extra), value=tokenizer.pad_token_id))
        mask.append(F.pad(p["mask"], (0, extra), value=0))
        logps.append(F.pad(p[kind], (0, extra), value=fill))
    if not (torch.equal(torch.cat(ids).to(input_ids.device), input_ids)
            and torch.equal(torch.cat(mask).to(attention_mask.device), attention_mask)):
        return None
    return torch.cat(logps)


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
            from ogrpo.serve import deadline

            if deadline.stopping.is_set():  # SIGTERM: training stops after this step (saved without the server,
                return  # which got the same signal); a resumed run pushes its own weights first
            _stage_next(trainer, state)
            trainer.vllm_generation.sync_weights()
            trainer._last_loaded_step = st.global_step

        def on_train_end(self, args, st, control, **kwargs):
            if state.pipeline is not None:
                state.pipeline.close()

    return OverlapCallback()
