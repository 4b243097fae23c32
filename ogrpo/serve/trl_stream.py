"""`trl vllm-serve` (TRL 1.9 line, the GPU images' server) answering concurrent `/generate/` requests together,
each as soon as its own prompts are done: what `ogrpo.overlap: lossless` needs to take a batch group by group
(one request per prompt group, ogrpo.serve.client.group_calls) from TRL 1.9's client.

TRL's `/generate/` handler sends one blocking `LLM.generate` to its engine worker and waits for all of it, inside
the event loop: concurrent requests are generated one after another. Here, with one engine worker (data-parallel
size 1; more keep TRL's handler):

- the engine worker gets `ogrpo_generate_stream` (`streaming_llm`): it adds the request's prompts to vLLM's engine
  and steps it, taking every request that reaches its pipe meanwhile into the same running batch, and sends each
  request's outputs back (`PART`) the moment its last sequence finishes; it returns (`IDLE`, how many requests it
  took) when the engine has nothing left, which TRL's worker loop sends as the call's result;
- in the server process, `GroupBatcher` (ASGI, inside the job-key guard) answers `/generate/` requests of token
  ids (TRL's trainer sends nothing else) itself, with TRL's sampling parameters and TRL's response, from the
  outputs a reader thread takes off the pipe; every other route that talks to the worker (weight push, prefix-
  cache reset, `/chat/`...) waits until every `/generate/` here is answered, and a `/generate/` waits until no such
  route is inside TRL's handler, so TRL's handlers and the reader never read the pipe at once.

Each request's prompts sample exactly as inside one TRL request (the same SamplingParams for each prompt, the seed
included), so a batch asked for group by group gives the completions it gives whole.
"""

from __future__ import annotations

import itertools
import threading

from ogrpo import compat
from ogrpo.patches import trl_vllm_serve
from ogrpo.patches.target import moved, problems_of
from ogrpo.serve.auth import install_starlette_guard

PART, FAILED, IDLE = "ogrpo-part", "ogrpo-failed", "ogrpo-idle"
METHOD = "ogrpo_generate_stream"
# TRL 1.9's GenerateRequest fields that make its SamplingParams; a request carrying all of them (TRL's client
# always sends every one) is answered here, any other by TRL's handler
_SAMPLING = ("n", "repetition_penalty", "temperature", "top_p", "top_k", "min_p", "max_tokens", "logprobs")
_PASS_THROUGH = ("/health/", "/get_world_size/")  # routes that never touch the engine worker

NAME = "trl_stream"
LIBRARY = "trl"

_worker_connection = None  # the engine worker's end of its pipe (kept in the worker, `_keep_worker_connection`)
_connections: list = []  # the server process's ends of the workers' pipes, in rank order


def not_applicable() -> str | None:
    """Only TRL 1.9's client talks to `trl vllm-serve`; later lines talk to vLLM's API server."""
    import trl

    if compat.server_flavor(trl.__version__) != compat.TRL_VLLM_SERVE:
        return "this TRL line's client talks to vLLM's API server, not `trl vllm-serve` (never applies)"
    return None


def check() -> None:
    """What this module reads of TRL's server script and of vLLM's LLM: the names, and the lines of TRL's
    `/generate/` handler whose sampling parameters `sampling_params` rebuilds."""
    problems = problems_of({
        "trl.scripts.vllm_serve:Pipe": None, "trl.scripts.vllm_serve:main": ("script_args",),
        "trl.scripts.vllm_serve:llm_worker": None, "trl.generation.vllm_generation:extract_logprobs": None,
        "vllm:LLM.enqueue": ("prompts", "sampling_params", "use_tqdm"), "vllm:LLM._add_request": None,
        "vllm.v1.engine.llm_engine:LLMEngine.step": None,
        "vllm.v1.engine.llm_engine:LLMEngine.has_unfinished_requests": None,
        "vllm.sampling_params:StructuredOutputsParams": None,
    })
    if not problems:
        import inspect

        from trl.scripts import vllm_serve
        from vllm import LLM

        main = inspect.getsource(vllm_serve.main)
        needles = [(main, "Pipe()"), (main, "generation_kwargs.update(request.generation_kwargs)"),
                   (main, "StructuredOutputsParams(regex=request.structured_outputs_regex)"),
                   (inspect.getsource(LLM._add_request), "next(self.request_counter)")]
        needles += [(main, f'"{k}": request.{k}') for k in _SAMPLING]
        problems = [f"no longer contains `{needle}`" for source, needle in needles if needle not in source]
    if problems:
        raise moved(NAME, LIBRARY, problems)


