"""The profiler's per-step busy spans of the split placement's device sets (ogrpo/profile/profiler.py), the
timeline picture drawn from them (ogrpo/profile/timeline.py), and the aggressive profile's overlap choice."""

from __future__ import annotations

import time

import pytest

from ogrpo.profile import timeline
from ogrpo.profile.profiler import LANES, StageProfiler, Timeline, lane_busy_share

S = 10**9


def _profiled_steps(n: int) -> list[dict]:
    """n steps of 10 s each whose spans are recorded as the hooks do: the server generates 0-4 s (the trainer
    waits on it for the first step only: later steps' batches came ahead), takes the weights 9-10 s; the trainer
    scores 4-5, computes rewards 4.5-6 (a thread, beside the scoring), trains 4-9 and pushes 9-10."""
    prof = StageProfiler(None, measure_steps=0)
    prof.timeline = tl = Timeline()
    rows = []
    base = time.time_ns() - n * 10 * S
    for step in range(n):
        t = base + step * 10 * S
        prof.step_start_ns = t
        tl.record("server", "generate", t, t + 4 * S)
        if step == 0:
            tl.record("trainer", "wait", t, t + 4 * S)
        prof._span("train", t + 4 * S, t + 9 * S)
        prof._span("logprobs", t + 4 * S, t + 5 * S)
        tl.record("trainer", "reward", t + int(4.5 * S), t + 6 * S)
        tl.record("trainer", "push", t + 9 * S, t + 10 * S)
        tl.record("server", "weights", t + 9 * S, t + 10 * S)
        row = tl.window(t, t + 10 * S, lanes=step < prof.timeline_steps)
        rows.append({"step": step + 1, **row})
    return rows


def test_rows_carry_each_sets_busy_spans_and_idle_shares_that_agree_with_them():
    rows = _profiled_steps(3)
    first = rows[0]
    assert set(first["lanes"]) == set(LANES)
    assert sorted({s[2] for s in first["lanes"]["trainer"]}) == ["push", "reward", "score", "train", "wait"]
    assert sorted({s[2] for s in first["lanes"]["server"]}) == ["generate", "weights"]
    assert first["idle_share"] == {"server": 0.5, "trainer": 0.4}
    assert rows[1]["idle_share"] == {"server": 0.5, "trainer": 0.0}  # the batch was there: no wait
    for r in rows:
        for lane in LANES:
            share = r["idle_share"][lane]
            assert 0.0 <= share <= 1.0
            assert share == pytest.approx(1 - lane_busy_share(lane, r["lanes"][lane], r["step_span_s"]), abs=1e-3)


def test_work_inside_a_wait_is_not_idle_time():
    """lossless: the main thread scores finished groups while it waits for the rest (0-4 s), scoring 1-2 s and
    a reward thread 1.5-3 s: the trainer idled 0-1 and 3-4 s, 2 s of the 10 s step."""
    tl = Timeline()
    tl.record("server", "generate", 0, 4 * S)
    tl.record("trainer", "wait", 0, 4 * S)
    tl.record("trainer", "score", 1 * S, 2 * S)
    tl.record("trainer", "reward", int(1.5 * S), 3 * S)
    tl.record("trainer", "train", 0, 10 * S)  # TRL's training_step holds the wait for generation too
    row = tl.window(0, 10 * S, lanes=True)
    assert row["trainer_wait_s"] == 2.0 and row["idle_share"]["trainer"] == 0.2
    assert 1 - lane_busy_share("trainer", row["lanes"]["trainer"], row["step_span_s"]) == pytest.approx(0.2)


def test_only_the_first_steps_carry_spans():
    prof_rows = _profiled_steps(2)
    assert all("lanes" in r for r in prof_rows)
    tl = Timeline()
    assert "lanes" not in tl.window(0, S) and "lanes" in tl.window(0, S, lanes=True)


def test_the_timeline_picture_has_one_lane_per_device_set(tmp_path):
    import matplotlib.image

    rows = _profiled_steps(3) + [{"step": 4, "idle_share": {"server": 0.5, "trainer": 0.0}}]  # a row without spans
    data = timeline.lanes(rows)
    assert sorted(data["lanes"]) == ["server", "trainer"]
    assert [s[0] for s in data["steps"]] == [1, 2, 3] and data["steps"][2][1] == pytest.approx(20.0, abs=1e-3)
    gens = sorted(x for a, b, stage in data["lanes"]["server"] if stage == "generate" for x in (a, b))
    assert gens == pytest.approx([0.0, 4.0, 10.0, 14.0, 20.0, 24.0], abs=1e-3)  # one axis across steps
    waits = [x for a, b, stage in data["lanes"]["trainer"] if stage == "wait" for x in (a, b)]
    assert waits == pytest.approx([0.0, 4.0], abs=1e-3) and data["lanes"]["trainer"][-1][2] == "wait"  # on top
    path = timeline.write(tmp_path, rows)
    assert path == tmp_path / "plots" / "timeline.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 500
    assert timeline.write(tmp_path / "none", [{"step": 1}]) is None  # no split placement: no picture


