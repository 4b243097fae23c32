"""One forward for the old policy and the loss (issue 36, first piece): where generation and the optimizer step are
aligned, the old-policy log-probs are the loss forward's own, detached, and TRL's separate pass is skipped.

Why it is exact: TRL runs the old-policy pass at scoring time, with the weights of the step about to train, only to
compute vLLM's importance-sampling ratio (and, when generation and optimizer steps are misaligned, the PPO ratio).
With `num_iterations == 1` and `gradient_accumulation_steps % steps_per_generation == 0`, every micro-batch of the
generation batch is trained before the next optimizer step, with those same weights: the loss forward's
`per_token_logps.detach()` is the tensor the separate pass computes (the same rows, the same padding; on CPU the
same bits). So the pass is answered with a placeholder, and in the loss, right after the policy forward and before
TRL reads them, the micro-batch's `old_per_token_logps` and `importance_sampling_ratio` are filled in from the
detached log-probs, by TRL's own rule (`is_ratio`). TRL's `sampling/*` metrics, which it computed from the
placeholder, are taken back and computed again over the whole generation batch once its last micro-batch has been
trained: the same sums, counts, minima and maxima, gathered over the ranks as TRL gathers them.

Where it is off (TRL's pass runs, the plan and the manifest say why): misaligned steps or `num_iterations > 1` (the
old policy is an earlier version), a model with dropout (the separate pass draws other masks), Liger's loss (it
reads the inputs without TRL's per-token forward), `one-step` (its importance statistics are read at scoring time),
vision inputs.
"""

from __future__ import annotations

import math

from ogrpo.dropout import draws_dropout
from ogrpo.planner.settings import earlier_old_policy

SAMPLING_METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                    "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
                    "sampling/importance_sampling_ratio/max")


def why_not(trainer) -> str | None:
    """Why the old-policy pass cannot come from the loss forward for this trainer; None where it can."""
    args = trainer.args
    if not (getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False)):
        return "TRL runs no separate old-policy pass here (no vLLM importance-sampling correction)"
    earlier = earlier_old_policy(trainer.num_iterations, args.steps_per_generation, args.gradient_accumulation_steps)
    if earlier:
        return earlier
    if getattr(args, "use_liger_kernel", False) or getattr(trainer, "use_liger_kernel", False):
        return "Liger's GRPO loss reads the old log-probs without TRL's per-token forward"
    if getattr(trainer, "_is_vlm", False):
        return "vision inputs"
    if draws_dropout(trainer.model):
        return "the model has dropout: the separate pass draws other masks than the loss forward"
    return None


def is_ratio(trainer, old, sampling, mask):
    """vLLM's importance-sampling ratio as TRL's `_generate_and_score_completions` computes it (1.9.2 and 1.16:
    ogrpo/trainer/overrides.py holds both to this rule's text)."""
    import torch

    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    mode = trainer.vllm_importance_sampling_mode
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    low, high = trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=low, max=high)
    if mode in ("sequence_mask", "token_mask"):
        low = low if low is not None else -math.inf
        high = high if high is not None else math.inf
        return ratio.masked_fill((ratio < low) | (ratio > high), value=0.0)
    raise ValueError(f"Unknown vLLM importance sampling level: {mode}")


