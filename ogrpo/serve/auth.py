"""The job key on the wire (ogrpo.launch.secret makes it): the server refuses requests without it, the trainer's
VLLMClient sends it.

Server: `JobKeyMiddleware`, a pure ASGI middleware around the whole app, so every route is covered — generation,
/v1/models, /server_info, /metrics, and the dev-mode weight-transfer routes (/init_weight_transfer_engine,
/update_weights ... and TRL's /init_communicator/, /update_named_param/). vLLM's own `--api-key` guards only
/v1/*, which leaves weight updates open. Missing key: 401; wrong key: 403; nothing behind it runs.
One route stays open: `GET /health` (vLLM; TRL's server: `/health/`), a bare liveness probe with no body
(TRL's says {"status": "ok"}). TRL's `VLLMClient.check_server` polls it with module-level `requests.get`,
outside any session, and retries a non-200 answer forever without its timeout: keyed, a trainer started with the
wrong key would hang there until the allocation ends instead of failing on its first keyed request (below).
The probe tells no more than a port scan (something listens here) and changes nothing.

Client: `install_client_key()` gives every `VLLMClient` made afterwards (TRL's own class and our subclasses,
both TRL lines) the key, in one place: the `requests` module TRL's client module uses is replaced
(ogrpo.patches.trl_vllm_client) by a view whose `Session` carries `Authorization: Bearer KEY` in its headers
and whose `get`/`post` add it (TRL 1.9's init_communicator asks /get_world_size/ outside the session). A
401/403 from the server raises `JobKeyRefused` naming the cause, instead of TRL's bare "Request failed: 401".

The same view makes TRL 1.9's weight-sync group bind to the server's address: that client asks the server to
open the group on host "0.0.0.0" (every interface, any host may join); the view sends the address the client
reached the server at, the node's address the job gave it (NodeAddr). TRL 1.16 opens the group on the trainer
(rank 0, at `vllm.utils.network_utils.get_ip()`, which picks the interface of the default route):
`bind_group_near(server_url)` makes that lookup return the address this host reaches the server from.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from ogrpo.launch.secret import KEY_ENV, from_env
from ogrpo.patches import starlette_job_key, trl_vllm_client
from ogrpo.serve import deadline

SCHEME = "Bearer"
OPEN_PATHS = ("/health", "/health/")  # vLLM's and TRL's liveness routes; GET/HEAD only


class JobKeyRefused(RuntimeError):
    """The server answered 401/403: this process's job key is missing or is another job's."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def server_key() -> str:
    key = from_env()
    if not key:
        raise RuntimeError(f"no job key in {KEY_ENV}: the server would answer anyone (ogrpo.serve.auth)")
    return key


