"""ogrpo.serve.trl_stream's server side against a stand-in engine worker on a real pipe (the real one, vLLM in TRL
1.9's `trl vllm-serve`, runs in tests/trl19/test_trl19_overlap.py): concurrent /generate/ requests all reach the
worker before any is answered, each is answered when its own outputs come back, routes that talk to the worker
wait until nothing is in flight, and the health check never waits."""

from __future__ import annotations

import asyncio
import json
import threading
from multiprocessing import Pipe
from types import SimpleNamespace

import pytest

from ogrpo.serve import trl_stream

WAIT_S = 30


def _output(prompt):
    return SimpleNamespace(prompt_token_ids=prompt,
                           outputs=[SimpleNamespace(token_ids=(prompt[0], 100 + k), logprobs=None) for k in range(2)])


class Worker(threading.Thread):
    """The engine worker's side of the pipe: takes `expect` streamed requests (all before answering any), waits
    for `release`, then answers them in reverse order and reports how many it took."""

    def __init__(self, conn, expect: int):
        super().__init__(daemon=True)
        self.conn, self.expect, self.release = conn, expect, threading.Event()
        self.took: list = []
        self.took_all = threading.Event()  # set once it has taken `expect` requests, before it answers any

    def run(self):
        while len(self.took) < self.expect:
            if not self.conn.poll(WAIT_S):
                return  # the batcher never sent them all: the requests time out, the test fails
            command = self.conn.recv()
            assert command["method"] == trl_stream.METHOD
            self.took.append(command["kwargs"])
        self.took_all.set()
        self.release.wait(WAIT_S)
        for kw in reversed(self.took):
            self.conn.send((trl_stream.PART, kw["tag"], [_output(p["prompt_token_ids"]) for p in kw["prompts"]]))
        self.conn.send((trl_stream.IDLE, len(self.took)))


class InnerApp:
    """TRL's app: records what reached it, and when; a route in `hold` stays inside the handler (awaiting, as TRL's
    does for the body and the job key) until its event is set."""

    def __init__(self, log, hold=None):
        self.log, self.hold = log, hold or {}

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.log.append(("inner", scope["path"], body))
        if scope["path"] in self.hold:
            await self.hold[scope["path"]].wait()
            self.log.append(("inner done", scope["path"]))
        await trl_stream._json(send, 200, {"path": scope["path"]})


async def _call(app, path, payload=None, log=None, name=None, slow_client_s=0.0):
    """One request; `slow_client_s`: the client takes that long to take the response's body."""
    body = json.dumps(payload).encode() if payload is not None else b""
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            await asyncio.sleep(3600)
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    out = {}

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
            if log is not None:
                log.append(("responding", name))
        else:
            await asyncio.sleep(slow_client_s)
            out["json"] = json.loads(message["body"])

    scope = {"type": "http", "method": "POST" if payload is not None else "GET", "path": path, "headers": []}
    await app(scope, receive, send)
    if log is not None:
        log.append(("answered", name))
    return out


def _idle(app) -> bool:
    """The reader stops once the worker's IDLE (sent after the last answer) is in: allow it a moment."""
    import time

    deadline = time.monotonic() + WAIT_S
    while app.busy() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not app.busy()


def _request(prompts):
    return {"prompts": prompts, "images": None, "n": 2, "repetition_penalty": 1.0, "temperature": 1.0,
            "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_tokens": 8, "logprobs": 0,
            "structured_outputs_regex": None, "generation_kwargs": {"seed": 3}}


@pytest.fixture
def pipe(monkeypatch):
    # what the batcher imports for its first answer (TRL's server has it imported already): here, not inside a
    # scenario's timeouts (a cold import of TRL takes minutes on a loaded 2-core machine, the event loop blocked)
    import trl.generation.vllm_generation  # noqa: F401

    parent, child = Pipe()
    monkeypatch.setattr(trl_stream, "_connections", [parent])
    monkeypatch.setattr(trl_stream, "sampling_params", lambda payload: {"n": payload["n"], "seed": 3})
    yield parent, child
    parent.close()
    child.close()


def test_concurrent_generates_run_together_answer_as_done_and_other_routes_wait(pipe):
    _, child = pipe
    worker = Worker(child, expect=2)
    worker.start()
    log: list = []
    app = trl_stream.GroupBatcher(InnerApp(log))

    async def scenario():
        # the first is answered to a slow client: still in flight after the worker's IDLE
        first = asyncio.create_task(_call(app, "/generate/", _request([[1], [2]]), log, "first", slow_client_s=0.3))
        second = asyncio.create_task(_call(app, "/generate/", _request([[3]]), log, "second"))
        # both at the worker (its event, not a sleep), neither answered: the reset comes while both are in flight
        assert await asyncio.to_thread(worker.took_all.wait, WAIT_S)
        reset = asyncio.create_task(_call(app, "/reset_prefix_cache/", {}, log, "reset"))
        health = await asyncio.wait_for(_call(app, "/health/"), WAIT_S)  # answered while both are in flight
        # the reset is held while nothing can be answered (the worker waits for `release`): a window that only
        # lets a wrong order show, never fails a right one
        await asyncio.sleep(0.2)
        assert not reset.done() and not any(
            e[0] in ("responding", "answered") or e[1:2] == ("/reset_prefix_cache/",) for e in log), log
        worker.release.set()
        return health, await asyncio.wait_for(asyncio.gather(first, second, reset), WAIT_S)

    health, (first, second, reset) = asyncio.run(scenario())
    worker.join(WAIT_S)
    assert health["status"] == 200 and len(worker.took) == 2  # both were sent before either was answered
    assert first["status"] == second["status"] == reset["status"] == 200
    # TRL's response, each for its own prompts
    assert first["json"] == {"prompt_ids": [[1], [2]], "completion_ids": [[1, 100], [1, 101], [2, 100], [2, 101]],
                             "logprobs": None, "logprob_token_ids": None}
    assert second["json"]["completion_ids"] == [[3, 100], [3, 101]]
    responding = [e[1] for e in log if e[0] == "responding"]
    assert responding.index("second") < responding.index("first")  # the one the worker finished first came first
    # the reset reached TRL's handler only once every /generate/ was answered (its response sent)
    inner = [i for i, e in enumerate(log) if e[:2] == ("inner", "/reset_prefix_cache/")]
    assert inner and inner[0] > max(i for i, e in enumerate(log) if e[0] == "answered" and e[1] != "reset"), log
    assert _idle(app)


