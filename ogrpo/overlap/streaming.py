"""Lossless streaming, the trainer's side: each finished prompt group's rewards (on the reward thread) and its
old-policy/reference log-probs (on the main thread; where completions come back one by one, each completion's as
it ends) while the server generates the rest, and the check that hands
TRL those results only where its own batch is exactly what the groups were scored on (ogrpo/overlap/steps.py).

Every reading of TRL's internals for the per-group work is in this module (the same on TRL 1.9.2 and 1.16:
_tokenize_prompts, processing_class.batch_decode, `pad_to_multiple_of`, `mask_truncated_completions`, the
old/ref pass conditions of _generate_and_score_completions, `disable_gradient_checkpointing`). What it gets
wrong only costs the overlap: TRL's own tensors and completions are compared before a result is used.
"""

from __future__ import annotations

import time

from ogrpo import compat
from ogrpo.dropout import draws_dropout
from ogrpo.overlap import prefixes as prefix_pieces
from ogrpo.overlap.pipeline import GroupWork, RankGroups
from ogrpo.overlap.rows import group_rows, prompt_layout
from ogrpo.overlap.train_ahead import TrainAhead
from ogrpo.patches import trl_overlap as trl_collectives
from ogrpo.serve import prefix_stream
from ogrpo.serve.client import group_calls

_REF_FILL = -1e4  # reference log-prob past a sequence's end (masked): exp(ref - logp) stays 0, never inf x 0
_OLD_FILL = 0.0  # old-policy log-prob there: exp(logp - old) <= 1


def splitter(trainer, per_completion):
    """The main process's pipeline `split`: one request per prompt group, or per completion (`per_completion()`,
    read as each request goes out)."""
    import trl

    flavor = compat.server_flavor(trl.__version__)
    client = trainer.vllm_generation.vllm_client
    def split(prompts, sampling, on_tokens=None):
        alone = per_completion()
        return group_calls(client, prompts, sampling, flavor, alone, on_tokens if alone else None)

    return split


def completions_stream(trainer) -> str | None:
    """Why the completions of a streamed batch come back group by group rather than one by one (where each
    completion's log-prob passes run as it ends), else None."""
    import trl

    if compat.server_flavor(trl.__version__) != compat.VLLM_API:
        return "TRL 1.9's server samples a request's completions with one seed: only whole groups keep them"
    if trainer.accelerator.num_processes > 1:
        return "the ranks take whole groups (RankGroups)"
    if not (_can_score_groups(trainer) or trainer.overlap.train_ahead):
        return "nothing runs per completion: no log-prob pass per group, no group trained ahead"
    return None


def prefix_passes(trainer) -> str | None:
    """Why a streamed completion's scoring passes do not run on its prefix while it generates
    (ogrpo.overlap.prefixes), else None. Called once completions stream one by one."""
    import trl.trainer.utils as trl_utils

    if not trainer.overlap.train_ahead:
        return "its pieces run in the trainer's waits for the server, which train groups ahead (off here)"
    if not _can_score_groups(trainer):
        return "no reference or old-policy pass runs per completion"
    if not hasattr(trl_utils, "add_fused_lm_head"):
        return "this TRL line scores without its fused LM head, which the pieces go through"
    problems = prefix_stream.trl_generate_problems()
    if problems:  # the streamed request is TRL's own, with `stream`: only while TRL's client asks what it reads
        return "; ".join(problems)
    if getattr(trainer, "packing", None) is None:
        return ("the padding-free passes are off: the pieces give their positions (the prompt's first real token "
                "at 0), which TRL's padded pass gives only where the model's positions are relative")
    return prefix_pieces.rope_why_not(trainer.model.config)


def rank_groups(trainer, state, work, prompts):
    """This rank's RankGroups for the batch; on the main process, the pipeline's `on_group` hands each finished
    group to every rank. Under lockstep the ranks score per group only if all of them can (one collective)."""
    from accelerate.utils import broadcast_object_list, gather_object

    acc = trainer.accelerator
    if state.lockstep:
        everyone = gather_object([work is not None and work.score_fn is not None])
        if work is not None and not all(everyone):
            work.score_fn = None
    if state.train_ahead:  # the ranks train their groups in step: all of them, or none
        everyone = gather_object([work is not None and work.ahead is not None])
        if work is not None and not all(everyone):
            work.ahead = work.then = None
    ahead = work is not None and work.ahead is not None
    groups = RankGroups(work, acc.process_index, acc.num_processes, len(prompts) // trainer.num_generations,
                        state.lockstep)
    trl_collectives.handoff.groups = groups
    if state.pipeline is not None:
        def hand_over(index, answer):
            # a group trained ahead needs the server's sampling log-probs on the rank that owns it
            keys = ("completion_ids", "logprobs") if ahead else ("completion_ids",)
            broadcast_object_list([(index, {k: answer.get(k) for k in keys})], from_process=0)
            groups.arrived(index, answer)

        state.pipeline.on_group = hand_over
    return groups