class JobKeyMiddleware:
    """Pure ASGI: refuse every request whose `Authorization: Bearer` is not the job key (the one in KEY_ENV
    when `key` is not given), except GET/HEAD of the liveness path."""

    def __init__(self, app, key: str | None = None, open_paths: tuple[str, ...] = OPEN_PATHS):
        self.app = app
        self._digest = _digest(key or server_key())
        self.open_paths = frozenset(open_paths)

    def _verdict(self, scope) -> int | None:
        """None when the request may pass, else the HTTP status to refuse it with."""
        path = scope["path"].removeprefix(scope.get("root_path", "") or "")
        if scope["type"] == "http" and scope.get("method") in ("GET", "HEAD") and path in self.open_paths:
            return None
        value = ""
        for name, raw in scope.get("headers") or ():
            if name.lower() == b"authorization":
                value = raw.decode("latin-1")
                break
        scheme, _, given = value.partition(" ")
        if not given or scheme.lower() != SCHEME.lower():
            return 401
        return None if hmac.compare_digest(_digest(given.strip()), self._digest) else 403

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):  # lifespan: start-up and shutdown of the app itself
            return await self.app(scope, receive, send)
        status = self._verdict(scope)
        if status is None:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        word = "missing" if status == 401 else "wrong"
        body = json.dumps({"error": f"{word} job key: this server answers only its own job"}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", SCHEME.encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


# --------------------------------------------------------------------------------------------- TRL's server


def install_starlette_guard(key: str | None = None, inner=None) -> None:
    """Every Starlette/FastAPI app in this process answers through `JobKeyMiddleware` (for `trl vllm-serve`, which
    has no middleware option; the patch: ogrpo.patches.starlette_job_key), around `inner(app)` where given (an ASGI
    middleware that only requests carrying the key reach)."""
    if starlette_job_key.installed():
        return
    key = key or server_key()  # no key, no guard: fail at start-up, not on the first request
    starlette_job_key.install(lambda app: JobKeyMiddleware(inner(app) if inner is not None else app, key=key))


# ------------------------------------------------------------------------------------------------ the client


def _refuse_on_auth(response, *args, **kwargs):
    if response.status_code in (401, 403):
        why = "carried no job key" if response.status_code == 401 else "carried another job's key"
        raise JobKeyRefused(
            f"vLLM server refused {response.request.method} {response.url} (HTTP {response.status_code}): the "
            f"request {why}; the trainer needs the server's {KEY_ENV} (the job supervisor sets it for both)")
    return response


# vLLM's finish reasons for a sequence it did not finish: it was aborted (the server shutting down on SIGTERM
# answers every request in flight with what it had generated) or failed
UNFINISHED = ("abort", "error")


class GenerationAborted(ConnectionError):
    """The server answered a generation with sequences it did not finish: a truncated completion must never be
    trained on or checkpointed as the batch in flight."""


def _refuse_unfinished(response, *args, **kwargs):
    """vLLM's OpenAI routes answer an aborted request with HTTP 200 and its partial (possibly empty) sequences,
    which TRL's client would take as completions. Fail the request instead: the step fails with it, and a job
    that is stopping leaves with its last complete checkpoint (ogrpo.trainer.preemption). A streamed answer is
    read, and its finish reasons checked, by its reader (ogrpo.serve.prefix_stream): reading it here would wait
    for its end."""
    if kwargs.get("stream"):
        return response
    if response.status_code != 200 or not any(f'"{r}"'.encode() in response.content for r in UNFINISHED):
        return response  # the common case, decided without parsing
    try:
        body = response.json()
    except ValueError:
        return response
    choices = body.get("choices") or [] if isinstance(body, dict) else []
    reasons = sorted({c.get("finish_reason") for c in choices if isinstance(c, dict)} & set(UNFINISHED))
    if reasons:
        raise GenerationAborted(
            f"vLLM server answered {response.request.method} {response.url} with unfinished sequences "
            f"(finish_reason {', '.join(reasons)}: it aborted them, e.g. on its way down); none of them is used")
    return response


def _keyed_session_cls(requests_mod):
    class JobKeySession(requests_mod.Session):
        """requests.Session that carries the job key on every request and keeps TRL 1.9's weight-sync group
        off 0.0.0.0."""

        def __init__(self):
            super().__init__()

            key = from_env()
            if key:
                self.headers["Authorization"] = f"{SCHEME} {key}"
            self.hooks["response"].extend([_refuse_on_auth, _refuse_unfinished])

        def request(self, method, url, *args, **kwargs):
            from urllib.parse import urlsplit

            payload = kwargs.get("json")
            if (str(url).rstrip("/").endswith("/init_communicator") and isinstance(payload, dict)
                    and payload.get("host") in ("0.0.0.0", "::", "")):
                # the group's master is the server's first worker: bind it where the client reaches the server
                kwargs["json"] = {**payload, "host": urlsplit(str(url)).hostname}
            # bounded, and given up once the job stops and the server is gone (ogrpo.serve.deadline)
            kwargs = deadline.bounded(kwargs)
            parts = urlsplit(str(url))
            health = f"{parts.scheme}://{parts.netloc}/health" if parts.netloc else None
            send = super().request
            return deadline.call(lambda: send(method, url, *args, **kwargs), health, f"{method} {url}")

    return JobKeySession


class _KeyedRequests:
    """Stands in for the `requests` module inside TRL's vllm_client module: the same module, except that
    sessions and one-off get/post carry the job key."""

    def __init__(self, real):
        self._real = real
        self.Session = _keyed_session_cls(real)

    def get(self, url, **kwargs):
        with self.Session() as s:
            return s.get(url, **kwargs)

    def post(self, url, **kwargs):
        with self.Session() as s:
            return s.post(url, **kwargs)

    def __getattr__(self, name):  # exceptions, adapters, ...: the real module's
        return getattr(self._real, name)


def route_address(host: str, port: int = 80) -> str:
    """The address of this host that packets to HOST leave from (a UDP connect sends nothing)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def install_client_key() -> None:
    """Make every TRL VLLMClient created from now on send this process's job key (see the module docstring; the
    patch: ogrpo.patches.trl_vllm_client)."""
    trl_vllm_client.install_requests(_KeyedRequests)


def bind_group_near(server_url: str) -> str | None:
    """TRL 1.16 (its client module imports vLLM's `get_ip`): the trainer, rank 0 of the NCCL weight-sync group,
    listens on the address this host reaches the server from. Returns that address (None on lines whose group
    the server opens, handled by the session above)."""
    from urllib.parse import urlsplit

    url = urlsplit(server_url)
    address = route_address(url.hostname or "127.0.0.1", url.port or 80)
    return address if trl_vllm_client.install_group_address(address) else None