# ---- the aggressive profile ------------------------------------------------------------------------------------
def _plan(tmp_path, gpus, **ogrpo_opts):
    import yaml

    from ogrpo.config import load_run_config
    from ogrpo.plan import plan_from_config

    trl = ogrpo_opts.pop("trl", {})
    cfg = tmp_path / "r.yaml"
    cfg.write_text(yaml.safe_dump({"model_name_or_path": "ogrpo:tiny", "dataset_name": "ogrpo:tiny",
                                   "reward_funcs": ["tiny_letter"], **trl,
                                   "ogrpo": {"use_vllm": True, **ogrpo_opts}}))
    return plan_from_config(load_run_config(str(cfg)), gpus=gpus).to_dict()


def _setting(plan, name):
    return next((s for s in plan["settings"] if s["name"] == name), None)


def test_the_aggressive_profile_chooses_one_step_on_the_split_placement(tmp_path):
    plan = _plan(tmp_path, "3xcpu", profile="aggressive")
    assert _setting(plan, "overlap")["value"] == "one-step"
    change = next(c for c in plan["changes"] if c["key"] == "ogrpo.overlap")
    assert change["from"] == "lossless" and change["to"] == "one-step" and "aggressive profile" in change["reason"]
    assert plan["trainer_args"]["vllm_importance_sampling_correction"] is True
    assert "one step old" in _setting(plan, "vllm_importance_sampling_correction")["reason"]
    asked = _plan(tmp_path, "3xcpu", profile="aggressive", overlap="lossless")  # the recipe's word wins
    assert _setting(asked, "overlap")["value"] == "lossless"
    assert not any(c["key"] == "ogrpo.overlap" for c in asked["changes"])
    assert _setting(_plan(tmp_path, "3xcpu"), "overlap")["value"] == "lossless"  # balanced: unchanged


def test_the_aggressive_profile_uses_off_where_no_separate_server_exists(tmp_path):
    plan = _plan(tmp_path, "cpu", profile="aggressive")  # one device: generation inside the trainer
    assert _setting(plan, "overlap")["value"] == "off"
    assert "no separate server" in _setting(plan, "overlap")["reason"]
    assert not any(c["key"] == "ogrpo.overlap" for c in plan["changes"])  # not asked for, nothing changed
    plan = _plan(tmp_path, "3xcpu", profile="aggressive", trl={"num_iterations": 2})
    assert _setting(plan, "overlap")["value"] == "off" and "num_iterations=2" in _setting(plan, "overlap")["reason"]


def test_a_push_waiting_for_the_request_in_flight_is_trainer_idle_time():
    """one-step: the push first waits for the batch the server still generates; that wait is the trainer idling
    on the server (not push time), and the weights move only after it."""
    from types import SimpleNamespace

    from ogrpo.overlap.pipeline import ONE_STEP, Pipeline

    class Client:
        def generate(self, prompts, **sampling):
            time.sleep(0.5)
            return {"completion_ids": [[1]]}

        def update_named_params(self, metadata, params):
            pass

        def reset_prefix_cache(self):
            pass

    client, version = Client(), {"v": 0}
    pipe = Pipeline(ONE_STEP, lambda: version["v"])
    pipe.attach(client)

    def sync_weights():
        client.update_named_params(None, iter(()))
        client.reset_prefix_cache()

    trainer = SimpleNamespace(vllm_generation=SimpleNamespace(mode="server", vllm_client=client,
                                                              sync_weights=sync_weights), overlap_pipeline=pipe)
    prof = StageProfiler(None, measure_steps=0)
    prof._attach_timeline(trainer)
    start = time.time_ns()
    pipe.active = True
    pipe.stage([[2]])
    trainer.vllm_generation.sync_weights()
    client.generate(prompts=[[1]], n=1)  # b0 for real (0.5 s), then b1 sent ahead with version 0
    version["v"] = 1
    t_push = time.time_ns()
    trainer.vllm_generation.sync_weights()  # waits for b1 (about 0.5 s) before the weights move
    row = prof.timeline.window(start, time.time_ns(), lanes=True)
    waits = [(a, b) for a, b, stage in row["lanes"]["trainer"] if stage == "wait"]
    pushes = [(a, b) for a, b, stage in row["lanes"]["trainer"] if stage == "push"]
    drain = max(waits, key=lambda w: w[0])
    assert drain[0] >= (t_push - start) / 1e9 - 1e-3 and drain[1] - drain[0] > 0.3
    assert pushes[-1][0] >= drain[1] - 1e-3  # the push span starts when the wait ends
    assert row["idle_share"]["trainer"] > 0.5  # two 0.5 s waits in a ~1 s window
    assert row["idle_share"]["trainer"] == pytest.approx(
        1 - lane_busy_share("trainer", row["lanes"]["trainer"], row["step_span_s"]), abs=1e-3)