def group_work(trainer, state, prompts):
    """This rank's GroupWork for this training batch, or None where it cannot stream: images, a batch that is not
    whole groups, or nothing to do ahead."""
    inputs = state.inputs
    if not state.streams or inputs is None:
        return None
    n = trainer.num_generations
    if not prompts or len(prompts) % n or any(k in inputs[0] for k in ("image", "images")):
        return None
    reward = _group_reward(trainer, state, inputs, prompts, n) if rewards_can_run_ahead(trainer) else None
    score = _group_score(trainer, state, prompts) if _can_score_groups(trainer) else None
    if reward is None and score is None:
        return None
    work = GroupWork(reward, score)
    if score is not None and state.completions:  # each completion's passes as it ends
        work.row_fn = score.row
    if score is not None and state.prefixes:  # and on its prefix while it generates
        work.prefix_models = {kind: trainer.model if kind == "old" else trainer.ref_model
                              for kind in score.kinds}
        work.prefix_context = score.no_checkpointing
    work.batch = (inputs, prompts)  # what the groups' rewards were computed for
    work.used_rewards = False
    if state.train_ahead and reward is not None:  # the groups' loss forward/backward too (ogrpo.overlap.train_ahead)
        work.ahead = TrainAhead(trainer, work, *prompt_layout(trainer, prompts))
        work.then = work.ahead.arrived
        if state.completions:  # each completion's loss forward as it ends (its backward waits for the group)
            work.then_part = work.ahead.part_arrived
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

    def rewards(part: slice, ids):
        from collections import defaultdict

        completions = decode(ids)
        sink = defaultdict(list)
        trl_collectives.deferred.on, trl_collectives.deferred.sink = True, sink
        t0 = time.time_ns()
        try:
            out = trainer.rewards_beneath(inputs[part], prompts[part], completions, ids)
        finally:
            trl_collectives.deferred.on, trl_collectives.deferred.sink = False, None
            if state.timeline is not None:
                state.timeline.record("trainer", "reward", t0, time.time_ns())
        return completions, ids, out, sink

    def reward(index, answer):
        return rewards(slice(index * n, (index + 1) * n), answer["completion_ids"])

    def row(index, j, answer):
        """Completion j of the group alone, its reward functions' logging dropped (the group's call logs): the
        rewards per function, one row; the group's call must give the same (ogrpo.overlap.train_ahead checks)."""
        k = index * n + j
        return rewards(slice(k, k + 1), answer["completion_ids"])[2]

    reward.row = row
    return reward


def kept_logging(key: str, args: tuple) -> bool:
    """On the reward thread of a streamed group: keep a reward function's logging call (`key`: extra | metric) for
    the batch-order replay, and say so; elsewhere False (the call goes to TRL)."""
    kept = getattr(trl_collectives.deferred, "sink", None)
    if kept is None:
        return False
    kept[key].append(args)
    return True


def streamed_rewards(trainer, state, inputs, prompts, completions, completion_ids_list):
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
    if getattr(trainer, "old_policy", None) is not None:  # the loss forward gives it (ogrpo.trainer.old_policy)
        return False
    args = trainer.args
    every = args.steps_per_generation * trainer.num_iterations
    return bool(args.gradient_accumulation_steps % every != 0
                or (trainer.use_vllm and getattr(trainer, "vllm_importance_sampling_correction", False)))


def _wants_ref(trainer) -> bool:
    return trainer.beta != 0.0 and getattr(trainer, "ref_model", None) is not None  # PEFT's ref: left to TRL


def _can_score_groups(trainer) -> bool:
    """Per-group passes give TRL's numbers only where a pass draws no random numbers (dropout, in train mode) and
    reads only token ids (no vision inputs)."""
    if getattr(trainer, "_is_vlm", False) or not (_wants_old(trainer) or _wants_ref(trainer)):
        return False
    return not draws_dropout(trainer.model)


