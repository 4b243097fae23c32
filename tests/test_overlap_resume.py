"""ogrpo.overlap one-step: the batch in flight at a checkpoint is saved with it and handed back on resume
(ogrpo/overlap/resume.py), so a resumed run trains on the batch the uninterrupted run trained on, one
policy version old, instead of regenerating it with the checkpoint's weights. The same through Slurm requeue,
with a real server and trainer: tests/slurm/test_slurm_overlap.py."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest

from ogrpo.overlap import pipeline as overlap
from ogrpo.overlap import resume as overlap_resume
from ogrpo.overlap.pipeline import ONE_STEP, Pipeline


class Server:
    """generate answers with the weights it holds; a push during a generation is an error."""

    def __init__(self, weights=None):
        self.weights, self.pending, self.busy, self.calls = weights, None, False, []
        self._lock = threading.Lock()

    def generate(self, prompts, **sampling):
        with self._lock:
            self.busy = True
            self.calls.append((prompts, self.weights))
        time.sleep(0.05)
        self.busy = False
        return {"completion_ids": [[p[0] * 10 + self.weights] for p in prompts], "logprobs": [[-0.5]]}

    def update_named_params(self, metadata, named_params):
        assert not self.busy
        self.pending = metadata

    def reset_prefix_cache(self):
        self.weights = self.pending


def _step(client, pipe, step, prompts, nxt):
    """What trl_overlap does in one training generation: stage the next batch, push this step's weights, ask."""
    pipe.stage(nxt)
    client.update_named_params(step, iter(()))
    client.reset_prefix_cache()
    pipe.active = True
    out = client.generate(prompts=prompts, n=2, max_tokens=4, generation_kwargs={"seed": 7})
    pipe.active = False
    return out, overlap.check_staleness(ONE_STEP, step, pipe.consumed_version)


def _run(pipe_steps, start=0, stop=None, restore_from=None):
    """Steps start..stop-1 of a one-step run of `pipe_steps` steps over batches [[i]] (a fresh server: it holds
    only what is pushed); returns (outputs, staleness, pipeline)."""
    v = {"step": start}
    client = Server()
    pipe = Pipeline(ONE_STEP, lambda: v["step"])
    pipe.attach(client)
    if restore_from is not None:
        assert overlap_resume.restore(pipe, restore_from)
    outs, stale = [], []
    for step in range(start, pipe_steps if stop is None else stop):
        v["step"] = step
        out, s = _step(client, pipe, step, [[step]], [[step + 1]] if step + 1 < pipe_steps else None)
        outs.append(out)
        stale.append(s)
    return outs, stale, pipe


def test_a_resumed_one_step_run_trains_on_the_saved_batch_in_flight(tmp_path):
    full, full_stale, _ = _run(4)
    assert full_stale == [0, 1, 1, 1]
    # the run stopped after step 1: checkpoint-2 holds the weights of version 2 and the batch of step 2 in flight
    _, _, pipe = _run(4, stop=2)  # stopped after step 1: batch 2 was sent with version 1
    ckpt = tmp_path / "checkpoint-2"
    record = overlap_resume.save(pipe, ckpt, 2)
    assert record["version"] == 1 and record["prompts"] == [[2]]
    saved = json.loads((ckpt / overlap_resume.FILE).read_text())
    assert saved["result"] == full[2]  # the answer, not a promise: the request was waited for
    resumed, stale, pipe2 = _run(4, start=2, restore_from=ckpt)
    assert resumed == full[2:] and stale == full_stale[2:]  # the same stream, one version old as before
    assert pipe2.sent == 1  # batch 3 went out once the server had version 2, as in the uninterrupted run
    # without the saved batch, the resumed run regenerates it with the checkpoint's weights: another batch
    fresh, fresh_stale, _ = _run(4, start=2)
    assert fresh[0] != full[2] and fresh_stale[0] == 0


def test_nothing_is_saved_without_a_request_in_flight_and_a_stale_format_is_refused(tmp_path):
    from ogrpo.errors import OgrpoError

    pipe = Pipeline(ONE_STEP, lambda: 0)
    assert overlap_resume.save(pipe, tmp_path / "c", 3) is None and not (tmp_path / "c").exists()
    assert overlap_resume.restore(pipe, tmp_path / "c") is False and not pipe.tickets
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / overlap_resume.FILE).write_text(json.dumps({"format": 99}))
    with pytest.raises(OgrpoError, match="format 99"):
        overlap_resume.restore(pipe, tmp_path / "c")


def _trainer(calls, **attrs):
    """A stand-in for OgrpoGRPOTrainer: the generation stream's checkpoint layer over the Trainer's own RNG
    save/load (recorded in `calls`)."""

    class Trainer:
        def _save_rng_state(self, output_dir):
            if calls is not None:
                calls.append(("save", output_dir))

        def _load_rng_state(self, checkpoint):
            if calls is not None:
                calls.append(("load", checkpoint))

    class Layered(overlap_resume.StreamCheckpoints, Trainer):
        pass

    trainer = Layered()
    vars(trainer).update(attrs)
    return trainer


