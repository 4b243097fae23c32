"""Stage accounting of the profiler on a stand-in trainer with a scripted clock (exact numbers, no timing)."""

from __future__ import annotations

import json

import pytest

from ogrpo.profile import profiler as prof_mod
from ogrpo.profile.hooks import profiled
from ogrpo.profile.profiler import StageProfiler, render_table, summarize


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def tick(self, s):
        self.t += s


class FakeTrainer:
    """The GRPOTrainer methods the profiler hooks, each advancing the clock by a known amount."""

    def __init__(self, clock):
        self.clock = clock
        self.callbacks = []

    def add_callback(self, cb):
        self.callbacks.append(cb)

    def _generate(self, prompts):
        self.clock.tick(2.0)
        return ([[1]] * 2, [[5, 6, 7], [8, 9]], None)

    def _calculate_rewards(self, *a):
        self.clock.tick(0.5)

    def _get_per_token_logps_and_entropies(self, *a, **kw):
        self.clock.tick(0.25)

    # the two completions above, left-padded prompts of 1 and 2 tokens, completions of 3 and 2 padded to 3: the
    # (2, 5) mask keeps 1 + 3 + 2 + 2 = 8 of 10 positions
    MASK = [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]

    def _generate_and_score_completions(self, batch):
        import torch

        self.clock.tick(0.1)  # padding etc.
        self._generate(batch)
        mask = torch.tensor(self.MASK)
        self._get_per_token_logps_and_entropies(None, mask, mask, 3)  # reference model
        self._calculate_rewards()

    def training_step(self, model, inputs, n):
        import torch

        self._generate_and_score_completions(inputs)
        mask = torch.tensor(self.MASK)
        # policy forward inside the loss: "train"; TRL passes its mask as a keyword on some paths
        self._get_per_token_logps_and_entropies(None, mask, attention_mask=mask[:1], logits_to_keep=3)
        self.clock.tick(1.0)  # backward


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(prof_mod.time, "perf_counter", c)
    return c


def test_stages_are_attributed_exactly(clock, tmp_path):
    trainer = profiled(FakeTrainer)(clock)  # the profiler's layers over the stand-in, as over TRL's trainer
    p = StageProfiler(tmp_path / "profile.jsonl").attach(trainer)
    assert len(trainer.callbacks) == 1
    cb = trainer.callbacks[0]
    for step in (1, 2):
        cb.on_step_begin(None, None, None)
        clock.tick(0.05)  # loop bookkeeping before training_step: "other"
        trainer.training_step(None, None, None)
        clock.tick(0.3)  # clip + optimizer step
        state = type("S", (), {"global_step": step, "is_world_process_zero": True})()
        cb.on_step_end(None, state, None)
    assert p._tensor_peak.running  # two steps of the three it measures
    cb.on_train_end(None, state, None)
    assert not p._tensor_peak.running  # a short run stops the profiler with training, not at teardown
    rows = [json.loads(x) for x in (tmp_path / "profile.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    r = rows[0]
    assert r["generation_s"] == pytest.approx(2.0)
    assert r["reward_s"] == pytest.approx(0.5)
    assert r["logprobs_s"] == pytest.approx(0.25) and r["logprob_passes"] == 1  # the reference pass only
    assert r["train_s"] == pytest.approx(0.25 + 1.0 + 0.3)  # policy forward + backward + optimizer
    assert r["other_s"] == pytest.approx(0.1 + 0.05)
    assert r["step_s"] == pytest.approx(4.45)
    assert r["completion_tokens"] == 5 and r["gen_tokens_per_s"] == pytest.approx(2.5)
    assert r["peak_mem_gib"] > 0 and r["device"] == "cpu"
    # each kind of pass: the positions it computed and those its mask kept, per step
    assert r["pass_tokens"] == {"score": 10, "loss": 5} and r["pass_real_tokens"] == {"score": 8, "loss": 4}
    assert r["pad_share"] == {"score": pytest.approx(0.2), "loss": pytest.approx(0.2)}
    assert rows[1]["pass_tokens"] == r["pass_tokens"]  # counted per step, not accumulated across steps
    s = summarize(rows)
    assert s["steps"] == 2 and s["stages"]["generation"]["share"] == pytest.approx(2.0 / 4.45)
    assert s["pad_share"] == {"score": pytest.approx(0.2), "loss": pytest.approx(0.2)}


def test_table_renders_every_stage(clock, tmp_path):
    from rich.console import Console

    rows = [{"step": 1, "generation_s": 1.0, "reward_s": 0.1, "logprobs_s": 0.2, "train_s": 0.5, "other_s": 0.0,
             "step_s": 1.8, "completion_tokens": 100, "peak_mem_gib": 0.5, "device": "cpu",
             "pass_tokens": {"score": 400, "loss": 200}, "pass_real_tokens": {"score": 100, "loss": 150}}]
    console = Console(record=True, width=100)
    render_table(rows, console)
    text = console.export_text()
    for stage in ("generation", "reward", "logprobs", "train", "other"):
        assert stage in text
    assert "100 completion tok/s" in text and "peak RSS 0.50 GiB" in text
    assert "padding computed (pad_share): scoring passes 75.0% · loss forward 25.0%" in text
