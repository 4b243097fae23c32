"""The embedded default learns: a seeded 30-step CPU run raises the mean reward by a clear margin."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_tiny_reward_curve_rises(tmp_path):
    from ogrpo.trainer.assembly import train

    out = train("tiny", output_dir=tmp_path / "run", overrides={"save_strategy": "no"})
    rewards = [m["reward"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
               if "reward" in m]
    assert len(rewards) == 30
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # The base model follows the prompt about 40% of the time (ogrpo/tiny.py); measured on 2 cores: first five
    # steps ~0.5, last five ~0.9. A margin of 0.2 leaves room for sampling noise across platforms.
    assert last > first + 0.2, (first, last, rewards)
    assert last > 0.75, rewards
