"""ogrpo.overlap on the images' line (TRL 1.9.2 and `trl vllm-serve` on vLLM 0.19.1's CPU build): the same jobs as
tests/test_overlap.py. TRL 1.9 writes no completions table, so `lossless` is compared with `off` on what the
completions decide: each step's reward, completion lengths (mean, min, max) and loss. `trl vllm-serve` answers one
request at a time; O-GRPO's handler (ogrpo.serve.trl_stream) generates concurrent requests together, so `lossless`
asks for each batch group by group (ogrpo.serve.client.group_calls) here too, and works on each finished group
while the server generates the rest."""

from __future__ import annotations

import pytest

from overlap_jobs import metrics, requests, run_job

pytestmark = pytest.mark.integration

STEPS = 3
GROUPS = 16 // 4  # per_device_train_batch_size / num_generations (overlap_jobs)
SAME = ("reward", "completions/mean_length", "completions/min_length", "completions/max_length")


@pytest.fixture(scope="module")
def off_run(tmp_path_factory):
    return run_job(tmp_path_factory.mktemp("off"), "off", steps=STEPS)


def test_lossless_gives_the_same_losses_as_off(off_run, tmp_path):
    run = run_job(tmp_path, "lossless", steps=STEPS)
    ours, theirs = metrics(run), metrics(off_run)
    assert len(ours) == len(theirs) == STEPS
    for x, y in zip(ours, theirs):
        for key in SAME:
            assert x[key] == pytest.approx(y[key], abs=1e-6), (x["step"], key, x[key], y[key])
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5), (x["step"], x["loss"], y["loss"])
        assert x["overlap/staleness"] == 0.0
        # the groups streamed: work on one began while the server still generated another, and TRL took the
        # groups' rewards and both passes (reference: beta > 0; old policy: the vLLM correction)
        assert 1 <= x["overlap/groups_early"] <= GROUPS - 1
        assert x["overlap/streamed_rewards"] == 1.0 and x["overlap/streamed_passes"] == 2.0
    assert any(y["completions/min_length"] < y["completions/max_length"] for y in theirs)  # lengths vary
    # one request per group, each answered as it finished, nothing requested that was not trained on
    assert requests(off_run) == STEPS and requests(run) == STEPS * GROUPS


def test_one_step_samples_are_at_most_one_version_old(tmp_path):
    run = run_job(tmp_path, "one-step", steps=STEPS)
    rows = metrics(run)
    assert [r["overlap/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["overlap/sampled_version"] for r in rows] == [0.0, 0.0, 1.0]
    assert all(r["overlap/importance_ratio/min"] <= r["overlap/importance_ratio/max"] for r in rows)
    assert requests(run) == STEPS


def test_plan_says_lossless_streams_groups_on_this_line_with_one_engine(tmp_path):
    from test_overlap import _plan, _setting

    stream = _setting(_plan(tmp_path, "2xcpu"), "overlap.stream")
    assert stream["value"] == "groups" and "O-GRPO's handler" in stream["reason"]
    two = _setting(_plan(tmp_path, "3xcpu"), "overlap.stream")  # two trainer processes: each takes its groups
    assert two["value"] == "groups" and "2 trainer processes" in two["reason"]
