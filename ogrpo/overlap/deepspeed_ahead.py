"""Groups trained ahead under DeepSpeed ZeRO-2/3 (ogrpo.overlap.train_ahead): the engine's side.

A group's chunk runs its backward through the engine outside an accumulation boundary, so the engine reduces and
partitions its gradients as it does for any micro-batch of a step (and ZeRO-3 gathers the parameters in its
forward): every rank runs as many chunks as the others, in the same order (RankGroups trains the ranks' k-th
groups together, and TrainAhead gives every rank's group as many chunks). TRL's micro-batches are then replayed from
the groups' log-probs (train_ahead.Replay): their losses reach no weight, so only the one at the boundary runs a
backward, which closes the accumulation, and the engine steps. ZeRO-2's reduction runs only once a parameter's
gradient arrives: that backward gives one parameter a zero gradient (ZeRO-3 closes without). dapo, cispo and vespo
divide the gradients by the batch's token count, known once the last group is in: DeepSpeed's step divides them by
its loss scale (and reports and clips their norm divided by it too), so that scale is multiplied by the count for
that one step. Where TRL's batch is not what the groups trained on, the step's gradients are dropped as DeepSpeed
drops them after an fp16 overflow, and TRL's micro-batches run.

Measured on CPU (DeepSpeed 0.19.8, two gloo ranks, a 4.2M model, chunks of 3-3-2 rows against micro-batches of 2):
the chunks plus that closing backward, with or without a divisor, give the plain micro-batches' grad norms to 1e-7
in fp32 and to bf16's rounding (4e-4) in bf16 with fp32 gradient accumulation; dropping gives them exactly. ZeRO-3
with the optimizer offloaded lost the chunks' gradients (norm 0), and in fp16 a token-count loss's gradients would
wait at the count's size: the plan keeps training ahead off for both (ogrpo.planner.train_ahead). fp16 itself
(V100: a mean loss, under the dynamic loss scale) is untested: no GPU was lent.
"""

from __future__ import annotations

import contextlib

from accelerate.utils.deepspeed import DeepSpeedEngineWrapper

from ogrpo.overlap.pipeline import OverlapError


def why_not() -> str | None:
    """Why the installed accelerate cannot replay a step under DeepSpeed, else None: its engine wrapper must be told
    which backward is the accumulation boundary (older releases step the engine after every backward)."""
    import inspect

    if "sync_gradients" not in inspect.signature(DeepSpeedEngineWrapper.backward).parameters:
        return "this accelerate steps DeepSpeed's engine after every backward (no accumulation boundary to replay)"
    return None


def engine_of(trainer):
    return trainer.accelerator.deepspeed_engine_wrapped.engine


def chunk_backward(trainer, loss) -> None:
    """A group's chunk: the engine's backward inside the step's accumulation (never its boundary, never a step);
    the loss is scaled already, as the Trainer scales its own under DeepSpeed."""
    engine = engine_of(trainer)
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(loss, scale_wrt_gas=False)


def closing_loss(engine, loss):
    """The replayed micro-batch's loss at the boundary, made to close ZeRO-2's accumulation (a zero gradient into
    one parameter starts its reduction, whose epilogue collects the partitions); ZeRO-3's closes as it is."""
    if engine.zero_optimization_stage() >= 3:
        return loss
    first = next(p for p in engine.module.parameters() if p.requires_grad)
    return loss + first.reshape(-1)[0] * 0.0  # one element: a sum of half-precision weights could overflow


def drop(trainer) -> None:
    """The step's gradients gone from the engine, as DeepSpeed's own overflow clean-up leaves them: TRL's
    micro-batches then start from nothing."""
    optimizer = engine_of(trainer).optimizer
    optimizer.zero_grad(set_to_none=True)
    if getattr(optimizer, "offload_optimizer", False) or getattr(optimizer, "cpu_offload", False):
        optimizer.reset_cpu_buffers()
    elif hasattr(optimizer, "all_grad_tensors"):  # ZeRO-1/2
        release = getattr(optimizer, "_release_preflattened_grad_buffers", None)
        if release is not None:
            release()
        # its step clears the groups it averaged; mid-accumulation the sums live in all_grad_tensors alone
        for k in set(optimizer.averaged_gradients) | set(optimizer.all_grad_tensors):
            optimizer.averaged_gradients[k] = None
            optimizer.all_grad_tensors[k] = None
        optimizer.micro_step_id = -1  # what its step() starts the next accumulation from
    elif hasattr(optimizer, "averaged_gradients"):  # ZeRO-3 (zero_grad restarted its micro-steps)
        optimizer.averaged_gradients = {}
    else:
        raise OverlapError(f"overlap: cannot drop the gradients of DeepSpeed's {type(optimizer).__name__}; set "
                           "ogrpo.train_ahead: off")


@contextlib.contextmanager
def gradients_divided(optimizer, divisor: float):
    """Within: DeepSpeed's step divides the gradients by `divisor` too (its loss scale multiplied by it, and
    divided back after the step)."""
    if divisor == 1.0:
        yield
        return
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is None or getattr(optimizer, "custom_loss_scaler", False):
        raise OverlapError(f"overlap: DeepSpeed's {type(optimizer).__name__} has no loss scale to divide the "
                           "gradients by the batch's token count; set ogrpo.train_ahead: off")
    scaler.cur_scale *= divisor
    try:
        yield
    finally:
        scaler.cur_scale /= divisor


class ReplayingEngine(DeepSpeedEngineWrapper):
    """accelerate's engine wrapper (its backward: the engine's backward, then its step at the boundary), for a
    step whose micro-batches may be replayed: a replayed one (`state.replayed`, set by its loss) adds nothing to
    the gradients, which the groups' chunks put in the engine already; the one at the boundary closes the
    accumulation and steps."""

    def __init__(self, engine, state):
        super().__init__(engine)
        self.state = state

    def backward(self, loss, sync_gradients=True, **kwargs):
        if not self.state.replayed:
            return super().backward(loss, sync_gradients=sync_gradients, **kwargs)
        self.state.replayed = False
        if not sync_gradients:
            return None
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.backward(closing_loss(self.engine, loss), **kwargs)
        with gradients_divided(self.engine.optimizer, self.state.gradient_divisor):
            self.engine.step()
        norm = self.engine.get_global_grad_norm()
        if norm is not None and float(norm) == 0.0 and self.state.trained_norm_expected:
            raise OverlapError("overlap: the groups trained ahead gave DeepSpeed's step no gradient (global norm "
                               "0); set ogrpo.train_ahead: off")
        return None


def install(trainer) -> None:
    """The accelerator's engine wrapper replaced by a ReplayingEngine (once), before a replayed step's backward."""
    acc = trainer.accelerator
    if not isinstance(acc.deepspeed_engine_wrapped, ReplayingEngine):
        acc.deepspeed_engine_wrapped = ReplayingEngine(acc.deepspeed_engine_wrapped.engine, trainer.overlap)
