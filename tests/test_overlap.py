"""ogrpo.overlap: the pipeline's invariants (ogrpo/overlap/pipeline.py), the plan's choice, the profiler's idle shares,
and real server-mode jobs on the split placement (`ogrpo serve` + `ogrpo train` under the local supervisor):
`lossless` gives the same completions and losses as `off`; `one-step` trains each batch at most one policy version
after the one that sampled it, logs it, and sees the same batch stream; both with LoRA too (the merged push)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from ogrpo.planner.types import Plan
from ogrpo.overlap import pipeline as overlap
from ogrpo.overlap.pipeline import LOSSLESS, ONE_STEP, Lookahead, OverlapError, Pipeline


# ---- Lookahead ------------------------------------------------------------------------------------------------
def test_lookahead_hands_back_every_batch_in_order():
    from torch.utils.data import DataLoader

    loader = DataLoader(list(range(10)), batch_size=2)
    la = Lookahead()
    it = iter(loader)
    got = la.take(it, 2)
    assert la.peek().tolist() == [4, 5]  # the next step's first batch, not taken
    assert la.peek().tolist() == [4, 5]  # peeking twice reads nothing more
    got += la.take(it, 2) + la.take(it, 5)  # the last step is short, as at an epoch's end
    assert [b.tolist() for b in got] == [b.tolist() for b in DataLoader(list(range(10)), batch_size=2)]
    assert la.peek() is None  # the epoch is over: nothing is read across epochs
    it2 = iter(loader)
    assert la.take(it2, 1)[0].tolist() == [0, 1]  # a new epoch's iterator starts afresh


# ---- Pipeline, against a client that records what the server would see ----------------------------------------
class RecordingClient:
    """The three client calls the pipeline wraps; a generation takes `gen_s`, during which a push is an error
    (the server would reload weights in the middle of a batch)."""

    def __init__(self, gen_s=0.2):
        self.gen_s, self.events, self.weights, self.busy = gen_s, [], None, False
        self._lock = threading.Lock()

    def generate(self, prompts, **sampling):
        with self._lock:
            self.busy = True
            self.events.append(("generate", tuple(map(tuple, prompts)), self.weights))
        time.sleep(self.gen_s)
        with self._lock:
            self.busy = False
        return {"completion_ids": [[p[0] + 100] for p in prompts], "weights": self.weights}

    def update_named_params(self, metadata, named_params):
        assert not self.busy, "weights pushed while a generation was in flight"
        self.events.append(("push", None, None))
        self.pending = metadata

    def reset_prefix_cache(self):
        self.weights = self.pending
        self.events.append(("reset", None, self.weights))


def _push(client, version):
    client.update_named_params(version, iter(()))
    client.reset_prefix_cache()


def test_one_step_pipeline_pushes_between_generations_and_serves_one_version_old_batches():
    step = {"v": 0}
    client = RecordingClient()
    pipe = Pipeline(ONE_STEP, lambda: step["v"])
    pipe.attach(client)
    pipe.active = True
    b0, b1, b2 = [[1]], [[2]], [[3]]
    # step 0: the next batch is staged, weights v0 pushed, the first batch generated for real, then b1 sent
    pipe.stage(b1)
    _push(client, 0)
    assert not pipe.tickets  # not primed: b1 waits for the real request of b0
    out = client.generate(prompts=b0, n=4)
    assert out["weights"] == 0 and pipe.consumed_version == 0 and len(pipe.tickets) == 1
    # step 1: b2 staged; the push waits for b1 (generated with v0), then b2 goes out with v1
    step["v"] = 1
    pipe.stage(b2)
    _push(client, 1)
    out = client.generate(prompts=b1, n=4)
    assert out == {"completion_ids": [[102]], "weights": 0} and pipe.consumed_version == 0
    assert overlap.check_staleness(ONE_STEP, 1, pipe.consumed_version) == 1
    step["v"] = 2
    _push(client, 2)
    out = client.generate(prompts=b2, n=4)
    assert out["weights"] == 1 and pipe.consumed_version == 1
    kinds = [e[0] for e in client.events]
    assert kinds == ["push", "reset", "generate", "generate", "push", "reset", "generate", "push", "reset"]
    assert [e[2] for e in client.events if e[0] == "generate"] == [0, 0, 1]  # b0, b1 with v0; b2 with v1
    assert pipe.sent == 2


def test_pipeline_refuses_a_batch_other_than_the_one_requested_ahead():
    client = RecordingClient(gen_s=0.0)
    pipe = Pipeline(LOSSLESS, lambda: 3)
    pipe.attach(client)
    pipe.active = True
    client.generate(prompts=[[1]], n=4)  # the first batch: a real request teaches the sampling parameters
    pipe.stage([[2]])
    _push(client, 3)  # lossless: sent the moment the server has the weights
    assert len(pipe.tickets) == 1 and pipe.tickets[0].version == 3
    with pytest.raises(OverlapError, match="other prompts"):
        client.generate(prompts=[[9]], n=4)
    pipe.stage([[2]])
    _push(client, 3)
    with pytest.raises(OverlapError, match="other sampling parameters"):
        client.generate(prompts=[[2]], n=8)


def test_evaluation_requests_pass_through_after_what_is_in_flight():
    client = RecordingClient(gen_s=0.2)
    pipe = Pipeline(ONE_STEP, lambda: 0)
    pipe.attach(client)
    pipe.active = True
    pipe.stage([[2]])
    client.generate(prompts=[[1]], n=4)  # sends [[2]] ahead
    pipe.active = False
    client.generate(prompts=[[7]], n=1)  # an eval request: not matched against the ticket
    assert len(pipe.tickets) == 1 and pipe.tickets[0].future.done()


# ---- lossless streaming: one request per prompt group, worked on as each group finishes ------------------------
def test_stream_works_on_finished_groups_before_the_last_returns_and_rewards_beside_logprobs():
    """The last group's request returns only once an earlier group's rewards and log-prob pass are both running
    (each waits for the other to have started): a pipeline that waited for the whole batch, or ran the rewards
    after the log-prob passes, would time out here instead."""
    from ogrpo.overlap.pipeline import GroupWork

    groups, wait_s = 4, 60
    may_finish = threading.Event()
    in_reward = [threading.Event() for _ in range(groups)]
    in_score = [threading.Event() for _ in range(groups)]

    def call(i):
        def run():
            if i == groups - 1:
                assert may_finish.wait(wait_s), "no group was worked on before the last one came back"
            return {"prompt_ids": [[i]], "completion_ids": [[i, 10], [i, 11]], "logprobs": None}
        return run

    def reward(i, answer):
        in_reward[i].set()
        assert in_score[i].wait(wait_s), "the rewards did not run beside the log-prob pass"
        return [c[1] for c in answer["completion_ids"]]

    def score(i, answer):
        in_score[i].set()
        assert in_reward[i].wait(wait_s), "the log-prob pass did not run beside the rewards"
        may_finish.set()
        return i

    client = RecordingClient(gen_s=0.0)
    pipe = Pipeline(LOSSLESS, lambda: 0, split=lambda prompts, sampling: [call(i) for i in range(len(prompts))])
    pipe.attach(client)
    pipe.active = True
    work = GroupWork(reward, score)
    pipe.on_group = work.arrived
    out = client.generate(prompts=[[i] for i in range(groups)], n=2)
    assert not client.events  # every group went out as its own request (the split), none as the whole batch
    assert out == {"prompt_ids": [[0], [1], [2], [3]], "logprobs": None,
                   "completion_ids": [[i, k] for i in range(groups) for k in (10, 11)]}  # batch order
    events = work.events
    last = events.index(("arrived", groups - 1))
    first = pipe.last_stream.arrivals[0]
    assert pipe.last_stream.arrivals[-1] == groups - 1
    assert events.index(("reward_start", first)) < last and events.index(("score_start", first)) < last
    assert work.early() == groups - 1  # every other group's log-prob pass started before the last arrived
    assert work.reward_results(groups) == [[10, 11]] * groups and work.scores == {i: i for i in range(groups)}


def test_rank_groups_work_on_their_own_groups_and_under_lockstep_run_the_kth_pass_together():
    """Two ranks, two groups each, handed over in the order the server finished them: each rank works only on
    its own groups (indexed within the rank); its rewards start as a group arrives; free-running (DDP) a pass
    runs as soon as its group is there, in lockstep (ZeRO-3: every pass a collective) a rank's k-th pass runs
    only once every rank has k groups, so both ranks run the same passes at the same points of the stream."""
    from ogrpo.overlap.pipeline import GroupWork, RankGroups

    order = [2, 3, 0, 1]  # rank 1's groups finish first
    answers = {i: {"completion_ids": [[i]]} for i in range(4)}

    def run(rank, lockstep):
        passes = []  # (group scored, groups handed over so far)
        seen = [0]
        work = GroupWork(lambda i, a: a["completion_ids"][0][0],
                         lambda i, a: passes.append((i, seen[0])) or a["completion_ids"][0][0])
        groups = RankGroups(work, rank, ranks=2, per_rank=2, lockstep=lockstep)
        for index in order:
            seen[0] += 1
            groups.arrived(index, answers[index])
        return work, passes

    work, passes = run(1, lockstep=False)
    assert passes == [(0, 1), (1, 2)]  # scored as each arrived
    assert work.reward_results(2) == [2, 3] and work.scores == {0: 2, 1: 3}
    work, passes = run(0, lockstep=False)
    assert passes == [(0, 3), (1, 4)] and work.reward_results(2) == [0, 1]
    # lockstep: both ranks run pass 1 when the third group arrives and pass 2 when the fourth does
    assert run(1, lockstep=True)[1] == [(0, 3), (1, 4)]
    assert run(0, lockstep=True)[1] == [(0, 3), (1, 4)]
    with pytest.raises(OverlapError, match="outside the batch"):
        RankGroups(None, 0, ranks=2, per_rank=2, lockstep=False).arrived(4, answers[0])


class _Server:
    """TRL's VLLMClient.generate as the server answers it: one choice per completion, prompt-major; each
    completion's tokens are (prompt token, the seed vLLM gives it: the request's seed + i x n + j)."""

    def __init__(self):
        self.posted = []

    def generate(self, prompts, n=1, generation_kwargs=None, **sampling):
        seed = (generation_kwargs or {}).get("seed")
        self.posted.append({"prompts": prompts, "n": n, "seed": seed, **sampling})
        return {"prompt_ids": prompts, "logprobs": None,
                "completion_ids": [[p[0], seed + i * n + j] for i, p in enumerate(prompts) for j in range(n)]}


def test_group_calls_give_each_group_the_seeds_it_has_inside_the_one_request():
    from ogrpo import compat
    from ogrpo.serve.client import SeededGenerate, group_calls

    class Client(SeededGenerate, _Server):
        run_seed = 7

    whole, split = Client(), Client()
    prompts = [[1], [2], [3]]
    out = whole.generate(prompts=prompts, n=2, top_k=5)
    calls = group_calls(split, prompts, {"n": 2, "top_k": 5}, compat.VLLM_API)
    assert overlap.merge_outputs([call() for call in calls]) == out  # the same completions, in batch order
    seed = whole.posted[0]["seed"]
    assert [p["seed"] for p in split.posted] == [seed, seed + 2, seed + 4]  # the seed of prompt i inside `whole`
    assert [p["prompts"] for p in split.posted] == [[[1]], [[2]], [[3]]] and {p["top_k"] for p in split.posted} == {5}
    assert split._generation_calls == whole._generation_calls == 1  # the next request gets off's next seed
    assert whole.generate(prompts=prompts, n=2)["completion_ids"] != out["completion_ids"]
    # `trl vllm-serve` (TRL 1.9) samples every prompt of a request with the request's seed: each group keeps it
    trl19 = Client()
    calls = group_calls(trl19, prompts, {"n": 2}, compat.TRL_VLLM_SERVE)
    [call() for call in calls]
    assert [p["seed"] for p in trl19.posted] == [seed] * 3 and len(calls) == 3
    # images go whole
    assert group_calls(Client(), prompts, {"n": 2, "images": [None, ["aW1n"], None]}, compat.TRL_VLLM_SERVE) is None
    # one request per completion (vLLM's API server): completion j of prompt i alone, with the seed it has inside
    # the one request; merged back, the same answer
    ones = Client()
    groups = group_calls(ones, prompts, {"n": 2, "top_k": 5}, compat.VLLM_API, per_completion=True)
    assert [len(g) for g in groups] == [2, 2, 2]
    parts = [[call() for call in g] for g in groups]
    assert [(p["n"], p["seed"]) for p in ones.posted] == [(1, seed + k) for k in range(6)]
    assert overlap.merge_outputs([overlap.merge_completions(g) for g in parts]) == out
    assert ones._generation_calls == 1
    # TRL 1.9's server keeps whole groups (one seed per request); so does a batch over the cap
    assert all(callable(c) for c in group_calls(Client(), prompts, {"n": 2}, compat.TRL_VLLM_SERVE, True))
    many = [[k] for k in range(200)]
    assert all(callable(c) for c in group_calls(Client(), many, {"n": 2}, compat.VLLM_API, True))


def test_a_stream_of_completions_hands_each_over_as_it_ends_and_each_group_once_whole():
    """Completions sent one by one: on_part(group, j, answer) as each ends, on_group(group, merged) once the
    group's last is in (whatever order they end in), the whole answer in batch order. The completion that
    completes its group goes with it (no on_part: the group's passes compute its prompt once), and so do the
    rest of a group that all ended while the caller was busy."""
    import threading

    from ogrpo.overlap.pipeline import Stream

    order = [(1, 1), (0, 0), (1, 0), (0, 1)]  # the order the completions end in
    turn = [threading.Event() for _ in order]
    turn[0].set()
    seen = []

    def next_turn():  # each arrival taken (a part, or a group its last completion completed) lets the next end
        if len(seen) < len(order):
            turn[len(seen)].set()

    def call(i, j):
        def run():
            k = order.index((i, j))
            assert turn[k].wait(30)
            return {"prompt_ids": [[i]], "completion_ids": [[i, j]], "logprobs": [[[-0.5]]]}
        return run

    def on_part(i, j, answer):
        seen.append(("part", i, j))
        next_turn()

    def on_group(i, answer):
        seen.append(("group", i, "last", answer))
        next_turn()

    stream = Stream([[call(0, 0), call(0, 1)], [call(1, 0), call(1, 1)]])
    out = stream.result(on_group, on_part)
    assert [e[:3] for e in seen] == [("part", 1, 1), ("part", 0, 0), ("group", 1, "last"), ("group", 0, "last")]
    assert seen[2][3] == {"prompt_ids": [[1]], "completion_ids": [[1, 0], [1, 1]], "logprobs": [[[-0.5]]] * 2}
    assert out == {"prompt_ids": [[0], [1]], "completion_ids": [[0, 0], [0, 1], [1, 0], [1, 1]],
                   "logprobs": [[[-0.5]]] * 4}
    assert stream.arrivals == [1, 0]
    # the rest of group 0 and all of group 1 end while the caller is busy with group 0's first: none of them alone
    first = threading.Event()
    parts, groups = [], []

    def end(i, j, gate=None):
        def run():
            if gate is not None:
                assert gate.wait(30)
            return {"prompt_ids": [[i]], "completion_ids": [[i, j]]}
        return run

    stream = Stream([[end(0, 0), end(0, 1, first)], [end(1, k, first) for k in range(3)]])

    def busy_part(i, j, answer):
        parts.append((i, j))
        first.set()
        while not all(f.done() for f in stream.futures):
            time.sleep(0.01)

    out = stream.result(lambda i, a: groups.append(i), busy_part)
    assert parts == [(0, 0)] and groups == [0, 1], (parts, groups)
    assert out["completion_ids"] == [[0, 0], [0, 1], [1, 0], [1, 1], [1, 2]]
    with pytest.raises(OverlapError, match="different 'prompt_ids'"):
        overlap.merge_completions([{"prompt_ids": [[1]], "completion_ids": [[1]]},
                                   {"prompt_ids": [[2]], "completion_ids": [[2]]}])


def test_a_trainer_left_busy_after_generation_takes_the_next_streams_completions_with_their_groups():
    """Completions alone cost their group's prompt again: the pipeline hands them over one by one only while the
    last stream showed the server, not the trainer, to be what the step waits for (the trainer done soon after
    the last completion came back); after a stream that left it busy for longer than generation took, only whole
    groups, until a stream shows the server behind again."""
    from ogrpo.overlap.pipeline import LOSSLESS, Pipeline, Stream

    def call(i, j, delay):
        def run():
            time.sleep(delay)
            return {"prompt_ids": [[i]], "completion_ids": [[i, j]]}
        return run

    def stream(delay):
        return Stream([[call(0, 0, delay), call(0, 1, delay * 2)], [call(1, 0, delay), call(1, 1, delay * 2)]])

    pipe = Pipeline(LOSSLESS, lambda: 0)
    pipe.regroup = True  # groups trained ahead (steps.generate sets it): the rounding already follows the timing
    parts, groups = [], []
    pipe.on_part, pipe.on_group = (lambda i, j, a: parts.append((i, j))), (lambda i, a: groups.append(i))
    quick = stream(0.2)
    pipe._take(quick)  # the server generates 0.4 s, the trainer is done at once: server-bound
    assert pipe.parts_alone and len(parts) == 2 and sorted(groups) == [0, 1] and not quick.trainer_bound()
    slow = stream(0.05)
    pipe.on_group = lambda i, a: (groups.append(i), time.sleep(0.3))  # 0.6 s of work after 0.1 s of generation
    pipe._take(slow)
    assert pipe.parts_alone and slow.trainer_bound()
    parts.clear()
    pipe._take(stream(0.05))  # the last one left the trainer busy: no completion alone
    assert not pipe.parts_alone and parts == []
    pipe.on_group = lambda i, a: groups.append(i)
    pipe._take(stream(0.2))  # ... and that one did too (its groups came back whole); the next one did not
    assert not pipe.parts_alone
    pipe._take(stream(0.2))
    assert pipe.parts_alone and len(parts) == 2
    # without groups trained ahead every completion goes alone, whatever the timing (reruns round alike): the
    # one completing its group, one whose group ended while the caller was busy, and after a trainer-bound stream
    pipe.regroup = False
    parts.clear()
    pipe.on_group = lambda i, a: (groups.append(i), time.sleep(0.3))
    slow = stream(0.05)
    pipe._take(slow)
    assert slow.trainer_bound() and sorted(parts) == [(0, 0), (0, 1), (1, 0), (1, 1)], parts
    parts.clear()
    pipe._take(stream(0.05))
    assert pipe.parts_alone and sorted(parts) == [(0, 0), (0, 1), (1, 0), (1, 1)], parts


def test_a_stream_runs_side_work_the_moment_it_is_ready_not_at_the_next_arrival():
    """A group's rewards done while the server still generates: the stream wakes its caller (`side.ready()`)
    before the next completion comes back, and only then; a side with nothing ready is never woken."""
    import threading
    from concurrent.futures import Future

    from ogrpo.overlap.pipeline import Stream

    release_last, rewards = threading.Event(), Future()
    seen = []

    def call(j):
        def run():
            if j == 1:
                assert release_last.wait(30)
            return {"prompt_ids": [[0]], "completion_ids": [[0, j]]}
        return run

    class Side:
        def __init__(self):
            self.futures = [rewards]

        def waiting_on(self):
            return list(self.futures)

        def ready(self):
            assert rewards.done()
            seen.append("ready")
            self.futures = []
            release_last.set()  # the server's next completion ends only after the trainer has been woken

    def on_part(i, j, answer):
        seen.append(("part", j))
        if j == 0:  # the first completion's rewards end on another thread, while the second still generates
            threading.Timer(0.05, lambda: rewards.set_result("r")).start()

    out = Stream([[call(0), call(1)]]).result(lambda i, a: seen.append("group"), on_part, Side())
    assert seen == [("part", 0), "ready", "group"]  # the last completion goes with its group
    assert out["completion_ids"] == [[0, 0], [0, 1]]


def test_staleness_beyond_the_mode_bound_is_an_assertion_error():
    assert overlap.check_staleness(ONE_STEP, 5, 4) == 1
    assert overlap.check_staleness(LOSSLESS, 5, 5) == 0
    with pytest.raises(AssertionError, match="staleness 2"):
        overlap.check_staleness(ONE_STEP, 5, 3)
    with pytest.raises(AssertionError, match="staleness 1"):
        overlap.check_staleness(LOSSLESS, 5, 4)
    with pytest.raises(AssertionError, match="no policy version"):
        overlap.check_staleness(ONE_STEP, 5, None)


def test_importance_ratio_statistics_before_the_cap():
    import math

    import torch

    # token ratios exp(old - sampling): 1, 4, 0.5 and a padded position (mask 0) that must not count
    old = torch.tensor([[0.0, math.log(4.0)], [math.log(0.5), 7.0]])
    sampling = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [1, 0]])
    row = overlap.ratio_counts(old, sampling, mask, None, 3.0, sequence_level=False)
    stats = overlap.ratio_stats([row])
    assert stats == pytest.approx({"mean": 5.5 / 3, "min": 0.5, "max": 4.0, "clipped": 1 / 3})
    # sequence level: the summed log-ratio per sequence (4 and 0.5); two ranks combine by count
    seq = overlap.ratio_counts(old, sampling, mask, None, 3.0, sequence_level=True)
    assert overlap.ratio_stats([seq, row]) == pytest.approx(
        {"mean": (4.5 + 5.5) / 5, "min": 0.5, "max": 4.0, "clipped": 2 / 5})


# ---- the profiler's timeline ----------------------------------------------------------------------------------
def test_timeline_idle_shares_clip_spans_to_the_step():
    from ogrpo.profile.profiler import Timeline

    t = Timeline()
    s = 10**9
    t.record("server", "generate", 0, 6 * s)  # began one step earlier: 4 of its seconds fall in this step
    t.record("server", "weights", 5 * s, 7 * s)  # overlaps the generation: counted once
    t.record("trainer", "wait", 3 * s, 4 * s)
    row = t.window(2 * s, 12 * s)
    assert row["server_busy_s"] == pytest.approx(5.0) and row["trainer_wait_s"] == pytest.approx(1.0)
    assert row["idle_share"] == {"server": 0.5, "trainer": 0.1}
    assert t.window(12 * s, 13 * s)["idle_share"]["server"] == 1.0  # ended spans are gone
    span = t.open("server", "generate")  # in flight: counts up to the window's end
    start = time.time_ns()
    assert t.window(start - s, start + s)["server_busy_s"] > 0.9
    t.close(span)


def test_bench_split_summary_reports_idle_shares_and_the_ideal_overlap():
    from ogrpo.bench.step import split_ratios, summarize

    def row(step, busy, wait):
        return {"step_s": step, "server_busy_s": busy, "trainer_wait_s": wait, "peak_mem_gib": 1.0,
                "idle_share": {"server": 1 - busy / step, "trainer": wait / step}}

    # off: the trainer waits 3 of 5 s while the server generates; one-step: both busy, 3.2 s a step
    off = summarize([row(9.0, 1.0, 1.0)] + [row(5.0, 3.0, 3.0)] * 2)  # the first step is a warm-up
    one = summarize([row(9.0, 1.0, 1.0)] + [row(3.2, 3.0, 0.0)] * 2)
    assert off["ideal_step"] == 3.0 and off["server_idle"] == pytest.approx(0.4) and off["trainer_idle"] == 0.6
    r = split_ratios({"split-off": off, "split-one-step": one})
    assert r["one-step_step_over_off"] == pytest.approx(0.64)
    assert r["one-step_step_over_ideal"] == pytest.approx(3.2 / 3.2)  # trainer busy 3.2 s > server 3.0 s
    assert r["off_step_over_ideal"] == pytest.approx(5.0 / 3.0)


# ---- the plan -------------------------------------------------------------------------------------------------
def _plan(tmp_path, gpus, **ogrpo_opts):
    import yaml

    from ogrpo.config import load_run_config
    from ogrpo.plan import plan_from_config

    trl = ogrpo_opts.pop("trl", {})
    cfg = tmp_path / "r.yaml"
    cfg.write_text(yaml.safe_dump({"model_name_or_path": "ogrpo:tiny", "dataset_name": "ogrpo:tiny",
                                   "reward_funcs": ["tiny_letter"], **trl, "ogrpo": {"use_vllm": True,
                                                                                    **ogrpo_opts}}))
    return plan_from_config(load_run_config(str(cfg)), gpus=gpus).to_dict()


def _setting(plan, name):
    return next((s for s in plan["settings"] if s["name"] == name), None)


def test_plan_one_step_on_the_split_placement_turns_the_correction_on(tmp_path):
    plan = _plan(tmp_path, "3xcpu", overlap="one-step", trl={"vllm_importance_sampling_correction": False})
    assert _setting(plan, "overlap")["value"] == "one-step"
    assert overlap.plan_mode(Plan.from_dict(plan)) == ONE_STEP and overlap.plan_mode(None) == "off"
    assert plan["trainer_args"]["vllm_importance_sampling_correction"] is True
    change = next(c for c in plan["changes"] if c["key"] == "vllm_importance_sampling_correction")
    assert change["from"] is False and change["to"] is True and "one step old" in change["reason"]


def test_plan_uses_off_where_no_separate_server_exists(tmp_path):
    plan = _plan(tmp_path, "cpu", overlap="lossless")  # one device: vLLM colocated in the trainer
    assert _setting(plan, "overlap")["value"] == "off" and overlap.plan_mode(Plan.from_dict(plan)) == "off"
    change = next(c for c in plan["changes"] if c["key"] == "ogrpo.overlap")
    assert change["from"] == "lossless" and change["to"] == "off" and "no separate server" in change["reason"]
    plan = _plan(tmp_path, "3xcpu", overlap="one-step", trl={"num_iterations": 2})
    assert _setting(plan, "overlap")["value"] == "off"
    assert any(c["key"] == "ogrpo.overlap" and "num_iterations=2" in c["reason"] for c in plan["changes"])
    default = _plan(tmp_path, "cpu")
    assert _setting(default, "overlap")["value"] == "off"
    assert not any(c["key"] == "ogrpo.overlap" for c in default["changes"])  # not asked for: nothing changed


def test_plan_default_is_lossless_where_a_separate_server_exists(tmp_path):
    plan = _plan(tmp_path, "3xcpu")
    assert _setting(plan, "overlap")["value"] == "lossless" and "same samples" in _setting(plan, "overlap")["reason"]
    assert "vllm_importance_sampling_correction" not in plan["trainer_args"]  # lossless changes no training key
    plan = _plan(tmp_path, "3xcpu", trl={"num_iterations": 2})  # cannot apply: off, and no change listed
    assert _setting(plan, "overlap")["value"] == "off" and "num_iterations" in _setting(plan, "overlap")["reason"]
    assert not any(c["key"] == "ogrpo.overlap" for c in plan["changes"])


def test_plan_says_whether_lossless_streams_groups_and_the_trainer_reads_it(tmp_path):
    """TRL 1.16: group by group, with one trainer process or several (3xcpu: the main process hands each group to
    its rank); whole batches, visibly, where a rank's share of a batch is not whole groups. TRL 1.9's `trl
    vllm-serve`: group by group with one engine (O-GRPO's handler; tests/trl19 plans it), whole batches with
    several. The trainer's pipeline takes the plan's decision."""
    from types import SimpleNamespace

    import trl

    from ogrpo import compat
    from ogrpo.plan import Plan
    from ogrpo.planner import overlap_stream
    from ogrpo.stacks import parse_version

    assert _setting(_plan(tmp_path, "2xcpu"), "overlap.stream")["value"] == "groups"
    two = _setting(_plan(tmp_path, "3xcpu"), "overlap.stream")
    assert two["value"] == "groups" and "2 trainer processes" in two["reason"]
    # 6 completions a rank in groups of 4: a group would straddle two ranks
    odd = _setting(_plan(tmp_path, "3xcpu", trl={"per_device_train_batch_size": 6, "num_generations": 4}),
                   "overlap.stream")
    assert odd["value"] == "batch" and "not whole groups of 4" in odd["reason"]
    assert _setting(_plan(tmp_path, "3xcpu", overlap="one-step"), "overlap.stream") is None  # lossless only
    # the planner tells TRL's server lines apart as compat does (it sits below compat, so it keeps its own bound)
    for version in ("1.9.2", "1.15.0", "1.16.0", "1.17.1"):
        old_line = parse_version(version)[:2] < overlap_stream.FIRST_VLLM_API_LINE
        assert old_line == (compat.server_flavor(version) == compat.TRL_VLLM_SERVE)
        assert overlap_stream.decide(version, 1)[0] == "groups"  # both lines stream (one engine)
    assert overlap_stream.decide("1.9.2", 1, server_dp=2)[0] == "batch"
    assert overlap_stream.decide("1.16.0", 1, server_dp=2)[0] == "groups"  # vLLM's API server batches anyway
    assert "O-GRPO's handler" in overlap_stream.decide("1.9.2", 1)[1]

    # the trainer reads the plan's decision (ogrpo.trainer.assembly.install_overlap), it does not decide again
    from ogrpo.trainer.assembly import install_overlap

    asked = []

    class Trainer:
        args = SimpleNamespace(use_vllm=True, vllm_mode="server")

        def pipeline_generation(self, mode, stream):
            asked.append((mode, stream))
            return {"mode": mode}

    for plan, expect in ((_plan(tmp_path, "3xcpu"), ("lossless", True)),
                         (_plan(tmp_path, "3xcpu", trl={"per_device_train_batch_size": 6, "num_generations": 4}),
                          ("lossless", False))):
        asked.clear()
        assert install_overlap(Trainer(), Plan.from_dict(plan)) == {"mode": "lossless"}
        assert asked == [expect]
    assert trl.__version__ == compat.CPU_TRL_VERSION


def test_bad_overlap_value_is_one_line_exit_2(run_cli, tmp_path):
    proc = run_cli("plan", "--config", "tiny", "--gpus", "3xcpu", "--overlap", "one_step")
    assert proc.returncode == 2 and "--overlap 'one_step'" in proc.stderr and "Traceback" not in proc.stderr
    cfg = tmp_path / "r.yaml"
    cfg.write_text("model_name_or_path: ogrpo:tiny\ndataset_name: ogrpo:tiny\nreward_funcs: [tiny_letter]\n"
                   "ogrpo:\n  overlap: onestep\n")
    proc = run_cli("plan", "--config", str(cfg), "--gpus", "3xcpu")
    assert proc.returncode == 2 and "ogrpo.overlap: 'onestep'" in proc.stderr
    assert "did you mean one-step" in proc.stderr and "Traceback" not in proc.stderr


# ---- real jobs: a vLLM server and the trainer on the split placement -----------------------------------------
STEPS = 3


def profile_rows(run) -> list[dict]:
    return [json.loads(x) for x in (run / "profile.jsonl").read_text().splitlines()]


SEPARATE = {"old_policy_pass": "separate"}
# TRL's own passes throughout: its separate old-policy pass and its padded rows. Lossless runs with the plan's
# defaults (the old policy from the loss forward, packed passes), so one pair of jobs shows both exact.
TRL_PASSES = {**SEPARATE, "padding_free": "off"}


def assert_trl_passes_against_ours(off_run, run):
    """off ran TRL's padded passes and its separate old-policy pass; lossless packed them and took the old policy
    from the loss forward."""
    ours, theirs = (json.loads((r / "manifest.json").read_text()) for r in (run, off_run))
    assert theirs["old_policy_pass"]["pass"] == "separate" and ours["old_policy_pass"]["pass"] == "from_loss"
    assert theirs["padding_free"]["on"] is False and "padding_free: off" in theirs["padding_free"]["reason"]
    assert ours["padding_free"]["on"] is True, ours["padding_free"]


@pytest.fixture(scope="module")
def off_run(tmp_path_factory):
    from overlap_jobs import run_job

    # TRL's own passes, the old policy's among them: lossless (the loss forward's old policy) must train as this
    return run_job(tmp_path_factory.mktemp("off"), "off", steps=STEPS, ogrpo=SEPARATE)


@pytest.mark.integration
def test_lossless_gives_the_same_completions_and_losses_as_off(off_run, tmp_path):
    from overlap_jobs import PACKED, completions, metrics, requests, run_job

    run = run_job(tmp_path, "lossless", steps=STEPS)
    groups = 16 // 4  # per_device_train_batch_size / num_generations (overlap_jobs)
    for step in range(1, STEPS + 1):
        a, b = completions(run, step), completions(off_run, step)
        assert a["prompt"].tolist() == b["prompt"].tolist(), step
        assert a["completion"].tolist() == b["completion"].tolist(), step
    ours, theirs = metrics(run), metrics(off_run)
    assert len(ours) == len(theirs) == STEPS
    for x, y in zip(ours, theirs):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5), (x["step"], x["loss"], y["loss"])
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5), (x["step"], x["grad_norm"], y["grad_norm"])
        assert x["reward"] == pytest.approx(y["reward"], abs=1e-6)
        sampling = [k for k in y if k.startswith("sampling/")]
        assert len(sampling) == 5  # TRL's importance-sampling statistics, from the loss forwards in lossless
        for key in sampling:
            assert x[key] == pytest.approx(y[key], **PACKED), (x["step"], key, x[key], y[key])
        assert x["overlap/staleness"] == 0.0
        # the groups streamed: work on at least one began while the server still generated another
        assert 1 <= x["overlap/groups_early"] <= groups - 1
        # TRL took the groups' rewards and their reference pass (beta > 0); the old policy's came from the loss
        assert x["overlap/streamed_rewards"] == 1.0 and x["overlap/streamed_passes"] == 1.0
        assert x["overlap/rewards_ahead"] == 1.0
        # every group's loss forward and backward ran as it arrived, at least one before the last group was in,
        # and TRL's batch was what they trained on (else their gradients were dropped: trained_ahead 0)
        assert x["overlap/trained_ahead"] == groups and x["overlap/trained_early"] >= 1, x
        # each completion came back alone and had its reference pass as it ended, but those whose group was all
        # back by then, the one that completed it among them (they go with the group's pass)
        assert 0 <= x["overlap/completions_early"] <= 16 - groups, x
        # and loss forwards run as completions ended, their graphs kept for their group's backward: only for
        # completions that came alone (none in a step after one that left the trainer busy: completions_alone 0)
        assert x["overlap/forwarded_early"] <= x["overlap/completions_early"], x
        assert x["overlap/completions_alone"] == 1.0 or x["overlap/completions_early"] == 0.0, x
        # the completions that ran their backward as they ended, before their group was whole: never the one that
        # completed a group (as many as the trainer had time for)
        assert 0 <= x["overlap/backward_early"] <= 16 - groups, x
    assert sum(x["overlap/completions_early"] for x in ours) >= 1, ours  # some came alone and ran alone
    assert sum(x["overlap/forwarded_early"] for x in ours) >= 1, ours
    assert ours[0]["overlap/completions_alone"] == 1.0  # the first step has no step before it to say otherwise
    assert any(y["completions/min_length"] < y["completions/max_length"] for y in theirs)  # lengths vary
    # one request per completion, nothing requested that was not trained on
    assert requests(off_run) == STEPS and requests(run) == STEPS * 16
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["overlap"]["mode"] == "lossless" and manifest["overlap"]["stream_unit"] == "completion"
    # each completion's request streams, for its reference pass on its prefix (pieces of MIN_PIECE tokens: none
    # this short here; tests/test_train_ahead.py and tests/test_prefix_stream.py run them)
    assert manifest["overlap"]["prefix_passes"] is True, manifest["overlap"]
    # and so may the loss forward (the plan turns gradient checkpointing off: the activations fit)
    assert manifest["overlap"]["prefix_forwards"] is True, manifest["overlap"]
    assert manifest["old_policy_pass"] == {"pass": "from_loss", "reason": None}
    early = manifest["train_ahead"].pop("early_backward")
    assert manifest["train_ahead"] == {"on": True, "reason": None, "fallbacks": []}
    assert early["on"] is True and "as it ends" in early["reason"] and early["redone"] == [], early
    assert early["groups"] == groups, early  # the tiny model's gradient sums fit for every open group
    assert "train_ahead" not in json.loads((off_run / "manifest.json").read_text())  # nothing streams in off
    assert json.loads((off_run / "manifest.json").read_text())["old_policy_pass"]["pass"] == "separate"
    # the positions counted are those of the forwards that ran: off's two scoring passes over the whole batch (old
    # policy and reference), the streamed completions' reference pass in lossless, never both; the loss forwards
    # in lossless were the groups' own (trained ahead), in off the whole batch's (both packed: the plan's
    # padding_free, whose layout, a prompt computed once per bin included, depends on the rows a pass holds: a
    # completion scored alone computes its prompt again), over the same completions
    ours, theirs = profile_rows(run), profile_rows(off_run)
    for x, y in zip(ours, theirs):
        assert y["pass_real_tokens"]["score"] == 2 * y["pass_real_tokens"]["loss"], y
        assert x["pass_real_tokens"]["loss"] <= x["pass_real_tokens"]["score"] < 2 * x["pass_real_tokens"]["loss"]
        assert x["completion_tokens"] == y["completion_tokens"] < min(x["pass_real_tokens"]["loss"],
                                                                      y["pass_real_tokens"]["loss"]), (x, y)
        for row in (x, y):
            assert row["pass_real_tokens"]["score"] <= row["pass_tokens"]["score"], row
    assert sum(x["pass_tokens"]["score"] for x in ours) < sum(y["pass_tokens"]["score"] for y in theirs)


@pytest.mark.integration
def test_one_step_samples_are_at_most_one_version_old_and_logged(off_run, tmp_path):
    from overlap_jobs import completions, metrics, requests, run_job

    run = run_job(tmp_path, "one-step", steps=STEPS)
    rows = metrics(run)
    assert [r["overlap/staleness"] for r in rows] == [0.0, 1.0, 1.0]  # the first batch has nothing to overlap
    assert [r["overlap/sampled_version"] for r in rows] == [0.0, 0.0, 1.0]
    for r in rows:
        assert 0 < r["overlap/importance_ratio/min"] <= r["overlap/importance_ratio/mean"] \
            <= r["overlap/importance_ratio/max"]
        assert 0.0 <= r["overlap/importance_ratio/clipped"] <= 1.0
    # sampled with the previous weights: the trainer/sampler gap is far above the fp32 noise of step 1
    assert rows[0]["sampling/sampling_logp_difference/mean"] < 1e-4
    assert rows[1]["sampling/sampling_logp_difference/mean"] > 1e-3
    for step in range(1, STEPS + 1):  # the batch stream is off's
        assert completions(run, step)["prompt"].tolist() == completions(off_run, step)["prompt"].tolist()
    assert requests(run) == STEPS
    profile = profile_rows(run)
    assert len(profile) == STEPS and [p["staleness"] for p in profile] == [0, 1, 1]
    assert all(0.0 <= p["idle_share"][k] <= 1.0 for p in profile for k in ("server", "trainer"))
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["overlap"] == {"mode": "one-step", "max_staleness": 1, "importance_sampling_correction": True}
    assert "idle_share" in manifest["profile"]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_one_step_with_two_trainer_processes(tmp_path, strategy):
    """3xcpu: the server and two gloo trainer processes (DDP, or DeepSpeed ZeRO-3 whose weight push gathers the
    partitions on every rank); the prompts are gathered across ranks for the request sent ahead and the sampled
    version is broadcast back."""
    from overlap_jobs import metrics, requests, run_job

    run = run_job(tmp_path, "one-step", gpus="3xcpu", steps=STEPS, ogrpo={"strategy": strategy})
    rows = metrics(run)
    assert [r["overlap/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert all("overlap/importance_ratio/mean" in r for r in rows)
    assert rows[0]["sampling/sampling_logp_difference/mean"] < 1e-4  # the push reached the server whole
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["distributed"]["num_processes"] == 2
    if strategy == "zero3":
        assert manifest["distributed"]["deepspeed"]["zero_stage"] == 3
        # the push after each step sent the one gather made at the step's end (ogrpo/overlap/zero3_push.py); TRL's
        # per-parameter gathers ran for the first push only, before any step had ended (it walks the parameters
        # twice: their metadata for the server, then the weights)
        push = manifest["zero3_push"]
        assert push["full_gathers"] == push["pushes_from_gather"] == STEPS - 1, push
        assert push["per_parameter_gathers"] == 2 * push["parameters"] > 0, push
    assert requests(run) == STEPS


# a group of 4 in as many chunks on every rank, whatever its completions' lengths: a rank running fewer chunks than
# the other would pair its collectives (loss metrics, ZeRO's reduction) with others (the tiny task's completions end
# at 4-9 tokens: under a 20-token cap a rank's own token budget gives a group ending by 7 one chunk of 4 rows, a
# longer one two chunks of 2; taken alone, as before, the run then trained off off's numbers)
CHUNKS = {"loss_type": "grpo", "per_device_train_batch_size": 2, "gradient_accumulation_steps": 8,
          "steps_per_generation": 8, "max_completion_length": 20}


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("strategy,lora,keys", [("ddp", True, {}), ("zero3", False, {}), ("zero2", False, {}),
                                               ("zero2", False, CHUNKS)],
                         ids=["ddp-lora", "zero3-dapo", "zero2-dapo", "zero2-grpo-chunks"])
def test_lossless_with_two_trainer_processes_gives_the_same_losses_as_off(tmp_path, strategy, lora, keys):
    """3xcpu: two trainer processes under DDP training LoRA adapters (the merged push), or under ZeRO-3 (the
    push gathers the partitions) or ZeRO-2. `lossless` streams the groups there too (the plan's `overlap.stream`):
    the main process hands each finished group to the rank that owns it, which computes its rewards and log-prob
    passes and trains it while the server generates the rest (under ZeRO the ranks' passes and chunks run in step,
    each chunk's backward through DeepSpeed's engine, whose step the replayed micro-batches close); the push goes
    out at the step's end; nothing trained on changes. TRL's default loss (dapo) divides the gradients by the
    batch's token count at the end: under ZeRO, DeepSpeed's step divides them (its loss scale); grpo does not."""
    from lora_checks import assert_adapters_moved, server_lora_overrides
    from overlap_jobs import PACKED, completions, metrics, requests, run_job

    keys = {**(server_lora_overrides(STEPS) if lora else {}), **keys}
    ogrpo = {**{k: v for k, v in keys.pop("ogrpo", {}).items() if k != "use_vllm"}, "strategy": strategy}
    if lora:
        keys["save_strategy"] = "steps"  # one checkpoint, at the end: the trained adapters
        # no KL term: LoRA's reference is TRL's pass over the whole batch (adapters disabled), which a group's
        # loss trained ahead cannot wait for; without it each rank trains its groups as they arrive (train_ahead)
        keys["beta"] = 0.0
    # off runs TRL's own passes (padded, and the old policy's separate); lossless packs them and takes the old
    # policy from the loss forward, on both ranks
    runs = {mode: run_job(tmp_path / mode, mode, gpus="3xcpu", steps=STEPS,
                          ogrpo={**ogrpo, **(TRL_PASSES if mode == "off" else {})}, **keys)
            for mode in ("off", "lossless")}
    groups = 16 // 4  # a rank's groups: per_device_train_batch_size / num_generations (overlap_jobs)
    for step in range(1, STEPS + 1):
        a, b = completions(runs["lossless"], step), completions(runs["off"], step)
        assert a["completion"].tolist() == b["completion"].tolist(), step
    ours, theirs = metrics(runs["lossless"]), metrics(runs["off"])
    assert len(ours) == len(theirs) == STEPS
    for x, y in zip(ours, theirs):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5), (x["step"], x["loss"], y["loss"])
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5), (x["step"], x["grad_norm"], y["grad_norm"])
        assert x["reward"] == pytest.approx(y["reward"], abs=1e-6)
        assert x["overlap/staleness"] == 0.0 and x["overlap/rewards_ahead"] == 1.0
        # rank 0's groups streamed: work on one began before its last group arrived; TRL took their rewards and
        # reference pass (with LoRA the reference pass is TRL's, adapters disabled, on the same model; the old
        # policy's came from the loss forward)
        assert 1 <= x["overlap/groups_early"] <= groups - 1
        assert x["overlap/streamed_rewards"] == 1.0 and x["overlap/streamed_passes"] == (0.0 if lora else 1.0)
        # each rank trained its groups as they arrived: under DDP the gradients averaged once, under ZeRO reduced
        # by DeepSpeed's engine chunk by chunk
        assert x["overlap/trained_ahead"] == groups and x["overlap/trained_early"] >= 1, x
        for key in [k for k in y if k.startswith("sampling/")]:
            assert x[key] == pytest.approx(y[key], **PACKED), (x["step"], key, x[key], y[key])
        # each push reached the server whole (merged, or gathered from the partitions) before the next request
        assert x["sampling/sampling_logp_difference/mean"] < 1e-4
    manifest = json.loads((runs["lossless"] / "manifest.json").read_text())
    assert manifest["overlap"]["mode"] == "lossless" and manifest["distributed"]["num_processes"] == 2
    planned = next(s for s in manifest["plan"]["settings"] if s["name"] == "overlap.train_ahead")
    early = manifest["train_ahead"].pop("early_backward")  # the ranks take whole groups: none to run ahead of
    assert early["on"] is False and "2 trainer processes" in early["reason"] and "whole groups" in early["reason"]
    assert manifest["train_ahead"] == {"on": True, "reason": None, "fallbacks": []}, manifest["train_ahead"]
    assert planned["value"] == "on" and ("DeepSpeed" in planned["reason"]) == (strategy != "ddp"), planned
    assert_trl_passes_against_ours(runs["off"], runs["lossless"])
    stream = next(s for s in manifest["plan"]["settings"] if s["name"] == "overlap.stream")
    assert stream["value"] == "groups" and "2 trainer processes" in stream["reason"]
    # one request per group of both ranks, nothing requested that was not trained on
    assert requests(runs["off"]) == STEPS and requests(runs["lossless"]) == STEPS * 2 * groups
    if lora:
        assert_adapters_moved(runs["lossless"])
    elif strategy == "zero2":
        assert manifest["distributed"]["deepspeed"]["zero_stage"] == 2
    else:  # the plan's linear_logprobs kernel scored every pass, ZeRO-3's partitioned lm_head gathered for it
        assert manifest["distributed"]["deepspeed"]["zero_stage"] == 3
        lp = manifest["kernels"]["linear_logprobs"]
        assert lp["installed"] is True and lp["calls"]["kernel"] >= STEPS and lp["calls"]["trl"] == 0, lp


# ---- LoRA: the merged push (TRL merges the adapters into the base for each push and unmerges after) -------------
def _lora_job(tmp_path, mode):
    """The server-mode LoRA run of tests/test_lora.py (fp32, no LoRA dropout, so the per-group log-prob passes
    apply) in `mode`."""
    from lora_checks import server_lora_overrides
    from overlap_jobs import run_job

    keys = server_lora_overrides(STEPS)  # one checkpoint, at the end: the trained adapters
    ogrpo = {k: v for k, v in keys.pop("ogrpo").items() if k != "use_vllm"}
    if mode == "off":
        ogrpo.update(TRL_PASSES)  # TRL's own passes, for lossless's packed ones and old policy to equal
    return run_job(tmp_path, mode, steps=STEPS, ogrpo=ogrpo, save_strategy="steps", **keys)


@pytest.mark.integration
def test_lossless_without_training_ahead_reruns_to_identical_metrics(tmp_path):
    """README's reproducibility note: where groups are trained ahead their gradients are summed in the order the
    completions end, so reruns agree to fp32 rounding only; with `ogrpo.train_ahead: off` two runs of one config
    on CPU log identical metrics (everything computed: wall-clock figures aside) and sample identical completions.
    A recipe's `full_determinism: true` asks for that: the plan turns training ahead off for it, and the run is the
    same as the one with `ogrpo.train_ahead: off` (transformers' deterministic algorithms change nothing on CPU)."""
    from overlap_jobs import completions, metrics, run_job

    runs = [run_job(tmp_path / "a", "lossless", steps=STEPS, ogrpo={"train_ahead": "off"}),
            run_job(tmp_path / "b", "lossless", steps=STEPS, full_determinism=True)]
    for run, words in zip(runs, ("ogrpo.train_ahead: off", "full_determinism")):
        manifest = json.loads((run / "manifest.json").read_text())
        assert manifest["train_ahead"]["on"] is False and words in manifest["train_ahead"]["reason"], manifest

    def computed(run):
        return [{k: v for k, v in r.items() if not any(t in k for t in ("time", "_s", "per_second", "runtime"))}
                for r in metrics(run)]

    a, b = computed(runs[0]), computed(runs[1])
    assert len(a) == STEPS and a == b, (a, b)
    assert all(r["overlap/staleness"] == 0.0 for r in a)  # lossless, streamed
    for step in range(1, STEPS + 1):
        assert completions(runs[0], step)["completion"].tolist() == completions(runs[1], step)["completion"].tolist()


@pytest.fixture(scope="module")
def off_lora_run(tmp_path_factory):
    return _lora_job(tmp_path_factory.mktemp("off-lora"), "off")


@pytest.mark.integration
def test_lossless_with_lora_gives_the_same_losses_as_off(off_lora_run, tmp_path):
    from lora_checks import assert_adapters_moved, assert_server_served_merged_weights
    from overlap_jobs import completions, metrics

    run = _lora_job(tmp_path, "lossless")
    for step in range(1, STEPS + 1):
        assert completions(run, step)["completion"].tolist() == completions(off_lora_run, step)["completion"].tolist()
    ours, theirs = metrics(run), metrics(off_lora_run)
    assert len(ours) == len(theirs) == STEPS
    for x, y in zip(ours, theirs):
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5), (x["step"], x["loss"], y["loss"])
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5), (x["step"], x["grad_norm"], y["grad_norm"])
        assert x["overlap/staleness"] == 0.0
        # the old policy (base + adapters) came from the loss forward; the reference (adapters disabled) was TRL's
        assert x["overlap/streamed_rewards"] == 1.0 and x["overlap/streamed_passes"] == 0.0
    assert_trl_passes_against_ours(off_lora_run, run)
    # LoRA's server mode (lossless is its default): each push reached the server merged, before its request, and
    # the adapters trained, so the check ran against a model that is not the base
    assert_server_served_merged_weights(run, STEPS)
    assert_adapters_moved(run)


@pytest.mark.integration
def test_one_step_with_lora_samples_are_at_most_one_version_old(tmp_path):
    from overlap_jobs import metrics, requests

    run = _lora_job(tmp_path, "one-step")
    rows = metrics(run)
    assert [r["overlap/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["overlap/sampled_version"] for r in rows] == [0.0, 0.0, 1.0]
    for r in rows:
        assert 0 < r["overlap/importance_ratio/min"] <= r["overlap/importance_ratio/mean"] \
            <= r["overlap/importance_ratio/max"]
    assert rows[0]["sampling/sampling_logp_difference/mean"] < 1e-4  # the merged base reached the server whole
    # batch 2 was sampled before step 1's adapters were pushed: the gap is the one-step lag, far above fp32 noise
    assert rows[1]["sampling/sampling_logp_difference/mean"] > 1e-3
    assert requests(run) == STEPS