def test_the_trainer_hooks_save_into_the_checkpoint_and_restore_from_it(tmp_path):
    _, _, pipe = _run(4, stop=2)
    calls = []
    trainer = _trainer(calls, state=SimpleNamespace(global_step=2), overlap=SimpleNamespace(pipeline=pipe))
    trainer._save_rng_state(str(tmp_path / "checkpoint-2"))
    assert (tmp_path / "checkpoint-2" / overlap_resume.FILE).is_file()
    fresh = Pipeline(ONE_STEP, lambda: 2)
    trainer.overlap.pipeline = fresh
    trainer._load_rng_state(str(tmp_path / "checkpoint-2"))
    assert [c[0] for c in calls] == ["save", "load"]  # the Trainer's own states still saved and loaded
    assert len(fresh.tickets) == 1 and fresh.tickets[0].version == 1 and fresh.sampling["n"] == 2


class SeededServer(Server):
    """The fake server behind O-GRPO's seeding client: each answer also depends on the request's seed."""

    def generate(self, prompts, **sampling):
        out = super().generate(prompts, **sampling)
        seed = (sampling.get("generation_kwargs") or {}).get("seed")
        return {**out, "completion_ids": [c + [seed] for c in out["completion_ids"]]}


def _seeded_client():
    from ogrpo.serve.client import SeededGenerate

    class Client(SeededGenerate, SeededServer):
        run_seed = 42

    return Client(weights=0)


def _drive(mode, steps, start=0, stop=None, checkpoint=None, tmp=None):
    """Steps start..stop-1 of a `mode` run of `steps` steps over batches [[i]], in the order the trainer drives
    the client (off: a request per step; lossless: the next request goes out at the step's end, with the new
    weights; one-step: as `_step`). Resumes from `checkpoint` through the Trainer's hooks (overlap_resume.StreamCheckpoints)
    and, when `tmp` is given, writes checkpoint-<stop> there at the end. Returns (outputs, client)."""
    v = {"step": start}
    client = _seeded_client()
    pipe = None
    if mode != overlap.OFF:
        pipe = Pipeline(mode, lambda: v["step"])
        pipe.attach(client)
    trainer = _trainer(None, state=SimpleNamespace(global_step=start),
                       vllm_generation=SimpleNamespace(vllm_client=client),
                       overlap=SimpleNamespace(pipeline=pipe) if pipe else None)
    if checkpoint is not None:
        trainer._load_rng_state(str(checkpoint))
    outs = []
    stop = steps if stop is None else stop
    for step in range(start, stop):
        v["step"] = step
        if mode == ONE_STEP:  # as `_step`, unseeded: the client seeds each call
            pipe.stage([[step + 1]] if step + 1 < steps else None)
            client.update_named_params(step, iter(()))
            client.reset_prefix_cache()
            pipe.active = True
            outs.append(client.generate(prompts=[[step]], n=2, max_tokens=4))
            pipe.active = False
            continue
        if client.weights != step:  # TRL pushes before it generates when the server is behind (off; a resume)
            client.update_named_params(step, iter(()))
            client.reset_prefix_cache()
        if pipe is not None:
            pipe.active = True
        outs.append(client.generate(prompts=[[step]], n=2, max_tokens=4))
        if pipe is not None:
            pipe.active = False
            if step + 1 < steps:  # lossless: the optimizer stepped; push, and the next batch goes out at once
                v["step"] = step + 1
                pipe.stage([[step + 1]])
                client.update_named_params(step + 1, iter(()))
                client.reset_prefix_cache()
    if tmp is not None:
        trainer.state.global_step = stop
        ckpt = tmp / f"checkpoint-{stop}"
        trainer._save_rng_state(str(ckpt))
        if pipe is not None:
            pipe.close()
        return outs, client, ckpt
    return outs, client


@pytest.mark.parametrize("mode", [overlap.OFF, overlap.LOSSLESS, ONE_STEP])
def test_a_resumed_server_mode_run_samples_with_the_seeds_of_the_uninterrupted_one(tmp_path, mode):
    """Each server request is seeded from the run's seed and a per-call counter that lives in the trainer's
    process: a resumed process counted from 0 again and sampled other completions from the checkpoint on. The
    counter travels with the checkpoint (at the request a lossless checkpoint does not keep), so the stream of
    (prompt, weights, seed) is the uninterrupted run's step by step, in every overlap mode."""
    full, _ = _drive(mode, 5)
    seeds = [out["completion_ids"][0][-1] for out in full]
    assert len(set(seeds)) == 5  # a new seed per call: what must continue, not restart
    first, _, ckpt = _drive(mode, 5, stop=2, tmp=tmp_path)
    assert first == full[:2]
    saved = json.loads((ckpt / overlap_resume.SEED_FILE).read_text())
    # lossless: the request in flight (step 3's) took call index 2 and is not kept: it is sent again on resume
    assert saved["generation_calls"] == {overlap.OFF: 2, overlap.LOSSLESS: 2, ONE_STEP: 3}[mode]
    resumed, client = _drive(mode, 5, start=2, checkpoint=ckpt)
    assert resumed == full[2:]  # the same completions, seeds included, step by step