def test_a_generate_waits_while_another_route_is_inside_trls_handler(pipe):
    """TRL's handlers read the pipe themselves: a /generate/ that came meanwhile reaches the worker (and starts the
    reader) only once the handler has answered."""
    _, child = pipe
    worker = Worker(child, expect=1)
    worker.start()
    log: list = []

    async def scenario():
        held = asyncio.Event()
        app = trl_stream.GroupBatcher(InnerApp(log, hold={"/update_named_param/": held}))
        push = asyncio.create_task(_call(app, "/update_named_param/", {"name": "w"}, log, "push"))
        while not log:  # the push is inside TRL's handler
            await asyncio.sleep(0.005)
        generate = asyncio.create_task(_call(app, "/generate/", _request([[7]]), log, "generate"))
        # the generate waits for the handler, whatever the wait: a window that only lets a wrong order show
        assert not await asyncio.to_thread(worker.took_all.wait, 0.3), "sent while TRL's handler was inside"
        assert not app.busy()  # no reader beside TRL's handler
        held.set()
        assert await asyncio.to_thread(worker.took_all.wait, WAIT_S)
        worker.release.set()
        return app, await asyncio.wait_for(asyncio.gather(push, generate), WAIT_S)

    app, (push, generate) = asyncio.run(scenario())
    worker.join(WAIT_S)
    assert push["status"] == generate["status"] == 200
    assert generate["json"]["completion_ids"] == [[7, 100], [7, 101]]
    assert [e[:2] for e in log] == [("inner", "/update_named_param/"), ("inner done", "/update_named_param/"),
                                    ("responding", "push"), ("answered", "push"),
                                    ("responding", "generate"), ("answered", "generate")], log
    assert _idle(app)


def test_text_prompts_and_images_go_to_trls_handler_with_their_body(pipe):
    log: list = []
    app = trl_stream.GroupBatcher(InnerApp(log))
    for payload in ({**_request(["a prompt"])}, {**_request([[1]]), "images": [["aW1n"]]}):
        out = asyncio.run(_call(app, "/generate/", payload))
        assert out["status"] == 200 and out["json"] == {"path": "/generate/"}
        assert json.loads(log[-1][2]) == payload


def test_a_worker_that_dies_fails_its_requests_with_a_reason(pipe):
    _, child = pipe
    app = trl_stream.GroupBatcher(InnerApp([]))

    def die():
        child.recv()
        child.close()

    worker = threading.Thread(target=die, daemon=True)
    worker.start()
    out = asyncio.run(asyncio.wait_for(_call(app, "/generate/", _request([[1]])), WAIT_S))
    assert out["status"] == 500 and "engine worker is gone" in out["json"]["detail"]
    assert _idle(app)
    # the server saw the pipe end inside child.close(): let the close finish before the fixture closes it again
    worker.join(WAIT_S)
    assert not worker.is_alive()


def test_a_request_vllm_refuses_fails_alone_with_its_reason_and_the_worker_goes_on(pipe):
    _, child = pipe
    app = trl_stream.GroupBatcher(InnerApp([]))

    def refuse_then_answer():
        refused = child.recv()["kwargs"]
        child.send((trl_stream.FAILED, refused["tag"], "ValueError: the prompt is longer than max_model_len"))
        child.send((trl_stream.IDLE, 1))
        kept = child.recv()["kwargs"]
        child.send((trl_stream.PART, kept["tag"], [_output(p["prompt_token_ids"]) for p in kept["prompts"]]))
        child.send((trl_stream.IDLE, 1))

    threading.Thread(target=refuse_then_answer, daemon=True).start()
    out = asyncio.run(asyncio.wait_for(_call(app, "/generate/", _request([[1] * 300])), WAIT_S))
    assert out["status"] == 400 and "longer than max_model_len" in out["json"]["detail"]
    assert _idle(app)
    out = asyncio.run(asyncio.wait_for(_call(app, "/generate/", _request([[5]])), WAIT_S))
    assert out["status"] == 200 and out["json"]["completion_ids"] == [[5, 100], [5, 101]]


def test_malformed_prompts_go_to_trls_request_model(pipe):
    log: list = []
    app = trl_stream.GroupBatcher(InnerApp(log))
    for prompts in ([["a", "b"]], [[]], [[1.5]], "not a list"):
        out = asyncio.run(_call(app, "/generate/", _request(prompts)))
        assert out["json"] == {"path": "/generate/"}, prompts  # TRL's handler (its pydantic model) answered
    assert len(log) == 4

