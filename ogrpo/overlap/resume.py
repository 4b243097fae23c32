"""Exact checkpoint/resume for `ogrpo.overlap: one-step` (ogrpo/overlap/pipeline.py).

At checkpoint-N the one-step pipeline holds the batch that step N+1 trains on, generated with policy version N-1
(the weights before the last update), while the checkpoint holds version N. Regenerating that batch from the
checkpoint would give other completions (staleness 0, not 1) than the uninterrupted run trained on. So the
request in flight is written into the checkpoint, beside the RNG states: its prompts, sampling parameters, the
version that generated it and the server's answer. A resumed run queues it as the pipeline's first ticket; the
push of version N then sends the next batch ahead exactly as the uninterrupted run did, and the batch stream,
the staleness and the losses are those of a run that was never stopped.

`lossless` needs no saved batch: its request in flight at a checkpoint was sent with the checkpoint's own weights,
so the resumed run regenerates the same batch, given the same sampling seed.

The seeds: every server-mode request carries a seed drawn from the run's seed and a per-call counter
(ogrpo.serve.client.SeededGenerate). The counter lives in the trainer's process, so a resumed process would count
from 0 again and sample other completions from the checkpoint on, in every overlap mode. It is saved with the
checkpoint (SEED_FILE) and restored: at the value that draws, next, the seed the uninterrupted run drew next. That
is the counter itself where nothing is in flight (`off`) or what is in flight is saved (`one-step`), and the
counter a `lossless` request in flight took its seed at (it is sent again on resume).

The hooks are the Trainer's own per-checkpoint calls, overridden by StreamCheckpoints: `_save_rng_state(output_dir)`
(every rank, inside the checkpoint being written: within ogrpo.trainer.preemption's staging directory, so the file
is renamed into place with the rest) and `_load_rng_state(checkpoint)` (every rank, when training resumes).
JSON, not pickle: a checkpoint directory is data, never code.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from pathlib import Path

from ogrpo.errors import OgrpoError
from ogrpo.overlap.pipeline import ONE_STEP, OverlapError, Ticket

FILE = "ogrpo_overlap_inflight.json"
FORMAT = 1
SEED_FILE = "ogrpo_generation_seed.json"


def generation_client(trainer):
    """The main process's VLLMClient in server mode (TRL 1.16: trainer.vllm_generation.vllm_client; earlier lines:
    trainer.vllm_client), else None."""
    gen = getattr(trainer, "vllm_generation", None)
    return getattr(gen, "vllm_client", None) or getattr(trainer, "vllm_client", None)


class StreamCheckpoints:
    """The layer of OgrpoGRPOTrainer that puts the generation stream's state into each checkpoint, beside the
    Trainer's RNG states, and restores it on resume: one-step's request in flight, the client's seed counter."""

    def _stream_pipeline(self):
        state = getattr(self, "overlap", None)  # the overlap layer's state (ogrpo.overlap.steps), when on
        return state.pipeline if state is not None else None

    def _stream_client(self):
        found = generation_client(self)
        return found if isinstance(getattr(found, "_generation_calls", None), int) else None

    def _one_step_pipeline(self):
        pipe = self._stream_pipeline()
        return pipe if pipe is not None and pipe.mode == ONE_STEP else None

    def _save_rng_state(self, output_dir, *args, **kwargs):
        out = super()._save_rng_state(output_dir, *args, **kwargs)
        pipe = self._stream_pipeline()
        if self._one_step_pipeline() is not None:
            save(pipe, Path(output_dir), self.state.global_step)
        if self._stream_client() is not None:
            save_seed_counter(self._stream_client(), pipe, Path(output_dir))
        return out

    def _load_rng_state(self, checkpoint, *args, **kwargs):
        out = super()._load_rng_state(checkpoint, *args, **kwargs)
        if checkpoint is not None and self._one_step_pipeline() is not None:
            restore(self._one_step_pipeline(), Path(checkpoint))
        if checkpoint is not None and self._stream_client() is not None:
            restore_seed_counter(self._stream_client(), Path(checkpoint))
        return out


def save(pipeline, checkpoint: Path, global_step: int) -> dict | None:
    """Write the pipeline's queued request (waiting for it: a checkpoint holds the answer, not a promise) into
    `checkpoint`; returns what was written, None when nothing is queued (the first or the last step)."""
    if not pipeline.tickets:
        return None
    if len(pipeline.tickets) > 1:  # one-step keeps one request ahead: more would be a broken invariant

        raise OverlapError(f"overlap: {len(pipeline.tickets)} requests queued at a checkpoint (one expected)")
    ticket = pipeline.tickets[0]
    record = {"format": FORMAT, "global_step": global_step, "version": ticket.version, "prompts": ticket.prompts,
              "sampling": ticket.sampling, "result": ticket.future.result()}
    # an answer that JSON cannot hold exactly (tuples where TRL compares lists) would fail the prompt check on
    # resume; say so here, at the save, not one step after a preemption
    if json.loads(json.dumps([ticket.prompts, ticket.sampling])) != [ticket.prompts, ticket.sampling]:
        raise TypeError("overlap: the request in flight does not survive JSON exactly; cannot checkpoint it")
    return _write(checkpoint, FILE, record)


def restore(pipeline, checkpoint: Path) -> bool:
    """Queue the checkpoint's saved request as the pipeline's first ticket; False when the checkpoint has none."""
    record = _read(checkpoint / FILE)
    if record is None:
        return False

    future: Future = Future()
    future.set_result(record["result"])
    pipeline.tickets.clear()
    pipeline.tickets.append(Ticket(record["prompts"], record["sampling"], record["version"], future))
    pipeline.sampling = dict(record["sampling"])  # the pipeline sends the next request with the same parameters
    return True


def seed_counter_to_save(client, pipeline) -> int:
    """The client's seed counter as a resumed run must start it: where the oldest request in flight that the
    checkpoint does not keep (lossless) took its seed, else the counter itself."""
    if pipeline is not None and pipeline.mode != ONE_STEP:
        taken = [t.calls for t in list(pipeline.tickets) if t.calls is not None]
        if taken:
            return min(taken)
    return int(client._generation_calls)


def save_seed_counter(client, pipeline, checkpoint: Path) -> dict:
    record = {"format": FORMAT, "run_seed": client.run_seed, "generation_calls": seed_counter_to_save(client,
                                                                                                    pipeline)}
    return _write(checkpoint, SEED_FILE, record)


def restore_seed_counter(client, checkpoint: Path) -> bool:
    """Set the client's seed counter from the checkpoint; False when it has none (an older checkpoint)."""
    record = _read(checkpoint / SEED_FILE)
    if record is not None:
        client._generation_calls = int(record["generation_calls"])
    return record is not None


def _write(checkpoint: Path, name: str, record: dict) -> dict:
    """Atomically: a checkpoint saved while a preemption lands must hold the whole record or none."""
    checkpoint.mkdir(parents=True, exist_ok=True)
    tmp = checkpoint / (name + ".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(checkpoint / name)
    return record


def _read(path: Path) -> dict | None:
    """The record at `path`; None when the checkpoint has none (nothing in flight, or an older checkpoint)."""
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if record.get("format") != FORMAT:
        raise OgrpoError(f"{path}: format {record.get('format')!r}, this O-GRPO reads format {FORMAT}")
    return record