def _group_score(trainer, state, prompts):
    """The group's passes (`score(index, answer)`) and, where completions come back one by one, a completion's
    (`score.row(index, j, answer)`, stored in the batch's GroupWork.rows): a group's score then passes only the
    rows that came without one. A row's log-probs do not depend on the rows beside it (the padding-free pass
    packs each on its own positions; without it, a row's padding is masked): they are laid into the group's
    tensor, past its end the fill a whole batch's assembly uses."""
    import importlib

    import torch
    import torch.nn.functional as F

    grpo = importlib.import_module(trl_collectives.GRPO_MODULE)
    prompt_ids, width = prompt_layout(trainer, prompts)
    kinds = [k for k, wanted in (("old", _wants_old(trainer)), ("ref", _wants_ref(trainer))) if wanted]
    device = trainer.accelerator.device
    n = trainer.num_generations

    def passes(ids, mask, length) -> dict:
        batch = trainer.args.per_device_train_batch_size
        models = {"old": trainer.model, "ref": getattr(trainer, "ref_model", None)}
        t0 = time.time_ns()
        with torch.no_grad(), grpo.disable_gradient_checkpointing(trainer.model,
                                                                  trainer.args.gradient_checkpointing_kwargs):
            out = {k: trainer.logps_beneath(models[k], ids, mask, length, batch_size=batch)[0] for k in kinds}
        if state.timeline is not None:  # busy inside the main thread's wait for the server
            state.timeline.record("trainer", "score", t0, time.time_ns())
        return out

    def from_prefix(index, j, completion: list, mask) -> dict | None:
        """Completion j's passes from those run on its prefix as it streamed (ogrpo.overlap.prefixes), its last
        tokens scored now; None where there are none, or they do not hold (a truncated row TRL masks: its pass
        gives zeros there)."""
        work = state.work
        held = work.pop_prefix(index, j) if work is not None else None
        if not held or set(held) != set(kinds) or not bool(mask[width:width + len(completion)].all()):
            return None
        t0 = time.time_ns()
        try:
            out = {kind: held[kind].finish(completion) for kind in kinds}
        except Exception as exc:  # noqa: BLE001 - the row's pass runs whole instead
            prefix_pieces.report_failure(state, exc)
            return None
        finally:
            if state.timeline is not None:
                state.timeline.record("trainer", "score", t0, time.time_ns())
        if any(v is None for v in out.values()):
            return None
        work.prefix_used += 1
        return {"length": len(completion), **out}

    def row(index, j, answer):
        ids, mask, length = group_rows(trainer, prompt_ids[index * n], answer["completion_ids"], width)
        done = from_prefix(index, j, answer["completion_ids"][0], mask[0])
        return done or {"length": length, **passes(ids.to(device), mask.to(device), length)}

    def score(index, answer):
        ids, mask, length = group_rows(trainer, prompt_ids[index * n], answer["completion_ids"], width)
        early = dict(state.work.rows.get(index, {})) if state.work is not None else {}
        for j in range(n):
            done = None if j in early else from_prefix(index, j, answer["completion_ids"][j], mask[j])
            if done is not None:
                early[j] = done
        ids, mask = ids.to(device), mask.to(device)
        rest = [j for j in range(n) if j not in early]
        computed = passes(ids[rest], mask[rest], length) if rest else {}
        out = {"ids": ids, "mask": mask, "length": length, "old": None, "ref": None}
        for kind in kinds:
            fill = _OLD_FILL if kind == "old" else _REF_FILL
            rows = {j: F.pad(r[kind], (0, length - r["length"]), value=fill) for j, r in early.items()}
            rows.update((j, computed[kind][k:k + 1]) for k, j in enumerate(rest))
            out[kind] = torch.cat([rows[j] for j in range(n)])
        return out

    score.row = row
    score.kinds = kinds
    score.no_checkpointing = lambda: grpo.disable_gradient_checkpointing(trainer.model,
                                                                         trainer.args.gradient_checkpointing_kwargs)
    return score


def streamed_logps(trainer, state, model, input_ids, attention_mask, logits_to_keep, args: tuple, kwargs: dict):
    """The streamed groups' log-probs for TRL's old-policy or reference pass over the whole batch, or None (TRL
    computes them)."""
    work = state.work
    # batch_size comes by keyword (TRL 1.16) or fifth (TRL 1.9.2's old-policy pass); nothing else may come
    if work is None or work.score_fn is None or len(args) > 1 or not _plain(kwargs):
        return None
    kind = "old" if model is trainer.model else "ref" if model is getattr(trainer, "ref_model", None) else None
    # only the first pass on a model can be the one the groups scored: with LoRA the reference pass runs on
    # trainer.model too (adapters disabled), after the old-policy pass
    if kind is None or kind in work.tried:
        return None
    work.tried.add(kind)
    out = _assembled(trainer, work, kind, input_ids, attention_mask, logits_to_keep)
    if state.lockstep:  # TRL's pass is a collective: every rank takes the groups' result, or none does
        from accelerate.utils import gather_object

        if not all(gather_object([out is not None])):
            out = None
    if out is None:
        return None
    work.taken.add(kind)
    return out, None, None


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




def rewards_can_run_ahead(trainer) -> bool:
    import torch

    # a reward model runs on the trainer's device: left on the main thread
    return not any(isinstance(f, torch.nn.Module) for f in trainer.reward_funcs)


