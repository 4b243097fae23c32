"""`overlap.train_ahead` (ogrpo/overlap/train_ahead.py): under `lossless` with the batch streamed group by group,
each finished group's loss forward and backward run while the server generates the rest. The rule here is what
the recipe shows; the trainer adds what only the built trainer shows (dropout, a reward model, PEFT's reference)."""

from __future__ import annotations

MEAN_LOSSES = ("grpo", "sapo", "luspo", "dr_grpo")  # a row weighs 1 / per_device_train_batch_size
SUM_LOSSES = ("dapo", "cispo", "vespo")  # normalized by the batch's token count, known at its end


FULL_DETERMINISM = ("full_determinism: groups trained ahead sum their gradients in the order completions end, so a "
                    "rerun would agree only to rounding; the loss waits for the whole batch, and reruns are identical")


def why_not(loss_type: str, scale_rewards, multi_objective_aggregation: str | None, top_entropy_quantile: float,
            entropy_bonus: bool, deepspeed: bool, offload: bool = False, fp16: bool = False,
            full_determinism: bool = False) -> str | None:
    """Why a run with these settings cannot train groups ahead, else None (`deepspeed`: a ZeRO strategy; `offload`:
    its optimizer offloaded; `fp16`: it trains in fp16; `full_determinism`: TRL's, identical reruns asked for)."""
    if full_determinism:
        return FULL_DETERMINISM
    if loss_type == "bnpo":
        return ("loss_type bnpo: its loss is normalized by each micro-batch's token count, which TRL draws after "
                "shuffling the batch")
    if loss_type not in MEAN_LOSSES + SUM_LOSSES:
        return f"loss_type {loss_type}: its normalization is not known here"
    if scale_rewards == "batch" or multi_objective_aggregation == "normalize_then_sum":
        return "advantages are normalized over the whole batch (scale_rewards: batch, or normalize_then_sum)"
    if top_entropy_quantile < 1.0:
        return "top_entropy_quantile < 1: the entropy mask is a quantile over each micro-batch"
    if entropy_bonus:
        return "the entropy bonus is a mean over each micro-batch"
    if deepspeed and fp16 and loss_type in SUM_LOSSES:
        return (f"loss_type {loss_type} under DeepSpeed in fp16: the groups' gradients wait for the batch's token "
                "count to divide them, and until then are that many times larger in fp16 (overflow, skipped steps)")
    if deepspeed and offload:
        return ("ZeRO-3 with the optimizer offloaded: it gathers the step's gradients on the host only from a backward "
                "that reaches the weights, so the replayed step lost the groups' (measured)")
    return None


# at an importance ratio of 1 their gradient is, per row, linear in the advantage (ogrpo/overlap/early_backward.py):
# the loss itself for these; sapo's value reads the advantage's sign (its temperature), but its slope at a ratio of
# 1 does not: d/dr [sigmoid(t (r - 1)) 4 / t] = 1 there for any t
LINEAR_LOSSES = ("grpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")


def why_not_early_backward(loss_type: str, off_policy_mask_threshold, delta, deepspeed: bool = False,
                           correction: bool = False) -> str | None:
    """Why, with these GRPOConfig values, a group's completions cannot run their backward before the group is
    whole, else None (the plan's reading and the trainer's). `correction`: vLLM's importance-sampling correction
    is on."""
    if deepspeed:
        return "DeepSpeed reduces each backward's gradients into its partitions: a completion's cannot be kept apart"
    if loss_type == "vespo" and correction:
        # phi(w) = exp(lambda + k log w - lambda w) is 1 at w = 1 for either sign's (k, lambda); the correction's
        # ratio moves w off 1, where the two signs weigh a row differently
        return ("loss_type vespo with vLLM's importance-sampling correction: its weight of a row reads the "
                "advantage's sign wherever the sampler's ratio is not 1")
    if loss_type not in LINEAR_LOSSES + ("vespo",):
        return f"loss_type {loss_type}: its loss reads the advantage's sign"
    if off_policy_mask_threshold is not None:
        return "the off-policy mask reads the advantage's sign"
    if delta is not None and delta <= 1.0:
        return "delta <= 1 clips the importance ratio at 1"
    return None


