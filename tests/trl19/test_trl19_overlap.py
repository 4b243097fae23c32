"""Server mode and ogrpo.overlap on the images' line (TRL 1.9.2 and `trl vllm-serve` on vLLM 0.19.1's CPU build,
ogrpo.serve.trl_serve_cpu; only TRL's NCCL weight-sync group is gloo here): the same jobs as tests/test_overlap.py,
each what `ogrpo submit --backend local` runs (plan, JobSpec, rendered files, local supervisor). Weights reach the
server every step: TRL's logged log-prob gap between server and trainer stays < 1e-4 in fp32 (without a push it
is ~0.3 after one step), and the server log shows one `/update_named_param/` per parameter per step. TRL 1.9 writes no completions table, so `lossless` is compared with `off` on what the
completions decide: each step's reward, completion lengths (mean, min, max) and loss. `trl vllm-serve` answers one
request at a time; O-GRPO's handler (ogrpo.serve.trl_stream) generates concurrent requests together, so `lossless`
asks for each batch group by group (ogrpo.serve.client.group_calls) here too, and works on each finished group
while the server generates the rest."""

from __future__ import annotations

import json

import pytest

from overlap_jobs import PACKED, metrics, requests, run_job

pytestmark = pytest.mark.integration

STEPS = 3
GROUPS = 16 // 4  # a rank's groups: per_device_train_batch_size / num_generations (overlap_jobs)
SAME = ("reward", "completions/mean_length", "completions/min_length", "completions/max_length")
GAP = "sampling/sampling_logp_difference/mean"


def assert_trl_vllm_serve_job(run, steps: int) -> None:
    """A server-mode job on `trl vllm-serve`: TRL's routes, the gloo group, every parameter pushed every step."""
    spec = json.loads((run.parent / "jobspec.json").read_text())
    assert [s["role"] for s in spec["steps"]] == ["server", "trainer"]
    assert spec["health_path"] == "/health/"  # TRL's route: the plan was rendered for the installed TRL 1.9
    rows = metrics(run)
    assert len(rows) == steps and max(r[GAP] for r in rows) < 1e-4, rows
    server_log = (run / "logs" / "server.log").read_text()
    assert "trl_serve_cpu" in server_log  # ogrpo serve chose TRL's server on CPU
    assert '"GET /get_world_size/ HTTP/1.1" 200' in server_log
    assert '"POST /init_communicator/ HTTP/1.1" 200' in server_log
    pushes = server_log.count('"POST /update_named_param/ HTTP/1.1" 200')
    resets = server_log.count('"POST /reset_prefix_cache/ HTTP/1.1" 200')
    assert resets >= steps and pushes >= resets * 10, (pushes, resets)  # every parameter, every step
    assert "Failed to load weights" not in server_log  # tied lm_head / rotary: expected, filtered (cpu_reload)
    assert "gloo group on port" in (run / "logs" / "trainer.log").read_text()
    assert '"1.9.2"' in json.dumps(json.loads((run / "manifest.json").read_text())), "TRL 1.9.2 not recorded"


def test_lossless_with_two_trainer_processes_gives_the_same_losses_as_off(tmp_path):
    """3xcpu: two DDP trainer processes; the main process hands each finished group to the rank that owns it.
    Both jobs are full server-mode jobs on `trl vllm-serve` (run_job asserts no process outlives them)."""
    # off runs TRL's own passes (padded, the old policy's separate); lossless packs them (ogrpo/trainer/packing.py)
    # and takes the old policy from the loss forward (ogrpo/trainer/old_policy.py)
    off_run = run_job(tmp_path / "off", "off", gpus="3xcpu", steps=STEPS,
                      ogrpo={"old_policy_pass": "separate", "padding_free": "off"})
    run = run_job(tmp_path / "lossless", "lossless", gpus="3xcpu", steps=STEPS)
    for job in (off_run, run):
        assert_trl_vllm_serve_job(job, STEPS)
    ours, theirs = metrics(run), metrics(off_run)
    assert len(ours) == len(theirs) == STEPS
    for x, y in zip(ours, theirs):
        for key in SAME:
            assert x[key] == pytest.approx(y[key], abs=1e-6), (x["step"], key, x[key], y[key])
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5), (x["step"], x["loss"], y["loss"])
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5), (x["step"], x["grad_norm"], y["grad_norm"])
        assert x["overlap/staleness"] == 0.0
        # every rank's groups streamed: work on one began while the server still generated another, and TRL took
        # the groups' rewards and reference pass (beta > 0); the old policy's came from the loss forward, and
        # TRL's importance-sampling statistics from it are those of TRL's own pass
        assert 1 <= x["overlap/groups_early"] <= GROUPS - 1
        assert x["overlap/streamed_rewards"] == 1.0 and x["overlap/streamed_passes"] == 1.0
        # each rank trained its groups' loss as they arrived (ogrpo/overlap/train_ahead.py), on TRL 1.9.2's loss
        assert x["overlap/trained_ahead"] == GROUPS and x["overlap/trained_early"] >= 1, x
        sampling = [k for k in y if k.startswith("sampling/")]
        assert len(sampling) == 5, y
        for key in sampling:
            assert x[key] == pytest.approx(y[key], **PACKED), (x["step"], key, x[key], y[key])
    assert any(y["completions/min_length"] < y["completions/max_length"] for y in theirs)  # lengths vary
    ours, theirs = (json.loads((r / "manifest.json").read_text()) for r in (run, off_run))
    assert (theirs["old_policy_pass"]["pass"], ours["old_policy_pass"]["pass"]) == ("separate", "from_loss")
    assert theirs["padding_free"]["on"] is False and ours["padding_free"]["on"] is True, ours["padding_free"]
    early = ours["train_ahead"].pop("early_backward")  # whole groups come back: none to run ahead of
    assert early["on"] is False and "whole groups" in early["reason"], early
    assert ours["train_ahead"] == {"on": True, "reason": None, "fallbacks": []}
    # one request per group, each answered as it finished, nothing requested that was not trained on
    assert requests(off_run) == STEPS and requests(run) == STEPS * 2 * GROUPS


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
