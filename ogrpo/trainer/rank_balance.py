"""Generation batches balanced across the trainer's ranks by tokens (issue 36).

TRL hands each rank the rows it sampled for (its slice of the generation batch) and every rank then computes its
rows' passes; a step waits for the rank with the most tokens (DDP's gradient reduction, ZeRO-3's gathers per
layer). With completions of varied length one rank can hold far more tokens than another. Here, once TRL's
generation batch is scored, the ranks exchange rows so that each keeps as many rows as before and about the same
number of real tokens: the longest rows first, each to the rank with the fewest tokens that still has room.
Nothing is exchanged where that would not lower the most any rank holds.

Why it is exact: a row's share of the gradient does not depend on the rank that computes it for the loss types
this runs under, as long as each rank keeps its number of rows (the rule train-ahead relies on too,
ogrpo/planner/train_ahead.py): grpo, sapo, luspo and dr_grpo average over each micro-batch's
per_device_train_batch_size rows, and DDP (or ZeRO) averages the ranks; dapo, cispo and vespo divide by the
whole batch's token count. Advantages, the reference and old policy's log-probs travel with their rows. What
changes is TRL's per-micro-batch metrics (clip ratios, entropy, the importance-sampling statistics): each is a
mean over a rank's rows, averaged over the ranks, so it is a mean over other groupings of the same rows.

Off (the plan says why) for one process, bnpo (its loss divides by each micro-batch's tokens),
`top_entropy_quantile < 1` and the entropy bonus (a quantile or mean over each micro-batch), training groups ahead
(each rank trains the groups it sampled for while the server generates), dropout (the masks drawn would fall on
other rows), the MoE aux loss and vision inputs.
"""

from __future__ import annotations

from ogrpo.dropout import draws_dropout

LEFT_PADDED = ("prompt_ids", "prompt_mask")  # TRL pads prompts on the left, everything else per row on the right


def assignment(costs: list[int], ranks: int) -> list[list[int]] | None:
    """Rows (indices into `costs`, every rank's rows in rank order, an equal number per rank) for each rank, the
    most expensive rows first, each to the rank with the least cost so far that has room; None where that holds
    no rank to less than the most any rank holds now."""
    per = len(costs) // ranks
    if ranks < 2 or per * ranks != len(costs):
        return None
    now = max(sum(costs[r * per:(r + 1) * per]) for r in range(ranks))
    sums, rows = [0] * ranks, [[] for _ in range(ranks)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min((r for r in range(ranks) if len(rows[r]) < per), key=lambda r: (sums[r], r))
        rows[r].append(i)
        sums[r] += costs[i]
    if max(sums) >= now:
        return None
    return [sorted(r) for r in rows]


def spread(costs: list[int], rows: list[list[int]]) -> float:
    """The most tokens a rank holds over the mean (1: even)."""
    sums = [sum(costs[i] for i in r) for r in rows]
    mean = sum(sums) / len(sums)
    return max(sums) / mean if mean else 1.0


def why_not(trainer) -> str | None:
    """Why this built trainer's batches cannot be balanced exactly, else None (the plan's rule holds the recipe's
    part: ogrpo/planner/rank_balance.py)."""
    if trainer.accelerator.num_processes < 2:
        return "one trainer process"
    if getattr(trainer, "aux_loss_enabled", False):
        return "the router's aux loss is a mean over each micro-batch"
    if getattr(trainer, "_is_vlm", False):
        return "vision inputs"
    if draws_dropout(trainer.model):
        return "the model has dropout: the masks drawn would fall on other rows"
    if getattr(getattr(trainer, "overlap", None), "train_ahead", None):
        return "groups are trained ahead on the rank that sampled them"
    return None


class BalanceState:
    def __init__(self):
        self.batches = self.exchanged = 0
        self.before: list[float] = []  # per batch: the most tokens a rank held over the mean, before and after
        self.after: list[float] = []
        self.skipped: list[str] = []  # batches left as TRL split them, and why

    def summary(self) -> dict:
        def mean(xs):
            return round(sum(xs) / len(xs), 4) if xs else None

        return {"batches": self.batches, "exchanged": self.exchanged, "spread_before": mean(self.before),
                "spread_after": mean(self.after), "skipped": sorted(set(self.skipped))}


class RankBalanced:
    """The trainer's layer (OgrpoGRPOTrainer): off until `balance_ranks()` turns it on."""

    rank_balance: BalanceState | None = None

    def balance_ranks(self) -> str | None:
        reason = why_not(self)
        if reason is None:
            self.rank_balance = BalanceState()
        return reason

    def _generate_and_score_completions(self, *args, **kwargs):
        out = super()._generate_and_score_completions(*args, **kwargs)
        state = self.rank_balance
        if state is None or not self.model.training:
            return out
        return exchange(self, out, state)


def _row_keys(out: dict, rows: int) -> list[str] | None:
    """The batch's per-row tensors; None where it holds something per row that is not one."""
    import torch

    keys = []
    for key, value in out.items():
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                continue  # num_items_in_batch: the whole batch's
            if value.size(0) != rows:
                return None
            keys.append(key)
        elif value is not None:
            return None
    return keys


def exchange(trainer, out: dict, state: BalanceState) -> dict:
    """`out` (this rank's scored rows) with the rows the balanced assignment gives this rank."""
    import torch

    acc = trainer.accelerator
    rows = out["prompt_ids"].size(0)
    keys = _row_keys(out, rows)
    state.batches += 1
    device = out["prompt_ids"].device
    # every rank must agree to exchange: a rank whose batch holds something else (images) keeps TRL's split
    ok = torch.tensor([0 if keys is None else 1, rows], device=device)
    agreed = acc.gather(ok.unsqueeze(0))
    if int(agreed[:, 0].min()) == 0 or int(agreed[:, 1].min()) != int(agreed[:, 1].max()):
        state.skipped.append("a rank's batch holds per-row data other than tensors, or ranks hold different rows")
        return out
    costs_local = out["prompt_mask"].sum(1) + out["completion_mask"].sum(1)
    costs = [int(c) for c in acc.gather(costs_local.to(torch.long)).tolist()]
    ranks = acc.num_processes
    given = [list(range(r * rows, (r + 1) * rows)) for r in range(ranks)]
    state.before.append(spread(costs, given))
    placed = assignment(costs, ranks)
    if placed is None:
        state.after.append(state.before[-1])
        return out
    state.exchanged += 1
    state.after.append(spread(costs, placed))
    mine = torch.tensor(placed[acc.process_index], device=device)
    new = dict(out)
    for key in keys:
        value = out[key]
        left = key in LEFT_PADDED
        if value.dim() > 1:
            value = acc.pad_across_processes(value, dim=1, pad_index=0, pad_first=left)
        new[key] = acc.gather(value).index_select(0, mine)
    _trim(new, keys)
    return new


def _trim(out: dict, keys: list[str]) -> None:
    """Drop the columns that only padding fills now: prompts' leading ones, completions' trailing ones (the widths
    TRL gives a rank's batch: its longest prompt and completion)."""
    prompt = int(out["prompt_mask"].sum(1).max()) if out["prompt_mask"].numel() else 0
    width = out["prompt_ids"].size(1)
    mask = out["completion_mask"]
    length = mask.size(1)
    real = mask.bool().any(0).nonzero()
    keep = int(real.max()) + 1 if real.numel() else 1
    for key in keys:
        value = out[key]
        if value.dim() < 2:
            continue
        if key in LEFT_PADDED and value.size(1) == width:
            out[key] = value[:, width - max(prompt, 1):]
        elif value.size(1) == length:
            out[key] = value[:, :keep]