def decide(wanted: str | None, trl_get, processes: int, deepspeed: bool, old_policy_pass: str | None,
           correction: bool, offload: bool = False) -> tuple[str, str]:
    """("on" | "off", why) for a lossless run whose batches stream group by group. `trl_get(key)`: the run's
    GRPOConfig value, the TRL line's default where the recipe has none."""
    if wanted == "off":
        return "off", "set in the run config (ogrpo.train_ahead: off): the loss runs after the whole batch is in"
    reason = why_not(str(trl_get("loss_type")), trl_get("scale_rewards"), trl_get("multi_objective_aggregation"),
                     float(trl_get("top_entropy_quantile") if trl_get("top_entropy_quantile") is not None else 1.0),
                     bool(trl_get("entropy_coef") or trl_get("use_adaptive_entropy")), deepspeed, offload,
                     bool(trl_get("fp16")), bool(trl_get("full_determinism")))
    if reason is None and correction and old_policy_pass != "from_loss":
        reason = "the old policy's log-probs come from TRL's separate pass over the whole batch"
    if reason is not None:
        return "off", reason
    why = ("each finished group's loss forward and backward run while the server generates the rest (gradient "
           "accumulation is a sum; the weights do not change until the optimizer step): only the last group's, the "
           "optimizer step and the push wait for generation; the gradients are summed in the order completions end, "
           "so a rerun agrees to rounding, not bit for bit (ogrpo.train_ahead: off where it must)")
    if processes > 1:
        why += (f"; each of the {processes} trainer processes trains its own groups, the ranks' k-th together and in "
                "as many chunks (its loss metrics are collectives)")
        why += (", each chunk's gradients reduced by DeepSpeed as a micro-batch's are" if deepspeed else
                ", and the gradients are averaged once, after the last group")
    elif deepspeed:
        why += "; each chunk's backward runs through DeepSpeed's engine, as a micro-batch's does"
    return "on", why


def decide_early_backward(wanted: str | None, trl_get, sums_gib: float, room_gib: float,
                          groups: int, deepspeed: bool = False) -> tuple[str, str, int]:
    """("on" | "off", why, open groups that may hold their sums at once) for a group's completions running their
    backward as each ends, before the group is whole (one trainer process, groups trained ahead): where the loss is
    linear in the advantage and at least one group's two gradient sums (`sums_gib` each pair) fit in the trainer's
    memory left (`room_gib`), as many of the batch's `groups` as fit, unless the run config says off."""
    wait = "a group's backward waits for the whole group"
    if wanted == "off":
        return "off", f"set in the run config (ogrpo.early_backward: off): {wait}", 0
    why = why_not_early_backward(str(trl_get("loss_type")), trl_get("off_policy_mask_threshold"), trl_get("delta"),
                                 deepspeed, bool(trl_get("vllm_importance_sampling_correction")))
    if why is not None:
        return "off", f"{wait}: {why}", 0
    held = min(groups, int(room_gib // sums_gib)) if sums_gib > 0 else groups
    if held < 1:
        return "off", (f"{wait}: a group's two gradient sums ({sums_gib:.2f} GiB) do not fit in the "
                       f"{max(0.0, room_gib):.2f} GiB the trainer's budget leaves"), 0
    some = "every open group" if held >= groups else f"{held} of the batch's {groups} groups at a time"
    return "on", ("each completion runs its backward as it ends, with its own rewards (the loss is linear in the "
                  "advantage), so only the last completion's waits for its group; two gradient sums per group "
                  f"({sums_gib:.2f} GiB) for {some} ({held * sums_gib:.2f} GiB)"), held
