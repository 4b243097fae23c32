"""Exact checkpoint/resume for `ogrpo.overlap: one-step` (ogrpo/train/overlap.py).

At checkpoint-N the one-step pipeline holds the batch that step N+1 trains on, generated with policy version N-1
(the weights before the last update), while the checkpoint holds version N. Regenerating that batch from the
checkpoint would give other completions (staleness 0, not 1) than the uninterrupted run trained on. So the
request in flight is written into the checkpoint, beside the RNG states: its prompts, sampling parameters, the
version that generated it and the server's answer. A resumed run queues it as the pipeline's first ticket; the
push of version N then sends the next batch ahead exactly as the uninterrupted run did, and the batch stream,
the staleness and the losses are those of a run that was never stopped.

`lossless` needs nothing: its request in flight at a checkpoint was sent with the checkpoint's own weights, so
the resumed run regenerates the same batch (given a seeded sampler).

The hooks are the Trainer's own per-checkpoint calls on the one trainer instance: `_save_rng_state(output_dir)`
(every rank, inside the checkpoint being written: within ogrpo.train.preemption's staging directory, so the file
is renamed into place with the rest) and `_load_rng_state(checkpoint)` (every rank, when training resumes).
JSON, not pickle: a checkpoint directory is data, never code.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path

FILE = "ogrpo_overlap_inflight.json"
FORMAT = 1


def install(trainer) -> None:
    """Wire the save/restore of the request in flight onto `trainer` (after trl_overlap.install)."""
    state = getattr(trainer, "_ogrpo_overlap", None)
    if state is None:
        return
    from ogrpo.patches.trl_trainer_wraps import wrap

    def saving(save_rng):
        def _save_rng_state(output_dir, *args, **kwargs):
            out = save_rng(output_dir, *args, **kwargs)
            if state.pipeline is not None:
                save(state.pipeline, Path(output_dir), trainer.state.global_step)
            return out
        return _save_rng_state

    def loading(load_rng):
        def _load_rng_state(checkpoint, *args, **kwargs):
            out = load_rng(checkpoint, *args, **kwargs)
            if checkpoint is not None and state.pipeline is not None:
                restore(state.pipeline, Path(checkpoint))
            return out
        return _load_rng_state

    wrap(trainer, "_save_rng_state", "overlap_resume", saving)
    wrap(trainer, "_load_rng_state", "overlap_resume", loading)


def save(pipeline, checkpoint: Path, global_step: int) -> dict | None:
    """Write the pipeline's queued request (waiting for it: a checkpoint holds the answer, not a promise) into
    `checkpoint`; returns what was written, None when nothing is queued (the first or the last step)."""
    if not pipeline.tickets:
        return None
    if len(pipeline.tickets) > 1:  # one-step keeps one request ahead: more would be a broken invariant
        from ogrpo.train.overlap import OverlapError

        raise OverlapError(f"overlap: {len(pipeline.tickets)} requests queued at a checkpoint (one expected)")
    ticket = pipeline.tickets[0]
    record = {"format": FORMAT, "global_step": global_step, "version": ticket.version, "prompts": ticket.prompts,
              "sampling": ticket.sampling, "result": ticket.future.result()}
    # an answer that JSON cannot hold exactly (tuples where TRL compares lists) would fail the prompt check on
    # resume; say so here, at the save, not one step after a preemption
    if json.loads(json.dumps([ticket.prompts, ticket.sampling])) != [ticket.prompts, ticket.sampling]:
        raise TypeError("overlap: the request in flight does not survive JSON exactly; cannot checkpoint it")
    checkpoint.mkdir(parents=True, exist_ok=True)
    tmp = checkpoint / (FILE + ".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(checkpoint / FILE)
    return record


def restore(pipeline, checkpoint: Path) -> bool:
    """Queue the checkpoint's saved request as the pipeline's first ticket; False when the checkpoint has none."""
    path = checkpoint / FILE
    if not path.is_file():
        return False
    from ogrpo.train.overlap import Ticket

    record = json.loads(path.read_text())
    if record.get("format") != FORMAT:
        from ogrpo.errors import OgrpoError

        raise OgrpoError(f"{path}: format {record.get('format')!r}, this O-GRPO reads format {FORMAT}")
    future: Future = Future()
    future.set_result(record["result"])
    pipeline.tickets.clear()
    pipeline.tickets.append(Ticket(record["prompts"], record["sampling"], record["version"], future))
    pipeline.sampling = dict(record["sampling"])  # the pipeline sends the next request with the same parameters
    return True