# ---- engine worker ----------------------------------------------------------------------------------------------
def streaming_llm(base):
    """vLLM's `LLM` class with `ogrpo_generate_stream`."""

    class StreamingLLM(base):
        def ogrpo_generate_stream(self, tag: int, prompts: list, sampling_params):
            conn = _worker_connection
            order: dict = {}  # tag -> its request ids, in prompt order
            owner: dict = {}  # request id -> tag
            done: dict = {}  # request id -> finished RequestOutput
            taken = 0

            def add(tag, prompts, sampling_params):
                nonlocal taken
                taken += 1
                # the outputs carry the ids LLM numbers its requests with (enqueue returns the engine's internal,
                # randomized ones): the counter's values across the call
                first = self.request_counter.counter
                try:  # a request vLLM refuses (too long a prompt...) fails alone; the engine and the rest go on
                    self.enqueue(prompts, sampling_params, use_tqdm=False)
                except Exception as exc:  # noqa: BLE001 - answered to its request
                    conn.send((FAILED, tag, f"{type(exc).__name__}: {exc}"))
                    return
                ids = [str(i) for i in range(first, self.request_counter.counter)]
                if len(ids) != len(prompts):
                    raise RuntimeError(f"ogrpo: {len(prompts)} prompts were numbered {ids}")
                order[tag] = ids
                owner.update({rid: tag for rid in ids})

            add(tag, prompts, sampling_params)
            while self.llm_engine.has_unfinished_requests():
                while conn.poll():  # requests sent meanwhile join the running batch
                    command = conn.recv()
                    if command.get("method") != METHOD:
                        raise RuntimeError(f"ogrpo: the engine worker got {command.get('method') or command} "
                                           "while generating; the server lets nothing else through then")
                    add(**command["kwargs"])
                for out in self.llm_engine.step():
                    if not out.finished or out.request_id not in owner:
                        continue
                    t = owner.pop(out.request_id)
                    done[out.request_id] = out
                    if all(rid in done for rid in order[t]):
                        conn.send((PART, t, [done.pop(rid) for rid in order.pop(t)]))
            return IDLE, taken

    return StreamingLLM


# ---- server process ---------------------------------------------------------------------------------------------
def recording_pipe(real):
    """multiprocessing.Pipe for TRL's `main`: the server's ends are kept (`_connections`)."""

    def Pipe(*args, **kwargs):  # noqa: N802 - the name TRL's main calls
        parent, child = real(*args, **kwargs)
        _connections.append(parent)
        return parent, child

    return Pipe


def sampling_params(payload: dict):
    """TRL 1.9's `/generate/` SamplingParams for a request's JSON (its handler's rule)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    kwargs = {k: payload[k] for k in _SAMPLING}
    kwargs.update(payload.get("generation_kwargs") or {})
    if payload.get("structured_outputs_regex") is not None:
        kwargs["structured_outputs"] = StructuredOutputsParams(regex=payload["structured_outputs_regex"])
    elif isinstance(kwargs.get("structured_outputs"), dict):
        kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
    return SamplingParams(**kwargs)


def _streamable(payload) -> bool:
    """Token-id prompts with every sampling field and no images; anything else (malformed included: TRL's
    request model answers it 422) goes to TRL's handler."""
    prompts = payload.get("prompts") if isinstance(payload, dict) else None
    return (isinstance(prompts, list) and bool(prompts)
            and all(isinstance(p, list) and p and all(type(t) is int for t in p) for p in prompts)
            and all(k in payload for k in _SAMPLING) and not any(payload.get("images") or ()))


