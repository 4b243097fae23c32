"""Lossless streaming, the gradient's side (issue 36): each finished prompt group's loss forward and backward run
while the server still generates the rest, so only the last group's, the optimizer step and the push stay on the
critical path.

Why it is exact: the weights do not change until the optimizer step, and gradient accumulation is a sum. For the
loss types this runs under, a completion's share of the gradient does not depend on which micro-batch TRL puts it
in (TRL shuffles the generation batch before splitting it):
- grpo, sapo, luspo, dr_grpo: a micro-batch's loss is a mean over its rows (dr_grpo: over rows x
  max_completion_length), so each row weighs 1 / per_device_train_batch_size: a group's chunk of k rows, run
  through TRL's own `_compute_loss`, is scaled by k / per_device_train_batch_size;
- dapo, cispo, vespo: a sum over tokens divided by the batch's token count (`num_items_in_batch`), known only when
  the last group is in: the chunks run with a provisional count of 1, and the accumulated gradients are scaled
  once by 1 / the real count (a scale of a sum: exact up to rounding).
A chunk holds as many rows as fit the positions of a TRL micro-batch at the longest completion (the memory the
plan sized): per_device_train_batch_size rows or more, never fewer. The loss, its metrics and
the old policy's numbers come from TRL's code: `_compute_loss` itself runs on each chunk (its metrics dropped),
and again on TRL's own micro-batches, under no gradient to the weights, with the chunks' log-probs and entropies
in place of a forward (`replay`): TRL logs exactly what it logs under `off`, and the Trainer's backward of that
loss reaches no weight. Before TRL's micro-batches run, every group's inputs (ids, masks, advantages, sampling
and reference log-probs) are compared with TRL's own batch; on any difference the gradients are dropped (they
were zero when the step began) and TRL's micro-batches run as under `off`.

Where completions come back one by one (ogrpo.overlap.streaming.completions_stream), each one's loss forward runs
as it ends (`part_arrived`), its graph kept for the group's backward while the graphs held leave room for one more
row at the cap within the positions a group's chunk holds at the cap (so the peak stays where it was); the group's
first chunk then takes those rows' forwards (`answer_forwards`, which checks each against the chunk's row) and only
the backward runs for them.
Where the loss allows, a completion's backward runs before its group is whole too (ogrpo.overlap.early_backward,
`summing` / `backward_one`), so the group's backward leaves only its last completions on the critical path.

Off where a row's share is not fixed, or the chunks would not see TRL's numbers (the plan and the trainer say
which): bnpo (a micro-batch's token count), `top_entropy_quantile < 1` and the entropy bonus (per micro-batch),
the MoE aux loss, `scale_rewards: batch` and `normalize_then_sum` (advantages need the whole batch), PEFT's
reference (TRL's whole-batch pass), dropout, LOMO, a reward model, Liger, vision inputs, ZeRO-3 with the optimizer
offloaded, the token-count losses under DeepSpeed in fp16. Several trainer processes each train their own groups,
the ranks' k-th together, each group in as many chunks on every rank (the loss metrics, and DeepSpeed's backward,
are collectives); DDP's backward does not reduce (`adopt` averages once), DeepSpeed's reduces as for a micro-batch
(ogrpo.overlap.deepspeed_ahead).
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future

from ogrpo.dropout import draws_dropout
from ogrpo.overlap import early_backward, prefixes
from ogrpo.overlap.pipeline import OverlapError
from ogrpo.overlap.rows import group_rows
from ogrpo.planner.train_ahead import MEAN_LOSSES, SUM_LOSSES
from ogrpo.planner.train_ahead import why_not as config_why_not

DONE: Future = Future()  # in `waiting_on` while work is ready now: the Stream calls `ready` unless a completion is back
DONE.set_result(None)
ROW_KEY = "ogrpo_row"  # the row's index in the generation batch, carried through TRL's shuffle and split


def why_not(trainer) -> str | None:
    """Why this built trainer cannot train groups ahead, else None (what only the trainer sees added)."""
    import torch

    args = trainer.args
    reason = config_why_not(trainer.loss_type, trainer.scale_rewards,
                            getattr(trainer, "multi_objective_aggregation", None), trainer.top_entropy_quantile,
                            bool(getattr(trainer, "_entropy_bonus_enabled", False)),
                            bool(getattr(trainer, "is_deepspeed_enabled", False)), offloads_optimizer(trainer),
                            bool(getattr(args, "fp16", False)), bool(getattr(args, "full_determinism", False)))
    if reason:
        return reason
    engine_side = deepspeed_side(trainer)
    reason = engine_side.why_not() if engine_side is not None else None
    if reason:
        return reason
    if getattr(trainer, "is_fsdp_enabled", False):
        return "FSDP reduces and reshards inside each backward"
    if getattr(trainer, "aux_loss_enabled", False):
        return "the router's aux loss is a mean over each micro-batch"
    if getattr(args, "use_liger_kernel", False) or getattr(trainer, "use_liger_kernel", False):
        return "Liger's GRPO loss"
    if getattr(trainer, "_is_vlm", False):
        return "vision inputs"
    if str(getattr(args, "optim", "")).lower() in ("lomo", "adalomo"):
        return "LOMO optimizers step inside the backward"
    if getattr(args, "n_gpu", 1) > 1:
        return "torch.nn.DataParallel"
    if any(isinstance(f, torch.nn.Module) for f in trainer.reward_funcs):
        return "a reward model runs on the trainer's device, on the main thread"
    if trainer.beta != 0.0 and getattr(trainer, "ref_model", None) is None:
        return "the reference log-probs come from TRL's pass over the whole batch (PEFT: adapters disabled)"
    if getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False) \
            and getattr(trainer, "old_policy", None) is None:
        return "the old policy's log-probs come from TRL's separate pass over the whole batch"
    if draws_dropout(trainer.model):
        return "the model has dropout: a group's forward would draw other masks than TRL's micro-batches"
    return None


def prefix_forwards_why_not(trainer) -> str | None:
    """Why a streamed completion's loss forward does not run on its prefix while it generates
    (ogrpo.overlap.prefixes, `grad=True`), else None; asked where its scoring passes do."""
    if trainer.accelerator.num_processes > 1:
        return "several trainer processes: a completion's forward runs as it ends only on one"
    if deepspeed_side(trainer) is not None:
        return "DeepSpeed's engine gathers and frees the weights around each forward it runs whole"
    model = trainer.accelerator.unwrap_model(trainer.model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(trainer.args, "gradient_checkpointing", False) or getattr(base, "is_gradient_checkpointing", False):
        return "gradient checkpointing recomputes each forward whole, without the key/value cache"
    return None


def deepspeed_side(trainer):
    """ogrpo.overlap.deepspeed_ahead where the trainer runs under DeepSpeed, else None."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    from ogrpo.overlap import deepspeed_ahead  # it subclasses accelerate's engine wrapper: loads accelerate

    return deepspeed_ahead


