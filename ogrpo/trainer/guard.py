"""The inf/NaN stop: a loss (or the log-probs under it) that becomes inf/NaN stops the run at that step, with one
line naming the step, the precision and what to try."""

from __future__ import annotations

from ogrpo.dtypes import from_trainer_flags, precision
from ogrpo.errors import LaunchError


class NonFiniteError(LaunchError):
    """The loss (or the log-probs under it) became inf/NaN: the run stops at that step (exit 1).

    Fatal under every precision, not only fp16: after a NaN loss the optimizer writes NaN into the weights (the
    fp16 loss scaler skips steps with inf *gradients*, never a NaN *loss*), so every later step, checkpoint and
    weight push is garbage. Under fp16 the usual cause is an activation past fp16's ±65504, which is what the
    hint says; under bf16/fp32 it is the learning rate, the weights or the data (not a reward: TRL
    turns NaN advantages into 0).
    """


HINTS = {
    "fp16": "fp16 holds at most ±65504 and V100-class GPUs have no bf16: `ogrpo selftest --gpu` names the "
            "module whose activations exceed it; try a lower learning_rate, a model that stays in fp16 range, "
            "or fp32 (model_init_kwargs.dtype float32 without fp16: twice the memory)",
    "bf16": "bf16 has fp32's range, so this is rarely overflow: check learning_rate, the model's weights "
            "and the data; the last checkpoint before this step is clean",
    "fp32": "check learning_rate, the model's weights and the data; the last checkpoint before this step is "
            "clean",
}


def precision_of(trainer) -> str:
    """fp16 | bf16 | fp32: the narrowest range the forward runs in, from the AMP flags and the weights' dtype
    (fp16 weights under bf16 autocast still run norms and residual adds in fp16)."""
    amp = from_trainer_flags(trainer.args)
    weights = str(getattr(getattr(trainer, "model", None), "dtype", "")).removeprefix("torch.")
    for name in ("float16", "bfloat16"):  # narrowest range first
        if name in (amp, weights):
            return precision(name)
    return "fp32"


def nonfinite_message(step: int, value: float, precision: str, logps_nonfinite: bool) -> str:
    what = "inf" if value in (float("inf"), float("-inf")) else "nan"
    source = " (the per-token log-probs were already non-finite: the logits overflowed)" if logps_nonfinite else ""
    return f"step {step}: loss is {what} under {precision}{source}; stopped. hint: {HINTS[precision]}"


class NonFiniteGuard:
    """Checks every micro-step's loss, and notes whether any per-token log-probs went non-finite on the way.

    Neither check is a TrainerCallback: `on_log` sees the loss only every logging_steps, averaged, and the
    Trainer's logging_nan_inf_filter (on by default) replaces a NaN step loss by the running mean, so a callback
    never sees it. `training_step` returns the loss the Trainer itself tests for NaN (one device sync per
    micro-step already), so reading it here costs nothing more; the log-prob flag stays on the device (no sync)
    and is read only when the loss fails. The trainer's outermost layer (`Guarded`) calls it, so its error is the
    one the trainer sees.
    """

    def __init__(self, trainer) -> None:
        self._bad_logps = None  # device bool tensor, or None when no log-probs were computed since the last reset
        self.trainer = trainer

    def note_logps(self, out) -> None:
        import torch

        logps = out[0] if isinstance(out, tuple) else out
        if torch.is_tensor(logps):
            bad = ~torch.isfinite(logps.detach()).all()
            self._bad_logps = bad if self._bad_logps is None else (self._bad_logps | bad)

    def training_step(self, fn, *args, **kwargs):
        import torch

        try:
            loss = fn(*args, **kwargs)
        except RuntimeError as exc:
            # HF generate samples with torch.multinomial, which refuses inf/NaN probabilities: logits that
            # overflowed during generation (fp16), before any loss exists
            if "probability tensor contains" not in str(exc):
                raise
            step = self.trainer.state.global_step + 1
            precision = precision_of(self.trainer)
            raise NonFiniteError(f"step {step}: sampling probabilities are inf/nan under {precision} (the "
                                 f"logits overflowed during generation); stopped. hint: {HINTS[precision]}"
                                 ) from exc
        if torch.is_tensor(loss) and not bool(torch.isfinite(loss.detach()).all()):
            value = float(loss.detach().float().reshape(-1)[0])
            logps_bad = self._bad_logps is not None and bool(self._bad_logps)
            step = self.trainer.state.global_step + 1  # the optimizer step this micro-batch belongs to
            raise NonFiniteError(nonfinite_message(step, value, precision_of(self.trainer), logps_bad))
        self._bad_logps = None
        return loss


class Guarded:
    """The trainer's outermost layer (OgrpoGRPOTrainer): the inf/NaN stop, on when `nonfinite_guard` is set."""

    nonfinite_guard: NonFiniteGuard | None = None

    def guard_nonfinite(self) -> NonFiniteGuard:
        """Stop the run with one line naming the step when the loss becomes inf/NaN (see NonFiniteGuard)."""
        self.nonfinite_guard = NonFiniteGuard(self)
        return self.nonfinite_guard

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self.nonfinite_guard is not None:
            self.nonfinite_guard.note_logps(out)
        return out

    def training_step(self, *args, **kwargs):
        guard, inner = self.nonfinite_guard, super().training_step
        return inner(*args, **kwargs) if guard is None else guard.training_step(inner, *args, **kwargs)