class BatchStats:
    """TRL's `sampling/*` statistics of one generation batch, accumulated over its micro-batches."""

    def __init__(self, micro_batches: int):
        self.left = micro_batches
        self.delta_sum = self.delta_count = self.ratio_sum = self.ratio_count = 0.0
        self.delta_max = self.ratio_min = self.ratio_max = None

    def add(self, old, sampling, ratio, mask, sequence_level: bool) -> None:
        import torch

        delta = torch.abs(old - sampling)
        keep = mask.bool()
        delta = delta[keep & ~torch.isnan(delta)]
        flat = ratio.flatten() if sequence_level else ratio[keep]
        if delta.numel():
            self.delta_sum += float(delta.double().sum())
            self.delta_count += delta.numel()
            self.delta_max = max(float(delta.max()), self.delta_max if self.delta_max is not None else -math.inf)
        if flat.numel():
            self.ratio_sum += float(flat.double().sum())
            self.ratio_count += flat.numel()
            self.ratio_min = min(float(flat.min()), self.ratio_min if self.ratio_min is not None else math.inf)
            self.ratio_max = max(float(flat.max()), self.ratio_max if self.ratio_max is not None else -math.inf)

    def log(self, trainer) -> None:
        """Gathered over the ranks as TRL gathers its per-rank values (every rank calls this, once per batch)."""
        import torch
        from trl.trainer.utils import nanmax, nanmin

        device = trainer.accelerator.device
        acc = trainer.accelerator

        def t(x):
            return torch.tensor(0.0 if x is None else x, device=device)

        mean_delta = t(self.delta_sum / self.delta_count if self.delta_count else 0.0)
        metrics = trainer._metrics["train"]
        metrics[SAMPLING_METRICS[0]].append(acc.gather(mean_delta).mean().item())
        metrics[SAMPLING_METRICS[1]].append(acc.gather(t(self.delta_max)).max().item())
        metrics[SAMPLING_METRICS[2]].append(nanmin(acc.gather(t(self.ratio_min))).item())
        mean_ratio = t(self.ratio_sum / self.ratio_count if self.ratio_count else 0.0)
        metrics[SAMPLING_METRICS[3]].append(acc.gather(mean_ratio).nanmean().item())
        metrics[SAMPLING_METRICS[4]].append(nanmax(acc.gather(t(self.ratio_max))).item())


class OldPolicyState:
    def __init__(self):
        self.scoring = False  # inside a training batch's _generate_and_score_completions
        self.pending = False  # the old-policy pass of that batch is still to come
        self.skipped = False  # it was answered with the placeholder
        self.loss_inputs = None  # the micro-batch whose loss forward runs now
        self.stats: BatchStats | None = None


class OldPolicyFromLoss:
    """The trainer's layer (OgrpoGRPOTrainer): off until `old_policy_from_loss()` turns it on."""

    old_policy: OldPolicyState | None = None

    def old_policy_from_loss(self) -> str | None:
        """Take the old-policy log-probs from the loss forward where that is exact; returns why not, else None."""
        reason = why_not(self)
        if reason is None:
            self.old_policy = OldPolicyState()
        return reason

    def _generate_and_score_completions(self, *args, **kwargs):
        state = self.old_policy
        if state is None or not self.model.training:
            return super()._generate_and_score_completions(*args, **kwargs)
        state.scoring, state.pending, state.skipped = True, True, False
        try:
            out = super()._generate_and_score_completions(*args, **kwargs)
        finally:
            state.scoring = state.pending = False
        if state.skipped:
            metrics = self._metrics["train"]
            for name in SAMPLING_METRICS:  # TRL's, from the placeholder: computed again over the batch's losses
                if metrics.get(name):
                    metrics[name].pop()
            out.pop("old_per_token_logps", None)
            state.stats = BatchStats(self.args.steps_per_generation)
        return out

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args,
                                           **kwargs):
        import torch

        state = self.old_policy
        if state is not None and state.pending and model is self.model and not torch.is_grad_enabled():
            # TRL's old-policy pass (the first pass on the policy while a training batch is scored)
            state.pending, state.skipped = False, True
            rows = input_ids.size(0)
            return torch.zeros(rows, logits_to_keep, device=input_ids.device), None, None
        out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args,
                                                         **kwargs)
        if state is not None and state.loss_inputs is not None and torch.is_grad_enabled():
            inputs, state.loss_inputs = state.loss_inputs, None
            old = out[0].detach()
            mask = inputs["completion_mask"] if "tool_mask" not in inputs else \
                inputs["completion_mask"] * inputs["tool_mask"]
            sampling = inputs["sampling_per_token_logps"]
            ratio = is_ratio(self, old, sampling, mask)
            inputs["old_per_token_logps"] = old
            inputs["importance_sampling_ratio"] = ratio
            if state.stats is not None:  # None for a group trained ahead (ogrpo.overlap.train_ahead)
                state.stats.add(old, sampling, ratio, mask, self.vllm_importance_sampling_mode in
                                ("sequence_mask", "sequence_truncate"))
        return out

    def _compute_loss(self, model, inputs, *args, **kwargs):
        state = self.old_policy
        if state is None or state.stats is None or not self.model.training:
            return super()._compute_loss(model, inputs, *args, **kwargs)
        state.loss_inputs = inputs
        try:
            loss = super()._compute_loss(model, inputs, *args, **kwargs)
        finally:
            state.loss_inputs = None
        state.stats.left -= 1
        if state.stats.left == 0:
            state.stats.log(self)
            state.stats = None
        return loss