def offloads_optimizer(trainer) -> bool:
    """Whether DeepSpeed runs the optimizer on the host (its config's zero_optimization.offload_optimizer)."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None) \
        if getattr(trainer, "is_deepspeed_enabled", False) else None
    zero = ((getattr(plugin, "deepspeed_config", None) or {}).get("zero_optimization") or {}) if plugin else {}
    device = (zero.get("offload_optimizer") or {}).get("device")
    return device not in (None, "none")


def loss_scale(trainer) -> float:
    """What transformers' Trainer.training_step multiplies `compute_loss`'s loss by before the backward (both
    lines: TRL 1.16 says its loss is scaled for accumulation, TRL 1.9.2's transformers divides by the steps)."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:  # GRPO's batches carry no labels: the Trainer's num_items_in_batch is None
        scaled = getattr(trainer, "compute_loss_func", None) is not None
    return 1.0 if scaled else 1.0 / trainer.current_gradient_accumulation_steps


def reward_stats(trainer, rewards_per_func, n: int):
    """Per row, TRL's reward, its group's mean and the advantages' divisor (None: scale_rewards none)."""
    import torch
    from trl.trainer.utils import nanstd

    rewards = early_backward.weighted_rewards(trainer, rewards_per_func)
    mean = torch.nanmean(rewards.view(-1, n), dim=1).repeat_interleave(n, dim=0)
    std = nanstd(rewards.view(-1, n), dim=1).repeat_interleave(n, dim=0) if n > 1 else torch.zeros_like(rewards)
    return rewards, mean, (std + 1e-4 if trainer.scale_rewards not in ("none", False) else None)


def advantages(trainer, rewards_per_func, n: int):
    """TRL's advantages for one group's rows (sum_then_normalize; scale_rewards group or none)."""
    import torch

    rewards, mean, divisor = reward_stats(trainer, rewards_per_func, n)
    out = rewards - mean
    if divisor is not None:
        out = out / divisor
    return torch.nan_to_num(out, nan=0.0)


def sampling_logps(answer: dict, length: int, device):
    """The server's log-probs of the sampled tokens, one row per completion, right-padded with 0 (TRL's layout);
    None where the answer has none."""
    import torch

    rows = answer.get("logprobs")
    if rows is None:
        return None
    out = torch.zeros(len(rows), length)
    for r, row in enumerate(rows):
        values = [(lp[0] if isinstance(lp, (list, tuple)) else lp) for lp in row]
        if values:
            out[r, :len(values)] = torch.tensor([float("nan") if v is None else v for v in values])
    return out.to(device)


def chunk_rows(per_device: int, width: int, length: int, max_completion: int) -> int:
    """Rows per forward/backward of a group: a token budget, the positions of a TRL micro-batch of
    `per_device` rows at the longest completion the plan sized its memory for, filled with this group's rows
    (its prompt width plus its longest completion each); never fewer rows than TRL's micro-batch."""
    return max(per_device, per_device * (width + max_completion) // max(1, width + length))


def agreed_rows(rows: int, device) -> int:
    """The fewest of every rank's rows per chunk, for the ranks' k-th groups (trained together): each then runs
    as many chunks, whatever its lengths (each chunk's loss metrics, and under DeepSpeed its backward, are
    collectives), each within its own budget."""
    import torch
    import torch.distributed as dist

    agreed = torch.tensor([rows], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return int(agreed.item())


class Trained:
    """One group as it was trained: the inputs TRL's batch must match, and each row's log-probs and entropies for
    the replay."""

    def __init__(self, inputs: dict, logps, entropies):
        self.inputs, self.logps, self.entropies = inputs, logps, entropies


class Forward:
    """One completion's loss forward, run as it ended: its row (ids, mask, completion length), its log-probs (with
    their graph) and entropies, the positions its graph holds, and the server's answer for it."""

    def __init__(self, ids, mask, length: int, logps, entropies, positions: int, answer: dict | None = None):
        self.ids, self.mask, self.length = ids, mask, length
        self.logps, self.entropies, self.positions = logps, entropies, positions
        self.answer = answer
        self.reward = None  # Future of its rewards alone, once its backward may run before its group's


def answer_forwards(trainer, forwards: dict, model, input_ids, attention_mask, logits_to_keep, args: tuple,
                    kwargs: dict):
    """A chunk's loss forward, its rows in `forwards` (row -> Forward) answered from their own forwards and the
    rest run now; None where the call is not the one those forwards stand for (another model, multimodal or aux
    inputs, rows that differ): TRL's forward then runs on the whole chunk."""
    import torch
    import torch.nn.functional as F

    plain = all(v is None or v is False for k, v in kwargs.items() if k not in ("compute_entropy", "batch_size"))
    if model is not trainer.model_wrapped or args or not plain:
        return None
    for row, f in forwards.items():
        width = f.ids.size(1)
        if f.length > logits_to_keep or not (torch.equal(input_ids[row, :width], f.ids[0])
                                             and torch.equal(attention_mask[row, :width], f.mask[0])
                                             and not bool(attention_mask[row, width:].any())):
            return None
    rest = [r for r in range(input_ids.size(0)) if r not in forwards]
    entropy = bool(kwargs.get("compute_entropy"))
    computed = (trainer.logps_beneath(model, input_ids[rest], attention_mask[rest], logits_to_keep, **kwargs)
                if rest else None)
    logps, entropies = [], []
    for row in range(input_ids.size(0)):
        if row in forwards:  # past the row's end what a packed pass leaves there: zeros (masked)
            f = forwards[row]
            logps.append(F.pad(f.logps, (0, logits_to_keep - f.length)))
            entropies.append(F.pad(f.entropies, (0, logits_to_keep - f.length)) if entropy else None)
        else:
            k = rest.index(row)
            logps.append(computed[0][k:k + 1])
            entropies.append(computed[1][k:k + 1] if entropy else None)
    return torch.cat(logps), (torch.cat(entropies) if entropy else None), None


class Replay:
    """TRL's micro-batches of one generation batch, answered from the groups' forwards."""

    def __init__(self, groups: dict[int, Trained], n: int, micro_batches: int):
        self.groups, self.n, self.left = groups, n, micro_batches
        self.current = None  # the micro-batch whose loss is being computed

    def answer(self, input_ids, logits_to_keep: int):
        """(log-probs, entropies) of the current micro-batch's rows, padded to `logits_to_keep`; the log-probs a
        leaf that wants a gradient, so the Trainer's backward runs (and reaches no weight)."""
        import torch

        rows = self.current[ROW_KEY].tolist()
        first = next(iter(self.groups.values())).logps
        logps = first.new_zeros((len(rows), logits_to_keep))
        entropies = torch.zeros_like(logps)
        for i, row in enumerate(rows):
            group = self.groups[row // self.n]
            j = row % self.n
            length = group.logps.size(1)
            ids = group.inputs["completion_ids"][j]
            if length > logits_to_keep or not torch.equal(input_ids[i, -logits_to_keep:][:length].cpu(),
                                                          ids.cpu()):
                raise OverlapError(f"overlap: micro-batch row {i} (batch row {row}) is not the completion its group "
                                   "trained on")
            logps[i, :length] = group.logps[j]
            if group.entropies is not None:
                entropies[i, :length] = group.entropies[j]
        return logps.requires_grad_(), entropies


class TrainAhead:
    """One generation batch's groups trained as they come in. One process: after a group's log-prob passes, each
    group whose rewards are done, the rest once the last group is in (`arrived`, `finish`). Several: RankGroups
    calls `train_now` for a rank's k-th group once every rank has k groups (TRL's loss metrics are collectives),
    each backward without DDP's reduction, which `adopt` does once for the batch."""

    def __init__(self, trainer, work, prompt_ids: list, width: int):
        self.trainer, self.work, self.prompt_ids, self.width = trainer, work, prompt_ids, width
        self.pending: list[tuple[int, dict]] = []
        self.groups: dict[int, Trained] = {}
        self.forwards: dict[int, dict[int, Forward]] = {}  # group -> completion -> its loss forward, graph kept
        self.held = 0  # positions of those graphs
        self.answered = trainer.overlap.forwards_answered  # before this batch: its loss forwards taken, after
        # the activation positions a group's chunk may hold at the cap (TRL's micro-batch, or the group if smaller):
        # the graphs of completions forwarded as they end never raise the peak above it
        self.budget = (min(trainer.num_generations, trainer.args.per_device_train_batch_size)
                       * (width + trainer.max_completion_length))
        self.early = 0  # groups trained before the last one arrived
        self.arrivals, self.total = 0, len(prompt_ids) // trainer.num_generations
        self.open = set(range(self.total))  # the groups not yet in
        self.parts: dict[int, int] = {}  # group -> its completions come back alone so far
        self.summed: dict[int, early_backward.EarlyBackward] = {}  # open group -> its rows backwarded early
        self.backward_early = 0  # such rows in this batch
        self.kl: list[tuple[object, int]] = []  # their KL terms' backward not yet run: (scaled loss, positions held)
        self.linear: bool | None = None  # whether the loss allows it (early_backward.why_not), once asked
        self.failed: BaseException | None = None
        self.prefixes = None  # the stream's completions so far (ogrpo.overlap.prefixes), set as it is taken
        self.worked = 0  # pieces of work run (`busy`): what `ready` ran before a prefix's turn
        # (group, completion) -> its loss forward on its prefix, graph kept (where the overlap state allows it),
        # each holding `reserve` positions of the budget while it grows
        self.loss_prefixes: dict[tuple[int, int], prefixes.IncrementalPass] = {}
        self.reserve = width + trainer.max_completion_length

    def arrived(self, index: int, answer: dict) -> None:
        self.pending.append((index, answer))
        self.arrivals += 1
        self.open.discard(index)
        # the groups that came before this one have had a whole arrival's time for their rewards: wait for them
        # (the server generates meanwhile); this one only if its rewards are already done
        self.run(wait=len(self.pending) - 1, last=self.arrivals >= self.total)
        self.queue_rewards()

    def part_arrived(self, index: int, j: int, answer: dict) -> None:
        """Completion j of group `index`, ended before the rest of its group: its loss forward now, the graph kept
        for the group's backward (which needs the group's advantages), while the graphs held leave room in the
        budget (a group's chunk at the cap) for one more row at the cap, so a chunk always fits beside them."""
        if self.failed is not None or self.trainer.accelerator.num_processes > 1:
            return
        self.parts[index] = self.parts.get(index, 0) + 1
        # the groups already in have had this completion's time for their rewards: theirs first
        self.run(wait=len(self.pending), last=False)
        if self.failed is not None:
            return
        if not self.forward_row(index, j, answer, whole=True):
            return
        # the group's last completion: the group follows it at once, and trains it with the others not yet run
        self.queue_rewards(keep=(index, j) if self.parts[index] >= self.trainer.num_generations else None)

    def forward_row(self, index: int, j: int, answer: dict, whole: bool) -> bool:
        """Completion j of group `index` (`answer`: its own), its loss forward kept as a Forward: from its forward on
        its prefix where one ran, else (`whole`) run now where the budget leaves room; whether it is kept."""
        trainer = self.trainer
        ids, mask, length = group_rows(trainer, self.prompt_ids[index * trainer.num_generations],
                                       answer["completion_ids"], self.width)
        positions = self.width + length
        device = trainer.accelerator.device
        ids, mask = ids.to(device), mask.to(device)
        done = self.forward_from_prefix(index, j, answer["completion_ids"][0], mask[0])
        if done is not None:
            lp, ent = done
            # counted at the cap: its pieces' attention keeps a copy of the keys and values so far each
            positions = max(positions, self.reserve)
        else:
            if not whole or self.held + positions + self.width + trainer.max_completion_length > self.budget:
                return False
            try:
                with self.busy(), trainer.compute_loss_context_manager():
                    lp, ent = trainer.logps_beneath(trainer.model_wrapped, ids, mask, length,
                                                    compute_entropy=True)[:2]
            except Exception as exc:  # noqa: BLE001 - TRL's micro-batches run instead; the error is reported
                self.failed = exc
                return False
        self.forwards.setdefault(index, {})[j] = Forward(ids, mask, length, lp, ent, positions, answer)
        self.held += positions
        return True

    @contextlib.contextmanager
    def busy(self):
        """The trainer's work ahead: timed by the profiler (inside its wait for the server) and on the timeline."""
        trainer = self.trainer
        profiler = getattr(trainer, "stage_profiler", None)
        depth = profiler.ahead_begin() if profiler is not None else None
        t0 = time.time_ns()
        self.worked += 1
        try:
            yield
        finally:
            if profiler is not None:
                profiler.ahead_end(depth, t0)
            if trainer.overlap.timeline is not None:
                trainer.overlap.timeline.record("trainer", "train_ahead", t0, time.time_ns())

    def summing(self, group: int) -> bool:
        """Whether open group `group`'s completions may run their backward before it is whole
        (ogrpo.overlap.early_backward): the loss allows it and the group holds, or may take, a pair of gradient
        sums (at most the plan's `overlap.early_backward_groups` at once)."""
        if self.failed is not None or group not in self.open or self.work is None:
            return False
        if self.linear is None:
            self.linear = (bool(getattr(self.trainer.overlap, "early_backward", True))
                           and early_backward.why_not(self.trainer) is None)
        if not self.linear:
            return False
        if group not in self.summed:
            cap = getattr(self.trainer.overlap, "early_backward_groups", None)
            if cap is not None and len(self.summed) >= cap:
                return False
            self.summed[group] = early_backward.EarlyBackward(self.trainer, group)
        return True

    def queue_rewards(self, keep: tuple[int, int] | None = None) -> None:
        """The rewards of each completion forwarded (but `keep`: (group, completion)) of the open groups that may
        sum, alone, on the reward thread; its backward runs once they are done, when the trainer would otherwise
        wait (`ready`)."""
        for group in sorted(self.forwards):
            held = self.forwards[group]
            if not held or not self.summing(group):
                continue
            for j, f in held.items():
                if (group, j) != keep and f.reward is None:
                    f.reward = self.work.row_reward(group, j, f.answer)
                    if f.reward is None:  # no reward function of a completion alone
                        self.linear = False
                        return

    def early_rows(self) -> dict:
        """The open groups' completions forwarded whose rewards alone are queued: (group, j) -> Forward."""
        return {(group, j): f for group in sorted(self.summed) if group in self.open
                for j, f in sorted(self.forwards.get(group, {}).items()) if f.reward is not None}

    def backward_one(self) -> None:
        """One backward of a completion of an open group: a KL term waiting, else the advantage term of one whose
        rewards alone are done (its KL term then waits: one backward at a time, so that a completion coming back
        meanwhile waits for one at most)."""
        if self.failed is not None:
            return
        if self.kl:
            self.kl_backward(1)
            return
        rows = self.early_rows()
        key = next((key for key, f in rows.items() if f.reward.done()), None)
        if key is None:
            return
        trainer, f, (group, j) = self.trainer, rows[key], key
        try:
            rewards = f.reward.result().to(trainer.accelerator.device)
            with self.busy():
                kl = self.summed[group].backward(j, rewards, self.row_inputs(group, j, f), f, self.scale(1),
                                                 self.row_loss)
        except Exception as exc:  # noqa: BLE001 - TRL's micro-batches run instead; the error is reported
            self.failed = exc
            return
        del self.forwards[group][j]
        if kl is None:
            self.held -= f.positions
        else:
            self.kl.append((kl, f.positions))
        trainer.overlap.forwards_answered += 1

    def kl_backward(self, count: int | None = None) -> None:
        """The backward of the first `count` (None: all) KL terms waiting, into the gradients; their graphs go."""
        while self.kl and count != 0 and self.failed is None:
            kl, positions = self.kl.pop(0)
            try:
                with self.busy():
                    self.backward(kl)
            except Exception as exc:  # noqa: BLE001 - TRL's micro-batches run instead; the error is reported
                self.failed = exc
            self.held -= positions
            count = None if count is None else count - 1

    def row_inputs(self, group: int, j: int, f: Forward) -> dict:
        """Row j's inputs to TRL's loss, as a group's chunk holds them but for the row's own length."""
        trainer, w = self.trainer, self.width
        inputs = {"prompt_ids": f.ids[:, :w], "prompt_mask": f.mask[:, :w], "completion_ids": f.ids[:, w:],
                  "completion_mask": f.mask[:, w:]}
        sampled = sampling_logps(f.answer, f.length, f.ids.device)
        if sampled is not None:
            inputs["sampling_per_token_logps"] = sampled
        if trainer.beta != 0.0:
            scored = self.work.rows.get(group, {}).get(j)
            if scored is None or scored.get("ref") is None:
                raise RuntimeError(f"completion {j} of group {group} has no streamed reference log-probs")
            inputs["ref_per_token_logps"] = scored["ref"]
        return self.provisional(inputs)

    def row_loss(self, inputs: dict, forward: Forward | None):
        """TRL's loss of one row's inputs, its forward answered from `forward` (None: run now): (loss, log-probs,
        entropies); TRL's old-policy tensors land in `inputs` on the row's first call."""
        trainer = self.trainer
        state = trainer.overlap
        answered = state.forwards_answered
        with self.loss_call(inputs, {0: forward} if forward is not None else None), \
                trainer.compute_loss_context_manager():
            loss = trainer._compute_loss(trainer.model_wrapped, inputs)
            (lp, ent), = state.capture
        state.forwards_answered = answered  # counted once per row, by backward_one
        return loss, lp, ent

    @contextlib.contextmanager
    def loss_call(self, chunk: dict, forwards: dict | None):
        """Around a call of TRL's `_compute_loss` on rows trained ahead: their forwards captured (`forwards`:
        those answered from a Forward), the old policy taken from the forward where the chunk has none yet, and
        the metrics it logs dropped (TRL logs them when its own micro-batches run: the replay)."""
        trainer = self.trainer
        state = trainer.overlap
        metrics = trainer._metrics["train"]
        before = {k: len(v) for k, v in metrics.items()}
        state.capture = []
        state.forwards = forwards or None
        old_policy = getattr(trainer, "old_policy", None)
        if old_policy is not None and "old_per_token_logps" not in chunk:
            old_policy.loss_inputs = chunk  # the old policy and IS ratio from this forward, as in the loss
        try:
            yield
        finally:
            state.capture = state.forwards = None
            if old_policy is not None:
                old_policy.loss_inputs = None
            for key in list(metrics):
                if key not in before:
                    del metrics[key]
                else:
                    del metrics[key][before[key]:]

    def provisional(self, chunk: dict) -> dict:
        """dapo, cispo, vespo: the chunk's token count provisional (the real one scales the gradients at the end)."""
        import torch

        trainer = self.trainer
        if trainer.loss_type in SUM_LOSSES:
            chunk["num_items_in_batch"] = torch.tensor(float(trainer.accelerator.num_processes
                                                             * trainer.args.steps_per_generation
                                                             / trainer.current_gradient_accumulation_steps),
                                                       device=chunk["prompt_ids"].device)
        return chunk

    def scale(self, rows: int) -> float:
        """What a chunk of `rows` rows' loss is multiplied by before its backward."""
        trainer = self.trainer
        scale = loss_scale(trainer)
        if trainer.loss_type in MEAN_LOSSES:
            scale *= rows / trainer.args.per_device_train_batch_size
        return scale

    def waiting_on(self) -> list:
        """The rewards the first pending group waits for (groups train in arrival order), and those of the last
        open group's completions alone: the Stream wakes the trainer when one is done and no completion is back, so
        a group trains, or a completion runs its backward, as soon as it may, not when the next completion ends."""
        if self.failed is not None:
            return []
        reward = self.work.rewards.get(self.pending[0][0]) if self.pending else None
        return (([reward] if reward is not None else []) + [f.reward for f in self.early_rows().values()]
                + ([DONE] if self.kl else []) + ([self.prefixes.wake] if self.scores_prefixes() else []))

    def scores_prefixes(self) -> bool:
        """Whether completions' tokens so far are scored here (the stream hands them over, the batch's work
        has passes to run on them)."""
        return self.prefixes is not None and self.work is not None and bool(self.work.prefix_models)

    def ready(self) -> None:
        worked = self.worked
        self.run(wait=0, last=self.arrivals >= self.total)
        self.backward_one()
        if self.worked == worked and self.failed is None:  # nothing else was ready: a completion's prefix
            self.score_prefix()

    def score_prefix(self) -> None:
        """The scoring passes of the completion with the most new tokens, on its prefix (ogrpo.overlap.prefixes),
        once it is START_SHARE of the cap long, while fewer than MAX_OPEN prefixes are held (its passes then wait
        for its end)."""
        if not self.scores_prefixes():
            return
        work = self.work
        held = work.prefix_passes
        start = max(prefixes.MIN_PIECE, int(prefixes.START_SHARE * self.trainer.max_completion_length))
        taken = self.prefixes.take(lambda key: key in held or len(held) < prefixes.MAX_OPEN, prefixes.MIN_PIECE,
                                   start)
        if taken is None:
            return
        (group, j), ids = taken
        t0 = time.time_ns()
        self.worked += 1
        timeline = self.trainer.overlap.timeline
        prompt = self.prompt_ids[group * self.trainer.num_generations]
        try:
            passes = held.get((group, j))
            if passes is None:
                passes = held[(group, j)] = {kind: prefixes.IncrementalPass(self.trainer, model, prompt,
                                                                            work.prefix_context)
                                             for kind, model in work.prefix_models.items()}
            for p in passes.values():
                p.extend(ids)
        except Exception as exc:  # noqa: BLE001 - the completion's passes run whole at its end instead
            held.pop((group, j), None)
            prefixes.report_failure(self.trainer.overlap, exc)
        finally:  # a scoring pass inside the wait for the server, as a completion's pass at its end
            if timeline is not None:
                timeline.record("trainer", "score", t0, time.time_ns())
        self.forward_prefix(group, j, prompt, ids)

    def forward_prefix(self, group: int, j: int, prompt: list, ids: list) -> None:
        """Completion j of `group`'s loss forward on its tokens so far, its graph kept (ogrpo.overlap.prefixes):
        begun where the graphs held leave room for it at the cap beside two more rows at the cap: a completion that
        ends meanwhile is still forwarded as it ends (which leaves room for one more, so a group's chunk still
        fits); MAX_FORWARDS at a time."""
        key, trainer = (group, j), self.trainer
        p = self.loss_prefixes.get(key)
        if p is None:
            if (not getattr(trainer.overlap, "prefix_forwards", False) or self.failed is not None
                    or group not in self.open or len(self.loss_prefixes) >= prefixes.MAX_FORWARDS
                    or self.held + 3 * self.reserve > self.budget):
                return
            p = self.loss_prefixes[key] = prefixes.IncrementalPass(trainer, trainer.model_wrapped, prompt, grad=True)
            self.held += self.reserve
        elif len(p.prompt) + len(ids) - 1 - p.fed < max(prefixes.MIN_PIECE, int(prefixes.FORWARD_PIECE_SHARE
                                                                                  * trainer.max_completion_length)):
            return  # too short a piece yet
        try:
            with self.busy():
                p.extend(ids)
        except Exception as exc:  # noqa: BLE001 - its forward runs whole at its end instead
            self.drop_prefix_forward(key)
            prefixes.report_failure(trainer.overlap, exc)

    def drop_prefix_forward(self, key: tuple[int, int]) -> None:
        if self.loss_prefixes.pop(key, None) is not None:
            self.held -= self.reserve

    def forward_from_prefix(self, group: int, j: int, completion: list, mask):
        """(log-probs, entropies) of completion j of `group`'s loss forward, from the one run on its prefix, its
        last tokens forwarded now; None where there is none, or it does not hold (a truncated row TRL masks: its
        forward attends to none of it)."""
        p = self.loss_prefixes.get((group, j))
        if p is None:
            return None
        self.drop_prefix_forward((group, j))
        if not bool(mask[self.width:self.width + len(completion)].all()):
            return None
        try:
            with self.busy():
                logps = p.finish(completion)
        except Exception as exc:  # noqa: BLE001 - its forward runs whole instead
            prefixes.report_failure(self.trainer.overlap, exc)
            return None
        if logps is None:
            return None
        self.work.prefix_forwards += 1
        return logps, p.entropies

    def train_now(self, index: int, answer: dict, early: bool) -> None:
        """Train group `index` now, waiting for its rewards; an error is raised (the other ranks are in step)."""
        reward = self.work.rewards.get(index)
        if reward is None:
            raise OverlapError(f"overlap: group {index} has no rewards to train on")
        self._train(index, answer, reward.result()[2])
        self.early += int(early)

    def finish(self) -> None:
        """Every group in: train what is left (waiting for its rewards)."""
        self.run(wait=len(self.pending), last=True)
        for key in list(self.loss_prefixes):  # completions that came back with their groups
            self.drop_prefix_forward(key)

    def run(self, wait: int, last: bool) -> None:
        """Train the pending groups in arrival order: the first `wait` whatever it takes for their rewards, the
        rest while their rewards are done."""
        while self.pending and self.failed is None:
            index, answer = self.pending[0]
            reward = self.work.rewards.get(index)
            if reward is None or (wait <= 0 and not reward.done()):
                return
            wait -= 1
            self.pending.pop(0)
            try:
                self._train(index, answer, reward.result()[2])
            except Exception as exc:  # noqa: BLE001 - TRL's micro-batches run instead; the error is reported
                self.failed = exc
                return
            if not last:
                self.early += 1

    def _train(self, index: int, answer: dict, rewards_per_func) -> None:
        import torch
        import torch.nn.functional as F

        trainer = self.trainer
        for _, j in sorted(key for key in self.loss_prefixes if key[0] == index):  # came back with the group
            self.forward_row(index, j, {k: answer[k][j:j + 1] for k in answer if isinstance(answer[k], list)},
                             whole=False)
        self.kl_backward()  # the KL terms waiting, their graphs released before the group's chunks
        if self.failed is not None:
            raise self.failed
        n = trainer.num_generations
        device = trainer.accelerator.device
        ids, mask, length = group_rows(trainer, self.prompt_ids[index * n], answer["completion_ids"], self.width)
        ids, mask = ids.to(device), mask.to(device)
        w = self.width
        inputs = {"prompt_ids": ids[:, :w], "prompt_mask": mask[:, :w], "completion_ids": ids[:, w:],
                  "completion_mask": mask[:, w:], "advantages": advantages(trainer, rewards_per_func.to(device), n)}
        sampled = sampling_logps(answer, length, device)
        if sampled is not None:
            inputs["sampling_per_token_logps"] = sampled
        if trainer.beta != 0.0:
            scored = self.work.scores.get(index)
            if scored is None or scored.get("ref") is None:
                raise RuntimeError(f"group {index} has no streamed reference log-probs")
            inputs["ref_per_token_logps"] = scored["ref"]
        # the rows whose backward ran as they ended first, then those forwarded as they ended, in one chunk with
        # as many others as fit beside the graphs held; a row's share of the gradient does not depend on its chunk
        summed = self.summed.pop(index, None)
        done = summed.rows if summed is not None else {}
        forwards = self.forwards.pop(index, {})
        order = sorted(done) + sorted(forwards) + [j for j in range(n) if j not in forwards and j not in done]
        logps = [F.pad(done[j].logps, (0, length - done[j].logps.size(1))) for j in sorted(done)]
        entropies = [None if done[j].entropies is None else
                     F.pad(done[j].entropies, (0, length - done[j].entropies.size(1))) for j in sorted(done)]
        rows_per_chunk = chunk_rows(trainer.args.per_device_train_batch_size, w, length, trainer.max_completion_length)
        if trainer.accelerator.num_processes > 1:
            rows_per_chunk = agreed_rows(rows_per_chunk, device)
        lo = len(done)
        while lo < n:
            if forwards:
                size = len(forwards) + max(0, (self.budget - self.held) // (w + length))
            elif self.held:
                size = max(1, (self.budget - self.held) // (w + length))
            else:
                size = rows_per_chunk
            rows = order[lo:lo + size]
            chunk = {k: v[rows] for k, v in inputs.items()}
            try:
                lp, ent = self._backward(chunk, {p: forwards[j] for p, j in enumerate(rows) if j in forwards})
            finally:
                self.held -= sum(f.positions for f in forwards.values())
                forwards = {}
            logps.append(lp)
            entropies.append(ent)
            lo += len(rows)
        if summed is not None:
            self.close_sums(summed, inputs, rewards_per_func.to(device))
        back = torch.tensor(order).argsort()  # batch order again
        self.groups[index] = Trained(inputs, torch.cat(logps)[back],
                                     None if any(e is None for e in entropies) else torch.cat(entropies)[back])

    def close_sums(self, summed, inputs: dict, rewards_per_func) -> None:
        """A group is whole: its early rows' advantage terms into the gradients (ogrpo.overlap.early_backward); a
        row whose rewards alone differ from the group's runs its term again from a fresh forward."""
        import torch

        trainer = self.trainer
        _, mean, divisor = reward_stats(trainer, rewards_per_func, trainer.num_generations)
        scale = self.scale(1)

        def redo(j: int, row: dict) -> None:
            device = row["prompt_ids"].device
            true = dict(row, advantages=inputs["advantages"][j:j + 1])
            loss = self.row_loss(true, None)[0]
            if trainer.beta != 0.0:  # the KL term is in the gradients already
                loss = loss - self.row_loss(dict(true, advantages=torch.zeros(1, device=device)), None)[0]
            self.backward(loss * scale)

        why = summed.close(rewards_per_func, float(mean[0]), float(divisor[0]) if divisor is not None else 1.0, redo)
        if why is not None:
            trainer.overlap.early_backward_redone.append(why)
        self.backward_early += len(summed.rows)

    def _backward(self, chunk: dict, forwards: dict | None = None):
        """The chunk's loss through TRL's `_compute_loss`, and its backward; `forwards`: the chunk's rows whose
        loss forward ran as their completion ended (row in chunk -> Forward), answered from it."""
        trainer = self.trainer
        chunk = self.provisional(dict(chunk))
        scale = self.scale(chunk["prompt_ids"].size(0))
        state = trainer.overlap
        with self.busy(), self.loss_call(chunk, forwards):
            # DDP reduces nothing here: `adopt` averages the batch's gradients once
            with trainer.accelerator.no_sync(trainer.model_wrapped), trainer.compute_loss_context_manager():
                loss = trainer._compute_loss(trainer.model_wrapped, chunk)
                self.backward(loss * scale)
            (lp, ent), = state.capture
        return lp, ent

    def backward(self, loss) -> None:
        """A scaled loss's backward into the step's gradients: the Trainer's, or under DeepSpeed the engine's
        inside the accumulation (it must not step)."""
        engine_side = deepspeed_side(self.trainer)
        if engine_side is not None:
            engine_side.chunk_backward(self.trainer, loss)
        else:
            self.trainer.accelerator.backward(loss)

    def check(self, out: dict) -> str | None:
        """Why TRL's batch `out` is not exactly what the groups trained on, else None."""
        if self.failed is not None:
            return f"a group's training failed: {type(self.failed).__name__}: {self.failed}"
        n = self.trainer.num_generations
        rows = out["prompt_ids"].size(0)
        if rows % n or sorted(self.groups) != list(range(rows // n)):
            return "not every group was trained"
        if "tool_mask" in out:
            return "TRL's batch has a tool mask"
        if "old_per_token_logps" in out and getattr(self.trainer, "old_policy", None) is None:
            return "TRL's batch has its own old-policy log-probs"
        width_out, keep = out["prompt_ids"].size(1), out["completion_ids"].size(1)
        for g, group in self.groups.items():
            rows_g = slice(g * n, (g + 1) * n)
            got = group.inputs
            w, length = got["prompt_ids"].size(1), got["completion_ids"].size(1)
            if w > width_out or length > keep:
                return f"group {g} is wider than TRL's batch"
            pairs = [(out["prompt_ids"][rows_g, width_out - w:], got["prompt_ids"]),
                     (out["prompt_mask"][rows_g, width_out - w:], got["prompt_mask"]),
                     (out["completion_ids"][rows_g, :length], got["completion_ids"]),
                     (out["completion_mask"][rows_g, :length], got["completion_mask"]),
                     (out["advantages"][rows_g], got["advantages"])]
            if ("sampling_per_token_logps" in out) != ("sampling_per_token_logps" in got):
                return f"group {g}: sampling log-probs on one side only"
            if "sampling_per_token_logps" in got:
                pairs.append((out["sampling_per_token_logps"][rows_g, :length], got["sampling_per_token_logps"]))
            if "ref_per_token_logps" in got:
                pairs.append((out["ref_per_token_logps"][rows_g, :length], got["ref_per_token_logps"]))
            if not all(early_backward.same_values(a, b) for a, b in pairs):
                return f"group {g}: TRL's batch differs from what the group trained on"
            if int(out["prompt_mask"][rows_g, :width_out - w].sum()) or \
                    int(out["completion_mask"][rows_g, length:].sum()):
                return f"group {g}: TRL's batch has tokens the group did not"
        return None

    def adopt(self, out: dict) -> Replay | None:
        """After TRL's batch is complete: keep the gradients and answer TRL's micro-batches from the groups (the
        batch gets its rows' indices), or drop them (TRL's micro-batches run); logs `overlap/trained_ahead`."""
        import torch

        trainer = self.trainer
        reason = self.check(out)
        ranks = trainer.accelerator.num_processes
        if ranks > 1:  # every rank keeps its gradients, or none does
            from accelerate.utils import gather_object

            reason = next((r for r in gather_object([reason]) if r is not None), None)
        metrics = trainer._metrics["train"]
        engine_side = deepspeed_side(trainer)
        if reason is not None:  # zero when the step began: TRL's micro-batches start afresh
            if engine_side is not None:
                engine_side.drop(trainer)
            else:
                trainer.model.zero_grad(set_to_none=True)
            metrics["overlap/trained_ahead"].append(0.0)
            trainer.overlap.train_ahead_fallbacks.append(reason)
            return None
        normalizer = 1.0
        if trainer.loss_type in SUM_LOSSES:  # TRL's normalizer, with the real count (the chunks' was 1)
            normalizer = (float(out["num_items_in_batch"].clamp(min=1.0)) / trainer.accelerator.num_processes
                          * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation)
        if engine_side is not None:  # the engine reduced them chunk by chunk; its step at the replay's end divides
            engine_side.install(trainer)
            trainer.overlap.gradient_divisor = normalizer
            trainer.overlap.trained_norm_expected = any(
                bool(g.inputs["advantages"].abs().sum() > 0) for g in self.groups.values())
        else:
            if ranks > 1:
                average_gradients(trainer.model, ranks)
            if normalizer != 1.0:
                for p in trainer.model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(1.0 / normalizer)
        metrics["overlap/trained_ahead"].append(float(len(self.groups)))
        metrics["overlap/trained_early"].append(float(self.early))
        metrics["overlap/forwarded_early"].append(float(trainer.overlap.forwards_answered - self.answered))
        metrics["overlap/backward_early"].append(float(self.backward_early))
        out[ROW_KEY] = torch.arange(out["prompt_ids"].size(0))
        return Replay(self.groups, trainer.num_generations, trainer.args.steps_per_generation)


def average_gradients(model, ranks: int, bucket_bytes: int = 64 << 20) -> None:
    """What DDP's reduction does at the last micro-batch, once for the batch: every trainable parameter's gradient
    averaged over the ranks (all-reduced in flat buckets of one dtype)."""
    import torch
    import torch.distributed as dist

    grads = []
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:  # untouched on this rank: its share is zero, and every rank must send the same
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
    by_dtype: dict = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        bucket, size = [], 0
        for g in same + [None]:
            if g is not None and (not bucket or size + g.numel() * g.element_size() <= bucket_bytes):
                bucket.append(g)
                size += g.numel() * g.element_size()
                continue
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat)
            flat.div_(ranks)
            offset = 0
            for b in bucket:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()
            bucket, size = ([g], g.numel() * g.element_size()) if g is not None else ([], 0)
