"""The weight push of a DeepSpeed ZeRO-3 trainer under `ogrpo.overlap: one-step`: one gather per step, done
while the server generates instead of where the server waits for the weights.

TRL's push (VLLMGeneration.sync_weights -> _iter_named_params) gathers each ZeRO-3 parameter on its own, a
collective per parameter on every rank, inside the push. Under one-step the push comes after the pipeline has
waited for the request in flight (ogrpo/overlap/pipeline.py): every one of those gathers then sits between the end
of a generation and the start of the next, with the server idle. Here, when the optimizer step ends (the server
is then generating the batch sent one step ahead), every rank takes part in a single gather of all parameters
and rank 0 keeps a copy of the full weights under the names vLLM expects; the push that follows streams that
copy and runs no collective on any rank. The first push (no step has ended yet) is TRL's own; it also fixes the
metadata the server is told, which the copy matches name for name.

The gather stays on the trainer's main thread: a collective on another thread could meet the main thread's
(ZeRO-3's own gathers in the next forward) in a different order on different ranks. The gather goes one parameter
at a time into rank 0's host memory, so the GPU never holds more than TRL's own push makes it hold. Cost: one
full copy of the weights in rank 0's host RAM from the step's end to the push (counted by ogrpo/planner/host_memory.py).
"""

from __future__ import annotations

from ogrpo.launch import run_state
from ogrpo.patches import trl_zero3_push


def why_not(trainer) -> str | None:
    """None when the single-gather push can be installed on `trainer`, else why not."""
    vg = getattr(trainer, "vllm_generation", None)
    if vg is None or getattr(vg, "mode", None) != "server":
        return "no vLLM server"
    if not trl_zero3_push.is_zero3(vg):
        return "not DeepSpeed ZeRO-3"
    if not trl_zero3_push.applies(vg):
        return "this TRL line's push has no per-parameter iterator to replace"
    if getattr(getattr(vg, "model", None), "peft_config", None) is not None:
        return "LoRA: TRL's merged push already gathers the whole model once"
    return None


def install(trainer) -> dict:
    """Wire the single gather onto `trainer` (built, overlap installed). Returns the counters the manifest gets
    at the end of training (`zero3_push`): parameter tensors, gathers of all of them, pushes served from those,
    and TRL's per-parameter gathers (one per tensor, in the first push only). The TRL side (the push's iterator
    and its gathers) is a library patch: ogrpo.patches.trl_zero3_push."""
    vg = trainer.vllm_generation
    stats = {"parameters": len(list(vg.model.parameters())), "full_gathers": 0, "pushes_from_gather": 0,
             "per_parameter_gathers": 0}
    kept: dict = {"version": None, "params": None}

    def snapshot():
        if kept["version"] != trainer.state.global_step:
            return None  # no gather for this step's weights: TRL's own push
        params, kept["params"], kept["version"] = kept["params"], None, None
        stats["pushes_from_gather"] += 1
        return params or []  # ranks other than 0 hold nothing and join no collective

    def on_gather():
        stats["per_parameter_gathers"] += 1

    gather = trl_zero3_push.install(vg, snapshot, on_gather)

    def gather_all(version: int) -> None:
        # One parameter at a time, each copied to rank 0's host memory: the GPU holds one gathered parameter at
        # once, as in TRL's own push, and never the whole model (ZeRO-3 was chosen because it does not fit).
        keep = trainer.accelerator.is_main_process
        params = [] if keep else None
        for name, p in vg.model.named_parameters():
            with gather(p):
                if keep:
                    params.append((trl_zero3_push.vllm_name(vg, name), p.data.detach().to("cpu", copy=True),
                                   p.data.device))
        kept.update(version=version, params=params)
        stats["full_gathers"] += 1

    trainer.add_callback(_callback(trainer, gather_all, stats))
    return stats


def _callback(trainer, gather_all, stats):
    from transformers import TrainerCallback

    class Zero3PushCallback(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            # the weights are final; the next step's push sends them (the last step pushes nothing)
            if state.global_step < state.max_steps and not control.should_training_stop:
                gather_all(state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            if trainer.accelerator.is_main_process:
                from pathlib import Path

                run_state.update_manifest(Path(args.output_dir), zero3_push=dict(stats))

    return Zero3PushCallback()