class GroupBatcher:
    """ASGI: `/generate/` of token ids through the streaming worker; other worker routes once it is idle."""

    def __init__(self, app):
        self.app = app
        self._tags = itertools.count()
        self._lock = threading.Lock()
        self._sent = self._taken = 0  # requests sent to the worker / taken by it (its IDLE counts)
        self._reading = False
        # /generate/ requests here not answered yet / other worker routes inside TRL's handler: each kind waits
        # for the other's count to be 0 (TRL's handlers read the pipe between awaits: body, job key)
        self._generating = self._routes = 0
        self._pending: dict = {}  # tag -> (loop, future)

    def busy(self) -> bool:
        with self._lock:
            return self._reading

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or len(_connections) != 1 or scope["path"] in _PASS_THROUGH:
            return await self.app(scope, receive, send)
        if scope["path"] == "/generate/" and scope["method"] == "POST":
            body = await _body(receive)
            try:
                import json

                payload = json.loads(body)
            except ValueError:
                payload = None
            if _streamable(payload):
                return await self._generate(payload, send)
            receive = _replay(body)
        import asyncio

        while not self._enter_route():  # TRL's handler reads the pipe itself
            await asyncio.sleep(0.005)
        try:
            await self.app(scope, receive, send)
        finally:
            with self._lock:
                self._routes -= 1

    def _enter_route(self) -> bool:
        """A route for TRL's handler may go in: every /generate/ here answered (the reader has stopped then)."""
        with self._lock:
            if self._reading or self._generating:
                return False
            self._routes += 1
            return True

    def _send(self, tag: int, payload: dict, params) -> bool | None:
        """The request to the worker, unless a route is inside TRL's handler (None: wait); True: start a reader."""
        with self._lock:
            if self._routes:
                return None
            _connections[0].send({"type": "call", "method": METHOD, "kwargs": {
                "tag": tag, "prompts": [{"prompt_token_ids": p} for p in payload["prompts"]],
                "sampling_params": params}})
            self._sent += 1
            start, self._reading = not self._reading, True
            return start

    async def _generate(self, payload, send):
        import asyncio

        try:
            params = sampling_params(payload)
        except Exception as exc:  # noqa: BLE001 - vLLM's validation, answered as TRL's handler would fail
            return await _json(send, 400, {"detail": f"{type(exc).__name__}: {exc}"})
        loop = asyncio.get_running_loop()
        tag, future = next(self._tags), loop.create_future()
        self._pending[tag] = (loop, future)
        with self._lock:
            self._generating += 1
        try:
            return await self._answer(tag, payload, params, future, send)
        finally:
            with self._lock:  # answered: the routes waiting for TRL's handler may go once this is the last
                self._generating -= 1

    async def _answer(self, tag, payload, params, future, send):
        import asyncio

        while (start := self._send(tag, payload, params)) is None:
            await asyncio.sleep(0.005)
        if start:
            threading.Thread(target=self._read, name="ogrpo-stream-reader", daemon=True).start()
        try:
            outputs = await future
        except ValueError as exc:  # vLLM refused this request (its worker goes on)
            return await _json(send, 400, {"detail": str(exc)})
        except Exception as exc:  # noqa: BLE001 - the worker failed: this request's answer says so
            return await _json(send, 500, {"detail": f"{type(exc).__name__}: {exc}"})
        from trl.generation.vllm_generation import extract_logprobs

        logprobs, token_ids = extract_logprobs(outputs)
        await _json(send, 200, {"prompt_ids": [o.prompt_token_ids for o in outputs],
                                "completion_ids": [list(c.token_ids) for o in outputs for c in o.outputs],
                                "logprobs": logprobs, "logprob_token_ids": token_ids})

    def _read(self) -> None:
        """The pipe's messages until the worker has taken and answered every request sent."""
        conn = _connections[0]
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError) as exc:
                with self._lock:  # before the answers go out: nothing reads the pipe once they have
                    self._reading = False
                for tag in list(self._pending):
                    self._resolve(tag, error=RuntimeError(f"the engine worker is gone ({exc!r})"))
                return
            if isinstance(message, tuple) and message[:1] == (PART,):
                self._resolve(message[1], outputs=message[2])
            elif isinstance(message, tuple) and message[:1] == (FAILED,):
                self._resolve(message[1], error=ValueError(message[2]))
            elif isinstance(message, tuple) and message[:1] == (IDLE,):
                with self._lock:
                    self._taken += message[1]
                    if self._taken == self._sent:
                        self._reading = False
                        return

    def _resolve(self, tag, outputs=None, error=None) -> None:
        loop, future = self._pending.pop(tag)

        def set_():
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(outputs)

        loop.call_soon_threadsafe(set_)


async def _body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes):
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


async def _json(send, status: int, content: dict) -> None:
    import json

    body = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _keep_worker_connection(connection) -> None:
    global _worker_connection
    _worker_connection = connection


def install(wrap_llm=None) -> None:
    """Before TRL's `main`: its engine workers build `streaming_llm(wrap_llm(vllm.LLM))`, its pipes are recorded
    and every Starlette app it builds answers through the job-key guard around `GroupBatcher`."""
    from trl.scripts import vllm_serve

    check()  # fail at start-up, naming what moved, not on the first request
    install_starlette_guard(inner=GroupBatcher)
    trl_vllm_serve.install(lambda base: streaming_llm(wrap_llm(base) if wrap_llm is not None else base),
                           on_worker=_keep_worker_connection)
    if getattr(vllm_serve.Pipe, "_ogrpo_recording", False) is False:
        vllm_serve.Pipe = recording_pipe(vllm_serve.Pipe)
        vllm_serve.Pipe._ogrpo_recording = True


def serve(prog: str, wrap_llm=None, argv: list[str] | None = None) -> None:
    """TRL's `vllm-serve` main with its own argument parser, after `install(wrap_llm)`."""
    from trl.scripts import vllm_serve

    install(wrap_llm)
    (script_args,) = vllm_serve.make_parser(prog=prog).parse_args_and_config(args=argv)
    vllm_serve.main(script_args)
