"""`rank_balance` (ogrpo/trainer/rank_balance.py): the trainer's ranks exchange scored rows so each computes about
the same number of tokens. The rule here is what the recipe shows; the trainer adds what only the built trainer
shows (dropout, the MoE aux loss, vision inputs)."""

from __future__ import annotations

from ogrpo.planner.train_ahead import MEAN_LOSSES, SUM_LOSSES


def decide(wanted: str | None, trl_get, processes: int, train_ahead: bool) -> tuple[str, str] | None:
    """("on" | "off", why) for a run of `processes` trainer processes; None for one (nothing to balance).
    `trl_get(key)`: the run's GRPOConfig value, the TRL line's default where the recipe has none."""
    if processes < 2:
        return None
    if wanted == "off":
        return "off", "set in the run config (ogrpo.rank_balance: off): each rank computes the rows it sampled for"
    loss = str(trl_get("loss_type"))
    reason = None
    if loss not in MEAN_LOSSES + SUM_LOSSES:
        reason = (f"loss_type {loss}: its loss is normalized by each micro-batch's token count" if loss == "bnpo"
                  else f"loss_type {loss}: its normalization is not known here")
    elif float(trl_get("top_entropy_quantile") if trl_get("top_entropy_quantile") is not None else 1.0) < 1.0:
        reason = "top_entropy_quantile < 1: the entropy mask is a quantile over each micro-batch's rows"
    elif trl_get("entropy_coef") or trl_get("use_adaptive_entropy"):
        reason = "the entropy bonus is a mean over each micro-batch"
    elif train_ahead:
        reason = "groups are trained ahead (overlap.train_ahead) on the rank that sampled them"
    if reason is not None:
        return "off", reason
    return "on", (f"the {processes} trainer processes exchange scored rows so each keeps as many rows as TRL gave it "
                  "and about the same number of tokens (a step waits for the rank with the most); a row weighs the "
                  f"same on any rank under loss_type {loss}, so losses and updates are TRL's; its per-micro-batch "
                  "metrics average other groupings of the same rows")
