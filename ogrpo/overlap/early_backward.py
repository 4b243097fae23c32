"""Lossless streaming, a group's backward before it is whole (issue 36): each completion of a group still
generating runs its backward as it ends, so that only the backward of the completions that end last stays on the
critical path, not their whole groups' (where several groups end together, as completions cut at the length cap
do, every one of them).

Why it is exact: with the old policy taken from the loss forward the importance ratio is exp(0) = 1, and at a
ratio of 1 the gradient of the linear loss types (ogrpo.planner.train_ahead.LINEAR_LOSSES: grpo, dr_grpo, dapo,
luspo, cispo, sapo) is, per row, that of L_j(A) = L_j(0) + A * (L_j(1) - L_j(0)) in the advantage A (their
clipping is a tie at 1, their weights do not depend on A; sapo's temperature does, but not its slope at 1; vespo's
weight reads A's sign only where vLLM's importance-sampling ratio moves it off 1, the off-policy mask always). The group's advantages need all its rewards,
but A_j = (r_j - mean) / scale is linear in the row's own reward r_j, so with d_j the gradient of
L_j(1) - L_j(0) and c the first row's reward (subtracted so that large rewards do not cancel in float32):

    sum_j A_j d_j = (sum_j (r_j - c) d_j - (mean - c) sum_j d_j) / scale

Each early row's backward adds its d_j to two sums and puts the gradient of L_j(0) (the KL term; nothing where
beta = 0) into the gradients, a second backward that waits for the next moment the trainer is free (a completion
that is back goes first); when the group is whole its mean and scale close the sum. r_j comes from the
reward functions on the completion alone, queued on the reward thread like the groups'; the group's own call
still gives TRL's rewards, and where a completion's reward alone differs from it (a reward function that reads the
batch) those rows' d_j are computed again, with their true advantages, from a fresh forward.
"""

from __future__ import annotations

from ogrpo.planner.train_ahead import why_not_early_backward


def why_not(trainer) -> str | None:
    """Why this built trainer's groups cannot run their completions' backward before they are whole, else None."""
    return why_not_early_backward(trainer.loss_type, getattr(trainer, "off_policy_mask_threshold", None),
                                  getattr(trainer.args, "delta", None),
                                  bool(getattr(trainer, "is_deepspeed_enabled", False)),
                                  bool(getattr(trainer, "use_vllm", False)
                                       and getattr(trainer, "vllm_importance_sampling_correction", False)))


def weighted_rewards(trainer, rewards_per_func):
    """TRL's reward per row (sum_then_normalize): the weighted sum over the functions, NaN where none scored."""
    import torch

    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * trainer.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    rewards[unscorable] = torch.nan
    return rewards


def same_values(a, b) -> bool:
    """Whether two tensors hold the same values, NaN where the other has NaN."""
    import torch

    b = b.to(a.device)
    return a.shape == b.shape and bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


class Row:
    """An early row: its rewards per function (alone), its inputs (for a redo) and its log-probs and entropies
    (for TRL's micro-batches)."""

    def __init__(self, rewards_per_func, inputs: dict, logps, entropies):
        self.rewards_per_func, self.inputs, self.logps, self.entropies = rewards_per_func, inputs, logps, entropies


class EarlyBackward:
    """The rows of group `group` whose backward ran before the group was whole, and their two gradient sums."""

    def __init__(self, trainer, group: int):
        self.trainer, self.group = trainer, group
        self.rows: dict[int, Row] = {}
        self.centre = None  # c: the first finite reward among the rows
        self.params = [p for p in trainer.model.parameters() if p.requires_grad]
        self.sums = None  # [(sum (r_j - c) d_j, sum d_j)] per parameter

    def backward(self, j: int, rewards_per_func, inputs: dict, forward, scale: float, run_loss):
        """Row j's backward into the sums. `run_loss(inputs)`: TRL's loss of the row's inputs, forward answered
        from `forward`; returns (loss, log-probs, entropies). Returns its KL term L_j(0), scaled, whose backward
        into the gradients is the caller's (the row's graph is kept for it), or None where beta = 0 (the graph
        is released)."""
        import torch

        trainer = self.trainer
        device = inputs["prompt_ids"].device
        reward = float(weighted_rewards(trainer, rewards_per_func)[0])
        one = dict(inputs, advantages=torch.ones(1, device=device))
        loss_one, logps, entropies = run_loss(one, forward)
        kl = None
        if trainer.beta != 0.0:  # L_j(0) (the old policy's tensors from the first call)
            kl = run_loss(dict(one, advantages=torch.zeros(1, device=device)), forward)[0] * scale
        if reward == reward:  # NaN: no function scored the row, its advantage is 0
            self._add(self._gradient(loss_one * scale - kl if kl is not None else loss_one * scale,
                                     keep=kl is not None), reward)
        self.rows[j] = Row(rewards_per_func, {k: v for k, v in inputs.items() if k != "advantages"}, logps,
                           entropies)
        return kl

    def _gradient(self, loss, keep: bool):
        """The gradient of `loss` alone, the accumulated gradients left as they were (the Trainer's backward, so
        a loss scaler scales it as it scales the rest); `keep`: the graph stays for another backward."""
        saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        try:
            self.trainer.accelerator.backward(loss, retain_graph=keep)
            return [p.grad for p in self.params]
        finally:
            for p, g in zip(self.params, saved):
                p.grad = g

    def _add(self, d: list, reward: float) -> None:
        if self.centre is None:
            self.centre = reward
        shift = reward - self.centre
        if self.sums is None:
            self.sums = [(None if g is None else g * shift, g) for g in d]
            return
        for i, (g, (moved, plain)) in enumerate(zip(d, self.sums)):
            if g is None:
                continue
            if plain is None:
                self.sums[i] = (g * shift, g.clone())
            else:
                moved.add_(g, alpha=shift)
                plain.add_(g)

    def close(self, rewards_per_func, mean: float, scale: float, redo) -> str | None:
        """The group is whole: its rewards per function, mean and advantages' divisor. Adds the rows' advantage
        terms to the gradients; where a row's rewards alone differ from the group's, `redo(j, inputs)` computes
        every row's term from a fresh forward instead (the sums are dropped), and the reason is returned."""
        differ = [j for j, row in self.rows.items() if not same_values(row.rewards_per_func[0], rewards_per_func[j])]
        if differ:
            self.sums = None
            for j, row in self.rows.items():
                redo(j, row.inputs)
            return (f"the rewards of {len(differ)} completion(s) scored alone differ from their group's: their "
                    "backward ran again with the group's advantages")
        if self.sums is None or mean != mean:
            return None
        shift = mean - self.centre
        for p, (moved, plain) in zip(self.params, self.sums):
            if plain is None:
                continue
            term = moved.sub_(plain, alpha=shift).div_(scale)
            if p.grad is None:
                p.grad = term
            else:
                p.grad.add_(term)
        self.sums = None
        return None

