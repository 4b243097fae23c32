"""Server and trainer at work at the same time on the split placement (`ogrpo.overlap`).

On the split placement (a vLLM server on its own devices, the trainer on others) TRL makes the two take turns:
the trainer pushes weights, asks for a batch, waits for it, scores and trains while the server waits. The modes:

- `off`: TRL's order, untouched (nothing here is installed).
- `lossless`: the same requests in the same order with the same weights, so the same samples, losses and updates
  as `off`; only waiting changes. The weight push starts when the optimizer step ends (a callback, before logging
  and checkpointing) and the next batch is requested the moment the server has the weights. Where the server
  batches concurrent requests (vLLM's API server; TRL 1.9's `trl vllm-serve` through ogrpo.serve.trl_stream), a
  batch goes out as one request per prompt group, each with the seed the group had inside the one request
  (`Stream`), and the groups are taken as they finish: the rewards of a finished group run on a reward thread
  while the main thread computes its reference/old-policy log-probs (`GroupWork`), and the server still generates
  the rest; with several trainer processes each rank works on its own groups as the main process hands them over
  (`RankGroups`). Elsewhere the reward functions run in a thread while the
  trainer computes the log-probs of the whole batch. Either way their cross-rank gather is put back on the main
  thread, in TRL's order, so no two threads ever drive a collective at once.
- `one-step`: the server generates batch k+1 with the weights of step k while the trainer scores and trains on
  batch k (generated with step k-1's weights). Weights are pushed only between generations (a push waits for the
  request in flight), so no sample is more than one policy version old; every batch carries the version that
  generated it and the staleness is checked (never above 1) and logged. TRL's importance-sampling correction on
  the server's sampling log-probs (`vllm_importance_sampling_correction`) corrects for the stale sampler; the
  plan turns it on for this mode.

Both non-`off` modes need the next batch's prompts before the training loop asks for them: `Lookahead` takes
them from the trainer's own epoch iterator ahead of time and hands the same batches back in the same order, so
the batch stream is the one `off` sees. The trainer-side wiring into TRL lives in ogrpo.patches.trl_overlap; this
module holds what does not touch TRL.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Protocol

from ogrpo.overlap.prefixes import Prefixes
from ogrpo.patches.trl_vllm_wraps import wrap
from ogrpo.planner.types import Overlap

OFF, LOSSLESS, ONE_STEP = Overlap.OFF, Overlap.LOSSLESS, Overlap.ONE_STEP
MODES = (OFF, LOSSLESS, ONE_STEP)
MAX_STALENESS = {LOSSLESS: 0, ONE_STEP: 1}


class OverlapError(RuntimeError):
    """The pipeline would train on something other than what it was asked for (a broken invariant)."""


def unsupported(args, trainer=None) -> list[str]:
    """Why an overlap mode cannot run with these GRPOConfig args (and trainer); empty when it can."""
    out = []
    if not getattr(args, "use_vllm", False) or getattr(args, "vllm_mode", None) != "server":
        out.append("generation does not run on a separate vLLM server (use_vllm with vllm_mode=server)")
    if getattr(args, "num_iterations", 1) != 1:
        out.append(f"num_iterations={args.num_iterations}: a batch would train over several policy versions")
    spg, ga = getattr(args, "steps_per_generation", None), getattr(args, "gradient_accumulation_steps", 1)
    if spg not in (None, ga):
        out.append(f"steps_per_generation={spg} differs from gradient_accumulation_steps={ga}: one generation per "
                   "optimizer step is what keeps samples at most one version old")
    if trainer is not None:
        if getattr(trainer, "rollout_func", None) is not None:
            out.append("a custom rollout_func generates the batches")
        if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
            out.append("tools or environments rewrite prompts and completions during generation")
    return out


def _spawn(fn: Callable[[], Any], name: str) -> Future:
    """fn() on a daemon thread: a request still in flight when the process ends never holds its exit."""
    fut: Future = Future()

    def run():
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            fut.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


class Lookahead:
    """The trainer's epoch iterator, read ahead. `take` stands in for Trainer.get_batch_samples' reads (queued
    batches first, then the iterator); `peek` returns the first batch of the next optimizer step without taking
    it, or None at the end of the epoch (a new epoch's iterator starts afresh: nothing is read across epochs, so
    each epoch's sampler state is what `off` gives it)."""

    def __init__(self):
        self._iterator = None
        self._queue: deque = deque()

    def take(self, epoch_iterator, n: int) -> list:
        if epoch_iterator is not self._iterator:
            self._iterator, self._queue = epoch_iterator, deque()
        out = []
        while len(out) < n:
            if self._queue:
                out.append(self._queue.popleft())
                continue
            try:
                out.append(next(epoch_iterator))
            except StopIteration:
                break
        return out

    def peek(self):
        if self._iterator is None:
            return None
        if not self._queue:
            try:
                self._queue.append(next(self._iterator))
            except StopIteration:
                return None
        return self._queue[0]


def merge_outputs(outputs: list[dict]) -> dict:
    """One answer of TRL's VLLMClient.generate from the answers to its per-group parts, in group order: list fields
    concatenated (each part's lists are per prompt or per completion, prompt-major), None where every part has
    None."""
    merged: dict = {}
    for key in outputs[0]:
        values = [out[key] for out in outputs]
        if all(v is None for v in values):
            merged[key] = None
        elif all(isinstance(v, list) for v in values):
            merged[key] = [x for v in values for x in v]
        else:
            raise OverlapError(f"overlap: cannot merge the per-group answers' field {key!r}")
    return merged


def merge_completions(parts: list[dict]) -> dict:
    """One prompt group's answer from its per-completion answers (n=1 each, in completion order): the prompt's
    fields once (every part echoes the same prompt), the per-completion lists concatenated."""
    merged = merge_outputs(parts)
    for key in PER_PROMPT:
        if key in merged and merged[key] is not None:
            if any(p[key] != parts[0][key] for p in parts):
                raise OverlapError(f"overlap: a group's completions came back with different {key!r}")
            merged[key] = parts[0][key]
    return merged


PER_PROMPT = ("prompt_ids",)  # TRL's answer lists these per prompt, the rest per completion


class Stream:
    """One generation request sent as one request per prompt group (or per completion: a group is then a list of
    its completions' requests), all at once (the server batches them as it would the one request), taken as each
    finishes. `calls`: per group, in prompt order, a thunk or a list of thunks (ogrpo.serve.client.group_calls).
    `result(on_group, on_part)` calls on_part(index, j, answer) for each completion of a group sent one by one as
    it ends, and on_group(index, answer) once a group is whole, in the order the groups complete, on the caller's
    thread; it returns the merged answer. `arrivals` keeps the groups' order. A completion whose group is all
    back by the time the caller takes it (the one that completes it, or the rest of a group that ended while the
    caller was busy) gets no on_part: it goes with its group, whose passes compute the group's prompt once for
    all its rows; alone it would pay the prompt again, to save a wait there no longer is."""

    def __init__(self, calls: list, on_done: Callable[[], None] | None = None):
        self.groups = [list(c) if isinstance(c, (list, tuple)) else [c] for c in calls]
        self.where = [(i, j) for i, group in enumerate(self.groups) for j in range(len(group))]
        self.futures = [_spawn(self.groups[i][j], f"ogrpo-overlap-group-{i}" + (f"-{j}" if j else ""))
                        for i, j in self.where]
        self.of_group = [[f for (g, _), f in zip(self.where, self.futures) if g == i] for i in range(len(self.groups))]
        self.arrivals: list[int] = []
        self.prefixes = None  # ogrpo.overlap.prefixes.Prefixes: the completions' tokens so far, where they stream
        # when it was sent, when its last part came back, when the caller had taken them all (`trainer_bound`)
        self.sent_at, self.last_back, self.taken_at = time.monotonic(), None, None
        for fut in self.futures:
            fut.add_done_callback(self._back)
        if on_done is not None:
            left = [len(self.futures)]
            lock = threading.Lock()

            def one_done(_):
                with lock:
                    left[0] -= 1
                    last = left[0] == 0
                if last:
                    on_done()

            for fut in self.futures:
                fut.add_done_callback(one_done)

    def _back(self, _fut) -> None:
        self.last_back = time.monotonic()

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def trainer_bound(self) -> bool:
        """Whether its caller, taken up with what came back, finished after the last part came back by more than
        the server took to generate them all: the trainer, not the server, is then what a step waits for."""
        if self.taken_at is None or self.last_back is None:
            return False
        return self.taken_at - self.last_back > self.last_back - self.sent_at

    def exception(self):
        """Wait for every part; the first error, or None."""
        errors = [f.exception() for f in self.futures]
        return next((e for e in errors if e is not None), None)

    def result(self, on_group: Callable[[int, dict], Any] | None = None,
               on_part: Callable[[int, int, dict], Any] | None = None, side: SideWork | None = None,
               regroup: bool = True) -> dict:
        """`side`: work of the trainer's that becomes ready while the server generates (a group's rewards done),
        run on this thread as soon as it is, not at the next completion's arrival. `regroup` False: every
        completion of a group sent one by one gets on_part, its group all back or not (which rows are computed
        alone then does not depend on timing: reruns round alike)."""
        from concurrent.futures import FIRST_COMPLETED, wait

        index = {f: k for k, f in enumerate(self.futures)}
        left = set(self.futures)
        got: list[dict] = [{} for _ in self.groups]
        answers: dict[int, dict] = {}
        try:
            while left:
                watched = list(side.waiting_on()) if side is not None else []
                done, _ = wait(left.union(watched), return_when=FIRST_COMPLETED)
                back = sorted((f for f in done if f in left), key=index.__getitem__)
                if not back:
                    side.ready()
                    continue
                for fut in back:
                    left.discard(fut)
                    self._arrived(fut, index[fut], got, answers, on_group, on_part, regroup)
        except BaseException:
            self.exception()  # never leave a part running behind the error
            raise
        self.taken_at = time.monotonic()
        return merge_outputs([answers[i] for i in range(len(self.groups))])

    def _arrived(self, fut: Future, k: int, got: list, answers: dict, on_group, on_part, regroup: bool) -> None:
        i, j = self.where[k]
        got[i][j] = out = fut.result()
        if self.prefixes is not None:
            self.prefixes.end(i, j)
        whole = len(self.groups[i]) == 1
        if on_part is not None and not whole and not (regroup and all(f.done() for f in self.of_group[i])):
            on_part(i, j, out)
        if len(got[i]) < len(self.groups[i]):
            return
        answers[i] = out if whole else merge_completions([got[i][k] for k in range(len(self.groups[i]))])
        if i not in self.arrivals:
            self.arrivals.append(i)
        if on_group is not None:
            on_group(i, answers[i])


class SideWork(Protocol):
    """What a Stream's caller runs between arrivals: `waiting_on()` the futures whose end makes some of it ready
    (a done one is returned until `ready()` has taken it), `ready()` runs what is."""

    def waiting_on(self) -> list[Future]: ...

    def ready(self) -> None: ...


class GroupWork:
    """What the trainer does with the groups of one batch as they arrive (`arrived(index, answer)`, called on the
    main thread by Stream.result): `reward(index, answer)` runs on a reward thread, one group after the other in
    arrival order (reward functions need not be thread-safe), while `score(index, answer)` (the log-prob passes)
    runs on the calling thread, so the two overlap. `events` records (what, group) in the order it happened:
    arrived, reward_start/reward_end (row_reward_* for one completion's), score_start/score_end."""

    def __init__(self, reward: Callable[[int, dict], Any] | None, score: Callable[[int, dict], Any] | None):
        self.reward_fn, self.score_fn = reward, score
        self.rewards: dict[int, Future] = {}
        self.scores: dict[int, Any] = {}
        self.taken: set[str] = set()  # the trainer's passes already answered from `scores`
        self.tried: set[str] = set()  # the trainer's passes already matched against `scores`
        self.events: list[tuple[str, int]] = []
        self._lock = threading.Lock()
        self._last: Future | None = None
        self.then: Callable[[int, dict], Any] | None = None  # after a group's passes (its loss: train_ahead)
        self.ahead = None  # ogrpo.overlap.train_ahead.TrainAhead, where the groups are trained as they come
        self.row_fn: Callable[[int, int, dict], Any] | None = None  # a completion's passes, as it ends
        self.then_part: Callable[[int, int, dict], Any] | None = None  # after them (its loss forward: train_ahead)
        self.rows: dict[int, dict[int, Any]] = {}  # group -> completion -> its passes (read by score_fn)
        # the passes run on completions' prefixes as they stream (ogrpo.overlap.prefixes): (group, completion) ->
        # kind -> IncrementalPass; the models per kind (empty: off), the context each piece runs in
        self.prefix_passes: dict = {}
        self.prefix_models: dict = {}
        self.prefix_context = None
        self.prefix_used = 0  # completions whose passes came from their prefix
        self.prefix_forwards = 0  # completions whose loss forward ran on their prefix (train_ahead)

    def pop_prefix(self, group: int, j: int) -> dict | None:
        """Completion j of `group`'s passes run on its prefix (kind -> IncrementalPass), taken out; None if none."""
        return self.prefix_passes.pop((group, j), None)

    def event(self, what: str, group: int) -> None:
        with self._lock:
            self.events.append((what, group))

    def arrived(self, index: int, answer: dict) -> None:
        self.event("arrived", index)
        self.reward(index, answer)
        self.score(index, answer)
        if self.then is not None:
            self.then(index, answer)

    def part_arrived(self, index: int, j: int, answer: dict) -> None:
        """Completion j of group `index`, come back alone: its passes, then `then_part`, on the calling thread."""
        if self.row_fn is not None:
            self.event("row_start", index)
            try:
                self.rows.setdefault(index, {})[j] = self.row_fn(index, j, answer)
            finally:
                self.event("row_end", index)
        if self.then_part is not None:
            self.then_part(index, j, answer)

    def reward(self, index: int, answer: dict) -> None:
        """Queue the group's rewards on the reward thread (after the groups queued before it)."""
        if self.reward_fn is None:
            return
        self.rewards[index] = self._queue(index, lambda: self.reward_fn(index, answer), "reward", f"reward-{index}")

    def row_reward(self, index: int, j: int, answer: dict) -> Future | None:
        """Queue the rewards of completion j of group `index` alone (`reward_fn.row`), as the group's are; None
        where the reward function has no per-completion form."""
        row = getattr(self.reward_fn, "row", None)
        if row is None:
            return None
        return self._queue(index, lambda: row(index, j, answer), "row_reward", f"reward-{index}-{j}")

    def _queue(self, index: int, fn: Callable[[], Any], what: str, name: str) -> Future:
        before = self._last

        def run():
            if before is not None:
                before.exception()  # one call at a time, in the order queued (reward functions need not be
                # thread-safe)
            self.event(f"{what}_start", index)
            try:
                return fn()
            finally:
                self.event(f"{what}_end", index)

        self._last = _spawn(run, f"ogrpo-overlap-{name}")
        return self._last

    def score(self, index: int, answer: dict) -> None:
        """The group's log-prob passes, on the calling thread."""
        if self.score_fn is None:
            return
        self.event("score_start", index)
        try:
            self.scores[index] = self.score_fn(index, answer)
        finally:
            self.event("score_end", index)

    def early(self) -> int:
        """Groups whose reward or log-prob work started before the last group arrived."""
        with self._lock:
            events = list(self.events)
        arrived = [i for i, (what, _) in enumerate(events) if what == "arrived"]
        if not arrived:
            return 0
        last = arrived[-1]
        return len({g for what, g in events[:last] if what in ("reward_start", "score_start")})

    def reward_results(self, groups: int) -> list | None:
        """Every group's reward result in group order (waiting for the reward thread), None unless all ran."""
        if sorted(self.rewards) != list(range(groups)):
            self.wait()
            return None
        return [self.rewards[i].result() for i in range(groups)]

    def wait(self) -> None:
        for fut in list(self.rewards.values()):
            fut.exception()


class RankGroups:
    """One rank's side of a batch streamed to several trainer processes. The main process hands every finished
    group to every rank in the order they finish (`arrived(index, answer)`, `index` in the whole batch, called
    on each rank's main thread in the same order); a rank owns `per_rank` consecutive groups (TRL's process slice)
    and works on its own with `work` (its GroupWork, indexed within the rank): the rewards as the group arrives,
    the log-prob passes as soon as they may run. `lockstep`: the passes are collectives (ZeRO-3 gathers the
    parameters in each forward), so every rank must run as many as the others, in the same order: a rank's k-th
    group is scored once every rank has k groups, which each rank knows from the shared arrival order."""

    def __init__(self, work: GroupWork | None, rank: int, ranks: int, per_rank: int, lockstep: bool):
        self.work, self.rank, self.per_rank, self.lockstep = work, rank, per_rank, lockstep
        self.counts = [0] * ranks
        self.mine: list[tuple[int, dict]] = []
        self.scored = 0
        self.trained = 0

    def arrived(self, index: int, answer: dict) -> None:
        owner, local = divmod(index, self.per_rank)
        if not 0 <= owner < len(self.counts):
            raise OverlapError(f"overlap: group {index} is outside the batch of {len(self.counts)} ranks x "
                               f"{self.per_rank} groups")
        self.counts[owner] += 1
        if owner == self.rank:
            self.mine.append((local, answer))
            if self.work is not None:
                self.work.event("arrived", local)
                self.work.reward(local, answer)
        ready = min(self.counts) if self.lockstep else self.counts[self.rank]
        while self.scored < ready:
            local, answer = self.mine[self.scored]
            self.scored += 1
            if self.work is not None:
                self.work.score(local, answer)
        ahead = self.work.ahead if self.work is not None else None
        if ahead is not None:  # the groups' losses: their metrics are collectives, so always in step
            everyone = min(self.counts)
            whole = sum(self.counts) == len(self.counts) * self.per_rank
            while self.trained < everyone:
                local, answer = self.mine[self.trained]
                self.trained += 1
                ahead.train_now(local, answer, early=not whole)


class Ticket:
    """One generation request: its prompts and sampling parameters, the policy version the server held when it
    was sent, and its result (a Future, or a Stream of per-group requests)."""

    def __init__(self, prompts: list, sampling: dict, version: int | None, future: Future,
                 calls: int | None = None):
        self.prompts, self.sampling, self.version, self.future = prompts, sampling, version, future
        # the client's seed counter before this request took its seed (ogrpo.serve.client.SeededGenerate): a
        # checkpoint that does not keep this request must resume the counter here, to draw the same seed again
        self.calls = calls


class Pipeline:
    """The main process's side: hooks around its VLLMClient instance that send staged requests ahead and hand
    their results to the trainer's own `generate` call.

    - before a weight push: wait for every request in flight (a push never lands in the middle of a generation);
    - after the prefix-cache reset that ends a push: the server holds version `version_fn()`; a staged request is
      sent now (lossless: always; one-step: when the current batch was already requested, i.e. the pipeline is
      primed);
    - generate(prompts, **sampling): the oldest ticket's result when it was for these prompts (an OverlapError if
      it was for others: the lookahead and the loop disagree), else a real request (the first batch, or after an
      epoch's end), after which one-step sends the staged next batch.
    `split(prompts, sampling)`: one thunk per prompt group, or None where a request must stay whole; a split
    training request is a Stream, whose groups go to `on_group(index, answer)` as they finish (set by the trainer
    for the batch it generates). `timeline` (ogrpo.profile.profiler.Timeline) gets the server's busy spans."""

    def __init__(self, mode: str, version_fn: Callable[[], int], timeline=None,
                 split: Callable[[list, dict], list | None] | None = None):
        if mode not in MAX_STALENESS:
            raise ValueError(f"overlap mode {mode!r}: one of {', '.join(MAX_STALENESS)}")
        self.mode, self.version_fn, self.timeline = mode, version_fn, timeline
        self.staged: list | None = None
        self.tickets: deque[Ticket] = deque()
        self.sampling: dict | None = None
        self.server_version: int | None = None
        self.consumed_version: int | None = None
        self.active = False  # inside a training generation (eval requests pass straight through)
        self.sent = 0
        self.split = split
        self.on_group: Callable[[int, dict], Any] | None = None
        self.on_part: Callable[[int, int, dict], Any] | None = None  # each completion of a group sent one by one
        self.side: SideWork | None = None  # the trainer's work between arrivals (Stream.result)
        self.last_stream: Stream | None = None
        self.parts_alone = True  # whether the last stream handed its completions over one by one (`_take`)
        self.regroup = False  # completions may go with their groups (`_take`): set where groups train ahead
        # each completion's tokens stream as they are sampled, for its passes on the prefix (ogrpo.overlap.prefixes)
        self.prefix_tokens = False
        self._real: Callable | None = None

    # ---- wiring onto one client instance -------------------------------------------------------------------
    def attach(self, client) -> None:
        """Route `client`'s generate, weight push and prefix-cache reset through this pipeline (the `overlap`
        layer of ogrpo.patches.trl_vllm_wraps: the client is an instance TRL's trainer builds)."""
        def through(real):
            self._real = real

            def generate(*args, **kwargs):
                return self.generate(*args, **kwargs)

            return generate

        wrap(client, "generate", "overlap", through, kind="vllm_client")
        for name in ("update_named_params", "update_named_param"):
            if getattr(client, name, None) is not None:
                wrap(client, name, "overlap", self._before, kind="vllm_client")
        wrap(client, "reset_prefix_cache", "overlap", self._after, kind="vllm_client")

    def _before(self, push):
        def wrapper(*args, **kwargs):
            self.drain()
            return push(*args, **kwargs)

        return wrapper

    def _after(self, reset):
        def wrapper(*args, **kwargs):
            out = reset(*args, **kwargs)
            self.server_version = self.version_fn()
            if self.staged is not None and (self.mode == LOSSLESS or self.tickets):
                self._send()
            return out

        return wrapper

    # ---- requests ------------------------------------------------------------------------------------------
    def stage(self, prompts: list | None) -> None:
        """The unique prompt ids of the next training batch (rank 0's view of every rank's), or None."""
        self.staged = prompts

    def drain(self) -> None:
        """Wait for every request in flight; their results stay queued for the trainer."""
        for ticket in self.tickets:
            ticket.future.exception()  # waits; an error surfaces when the trainer takes the result

    def _stream(self, prompts: list, sampling: dict) -> Stream | None:
        sink = Prefixes() if self.prefix_tokens and self.split is not None else None
        if sink is not None:
            calls = self.split(prompts, sampling, sink.put)
        else:
            calls = self.split(prompts, sampling) if self.split is not None else None
        if not calls:
            return None
        on_done = None
        if self.timeline is not None:
            span = self.timeline.open("server", "generate")
            on_done = lambda: self.timeline.close(span)  # noqa: E731 - closes when the last group is back
        stream = Stream(calls, on_done)
        stream.prefixes = sink
        return stream

    def _take(self, handle) -> dict:
        if isinstance(handle, Stream):
            # a completion's passes alone compute its group's prompt again: worth it only while the trainer would
            # otherwise wait for the server; where the last stream left it busy long after generation ended, the
            # groups take their completions whole (the same results, computed once per prompt)
            # ... where the timing already decides the rounding (groups trained ahead: their gradients are summed
            # in the order completions end); elsewhere every completion goes alone, as reruns must round alike
            bound = self.regroup and self.last_stream is not None and self.last_stream.trainer_bound()
            alone = None if bound else self.on_part
            self.parts_alone = alone is not None
            self.last_stream = handle
            if self.side is not None:
                self.side.prefixes = handle.prefixes
            return handle.result(self.on_group, alone, self.side, self.regroup)
        return handle.result()

    def _request(self, prompts: list, sampling: dict):
        span = self.timeline.open("server", "generate") if self.timeline is not None else None
        try:
            return self._real(prompts=prompts, **sampling)
        finally:
            if span is not None:
                self.timeline.close(span)

    def _send(self) -> None:
        prompts, self.staged = self.staged, None
        if self.sampling is None:  # no real request yet to learn TRL's sampling parameters from
            return
        sampling = dict(self.sampling)
        # the request's sampling seed is taken here, on the caller's thread, and the ticket records the counter
        # it was taken at (a checkpoint reads both, ogrpo.overlap.resume), not later on the request's thread
        client = getattr(self._real, "__self__", None)
        calls = getattr(client, "_generation_calls", None)
        seeded = getattr(client, "seeded_kwargs", None)
        sent = seeded(dict(sampling)) if seeded is not None else sampling
        future = self._stream(prompts, sent) or _spawn(lambda: self._request(prompts, sent),
                                                        "ogrpo-overlap-generate")
        self.tickets.append(Ticket(prompts, sampling, self.server_version, future, calls))
        self.sent += 1

    def generate(self, prompts, **sampling):
        if not self.active:  # evaluation: after what is in flight, straight through
            self.drain()
            return self._request(list(prompts), sampling)
        if self.tickets:
            ticket = self.tickets.popleft()
            if ticket.prompts != list(prompts) or ticket.sampling != sampling:
                ticket.future.exception()  # never leave a request running behind the error
                what = "prompts" if ticket.prompts != list(prompts) else "sampling parameters"
                raise OverlapError(f"overlap: the batch requested ahead has other {what} than the one the trainer "
                                   "asks for; the lookahead and the training loop disagree")
            self.consumed_version = ticket.version
            return self._take(ticket.future)
        stream = self._stream(list(prompts), sampling)
        out = self._take(stream) if stream is not None else self._request(list(prompts), sampling)
        self.sampling = dict(sampling)
        self.consumed_version = self.server_version
        if self.mode == ONE_STEP and self.staged is not None:
            self._send()
        return out

    def close(self) -> None:
        self.staged = None
        self.drain()
        self.tickets.clear()


def check_staleness(mode: str, trained_version: int, sampled_version: int | None) -> int:
    """trained - sampled policy version; AssertionError beyond the mode's bound (lossless 0, one-step 1)."""
    if sampled_version is None:
        raise AssertionError("overlap: a training batch carries no policy version")
    staleness = trained_version - sampled_version
    if not 0 <= staleness <= MAX_STALENESS[mode]:
        raise AssertionError(f"overlap {mode}: batch generated with policy version {sampled_version} trained at "
                             f"version {trained_version} (staleness {staleness}, at most {MAX_STALENESS[mode]})")
    return staleness


def ratio_counts(old_logps, sampling_logps, mask, clip_min: float | None, clip_max: float | None,
                 sequence_level: bool) -> list[float]:
    """Importance ratio trainer/sampler, exp(old - sampling log-prob), over the completion tokens (per sequence:
    the summed log-ratio), before TRL caps or masks it, as [sum, count, min, max, count outside [clip_min,
    clip_max]] (what TRL's truncation or masking changes), to be summed/min/maxed across ranks by
    `ratio_stats`. NaN sampling log-probs count as ratio 1, as in TRL."""
    import torch

    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    ratio = torch.exp(diff.sum(dim=-1)) if sequence_level else torch.exp(diff)[mask.bool()]
    ratio = ratio.double()
    if ratio.numel() == 0:
        return [0.0, 0.0, float("inf"), float("-inf"), 0.0]
    lo = clip_min if clip_min is not None else float("-inf")
    hi = clip_max if clip_max is not None else float("inf")
    return [ratio.sum().item(), float(ratio.numel()), ratio.min().item(), ratio.max().item(),
            ((ratio < lo) | (ratio > hi)).sum().item()]


def ratio_stats(rows: list[list[float]]) -> dict[str, float]:
    """mean, min, max and the share clipped from every rank's `ratio_counts`."""
    n = sum(r[1] for r in rows)
    if not n:
        return {}
    return {"mean": sum(r[0] for r in rows) / n, "min": min(r[2] for r in rows), "max": max(r[3] for r in rows),
            "clipped": sum(r[4] for r in rows) / n}


def plan_mode(plan) -> Overlap:
    """The overlap mode a Plan chose (its `overlap` setting); `off` for plans made before the option existed."""
    return plan.overlap if plan is not None else OFF
