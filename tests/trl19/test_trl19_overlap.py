"""ogrpo.overlap on the images' line (TRL 1.9.2 and `trl vllm-serve` on vLLM 0.19.1's CPU build): the same jobs as
tests/test_overlap.py. TRL 1.9 writes no completions table, so `lossless` is compared with `off` on what the
completions decide: each step's reward, completion lengths (mean, min, max) and loss. `trl vllm-serve` answers one
request at a time, so on this line a batch is not split into per-group requests (ogrpo.serve.client.group_calls):
the rewards run beside the whole batch's log-prob passes, and the plan says so (`overlap.stream`)."""

from __future__ import annotations

import pytest

from overlap_jobs import metrics, requests, run_job

pytestmark = pytest.mark.integration

STEPS = 3
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
        assert "overlap/groups_early" not in x  # whole requests: nothing streamed
    assert any(y["completions/min_length"] < y["completions/max_length"] for y in theirs)  # lengths vary
    assert requests(run) == requests(off_run) == STEPS


def test_one_step_samples_are_at_most_one_version_old(tmp_path):
    run = run_job(tmp_path, "one-step", steps=STEPS)
    rows = metrics(run)
    assert [r["overlap/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["overlap/sampled_version"] for r in rows] == [0.0, 0.0, 1.0]
    assert all(r["overlap/importance_ratio/min"] <= r["overlap/importance_ratio/max"] for r in rows)
    assert requests(run) == STEPS


def test_plan_says_lossless_takes_whole_batches_on_this_line(tmp_path):
    from test_overlap import _plan, _setting

    stream = _setting(_plan(tmp_path, "2xcpu"), "overlap.stream")
    assert stream["value"] == "batch" and "one request at a time" in stream["reason"]
