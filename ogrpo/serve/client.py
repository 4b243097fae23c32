"""Trainer side of weight sync: the client TRL's GRPOTrainer talks to in server mode.

TRL 1.16 builds `VLLMClient(base_url)` on the main process only and, before each generation, calls
`update_named_params(metadata, iterator)` then `reset_prefix_cache()`. Its `init_communicator` raises
NotImplementedError on CPU because it opens an NCCL group. `install_cpu_client()` swaps in a subclass, at the
one place TRL looks the class up (`trl.generation.vllm_generation.VLLMClient`, swapped by
ogrpo.patches.trl_vllm_client), whose weight sync writes one safetensors file under /dev/shm and tells the
server's `cpu_shm` backend (ogrpo/serve/cpu_transfer.py) to load it; when the server runs on another node (its
address is not one of this host's), the trainer serves the file over HTTP and posts its URL, since shared memory
is per host. No TRL file is edited.
Both install functions also make every request carry the job key (ogrpo.serve.auth.install_client_key).

On GPU the NCCL path is TRL's own; `install_gpu_sync_timeout()` only puts a deadline around it, because a hung
NCCL broadcast otherwise burns the whole allocation (TRL #2923, #6797): past the deadline the process prints
every thread's stack and exits, and the supervisor tears the job down.
"""

from __future__ import annotations

import functools

import itertools
import os
import tempfile
import weakref
from typing import Any, Callable, Iterator

from ogrpo import compat
from ogrpo.patches import trl_vllm_client
from ogrpo.serve import auth, prefix_stream
from ogrpo.serve.auth import install_client_key
from ogrpo.serve.server import required_max_model_len, resolve_model

SHM_DIR = "/dev/shm"
_counter = itertools.count()


class ServerMismatchError(RuntimeError):
    """The server serves another model/revision/dtype or a shorter context than the trainer needs."""


def _shm_dir() -> str:
    return SHM_DIR if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK) else tempfile.gettempdir()


def in_server_dtype(named_params: Iterator[tuple[str, Any]], dtype: str | None) -> Iterator[tuple[str, Any]]:
    """Floating tensors cast to the server's dtype before they travel.

    A DDP trainer in bf16/fp16 mixed precision holds fp32 master weights; sent as they are, they cross the link
    at twice the bytes and vLLM casts them on arrival anyway. Integer buffers are left alone.
    """
    if dtype is None:
        yield from named_params
        return
    import torch

    target = getattr(torch, _dtype_name(dtype))
    for name, tensor in named_params:
        yield name, (tensor.to(target) if tensor.is_floating_point() else tensor)


def metadata_in_server_dtype(metadata: list, dtype: str | None) -> list:
    """TRL's (name, dtype, shape) announcements matching `in_server_dtype`."""
    if dtype is None:
        return list(metadata)
    floating = {"float32", "float16", "bfloat16", "float64"}
    return [(n, _dtype_name(dtype) if _dtype_name(d) in floating else d, shape) for n, d, shape in metadata]


def server_dtype(server_info: dict | None) -> str | None:
    """The dtype a vLLM server holds its weights in, from /server_info (None when it does not say)."""
    dtype = ((server_info or {}).get("model_config") or {}).get("dtype")
    return _dtype_name(dtype) if dtype is not None else None


def write_weights_file(named_params: Iterator[tuple[str, Any]], directory: str | None = None,
                       dtype: str | None = None) -> tuple[str, int]:
    """Write (name, tensor) pairs, floating ones in `dtype` when given, to one safetensors file; returns
    (path, number of tensors).

    The file is written under a temporary name and renamed, so a server never reads a half-written file.
    """
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {}
    seen_storage: set[int] = set()
    for name, tensor in in_server_dtype(named_params, dtype):
        # Copied as read: the iterator may change a tensor after yielding it (with PEFT, TRL merges the adapters
        # into the base weights for the sync and unmerges them in place when the iteration ends, before this
        # function writes the file; a view would then carry the unmerged base weights to the server).
        t = tensor.detach().to("cpu", copy=True)
        if t.numel() == 0:
            # ZeRO-3 leaves each parameter as a shape-[0] placeholder outside deepspeed.zero.GatheredParameters;
            # pushed as is, vLLM would load nothing for it and keep sampling from stale weights.
            raise RuntimeError(f"weight push: {name} is empty (an ungathered ZeRO-3 partition); gather the "
                               "parameters before pushing them")
        # safetensors refuses tensors that share storage (tied weights, views); copy the later ones.
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen_storage or not t.is_contiguous():
            t = t.clone().contiguous()
        seen_storage.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    directory = directory or _shm_dir()
    final = os.path.join(directory, f"ogrpo-weights-{os.getpid()}-{next(_counter)}.safetensors")
    tmp = final + ".tmp"
    save_file(tensors, tmp)
    os.replace(tmp, final)
    return final, len(tensors)


def is_local_address(host: str) -> bool:
    """Whether HOST names an address of this machine: a server there can read this host's /dev/shm."""
    import socket

    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as sock:
                sock.bind((addr[0], 0))  # only an address of one of this host's interfaces can be bound
            return True
        except OSError:
            continue
    return False


class WeightsFileServer:
    """Serves the current weights file over HTTP to a vLLM server on another node.

    Bound to the address this host uses to reach the server (not 0.0.0.0), on a free port; the URL carries a
    random token, and only the file published last is served."""

    def __init__(self, server_host: str, server_port: int):
        import secrets
        import socket
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((server_host, server_port))  # UDP connect: routes, sends nothing
            local = probe.getsockname()[0]
        token, owner = secrets.token_hex(16), self
        self.path: str | None = None

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                path = owner.path
                if self.path != f"/{token}" or path is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(os.path.getsize(path)))
                self.end_headers()
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 20):
                        self.wfile.write(chunk)

            def log_message(self, *args):  # one line per push on stderr is noise
                pass

        self._httpd = ThreadingHTTPServer((local, 0), Handler)
        self.url = f"http://{local}:{self._httpd.server_address[1]}/{token}"
        threading.Thread(target=self._httpd.serve_forever, name="ogrpo-weights-http", daemon=True).start()

    def publish(self, path: str | None) -> str:
        self.path = path
        return self.url

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def expected_from_run_config(trl_args: dict, ogrpo: dict | None = None, dtype: str | None = None,
                             plan=None) -> dict:
    """What the trainer needs from the server, from a run config's TRL fields (`RunConfig.trl`) and the Plan the
    trainer runs (None: the run's own lengths)."""

    model = trl_args.get("model_name_or_path")
    expect: dict[str, Any] = {"model": resolve_model(model) if model else None}
    if trl_args.get("model_revision") not in (None, "main"):
        expect["revision"] = trl_args["model_revision"]
    if dtype:
        expect["dtype"] = dtype
    need = required_max_model_len(trl_args, ogrpo, plan)
    if need:
        expect["min_max_model_len"] = need
    return expect


def check_server_matches(server_info: dict, models: dict, expect: dict) -> list[str]:
    """Problems (empty when none) between what the server reports and what the trainer expects.

    `server_info` is `/server_info?config_format=json` (its `vllm_config`), `models` is `/v1/models`.
    """
    problems: list[str] = []
    mc = (server_info or {}).get("model_config") or {}
    entry = ((models or {}).get("data") or [{}])[0]
    served = {str(mc.get("model") or entry.get("root") or entry.get("id") or "")}
    served |= {str(entry.get("id") or ""), str(entry.get("root") or "")}
    want_model = expect.get("model")
    if want_model and not any(_same_model(want_model, s) for s in served if s):
        problems.append(f"server serves {sorted(s for s in served if s)}, the trainer trains {want_model}")
    want_rev = expect.get("revision")
    if want_rev and mc.get("revision") not in (want_rev, None):
        problems.append(f"server revision {mc.get('revision')}, the trainer needs {want_rev}")
    want_dtype = expect.get("dtype")
    if want_dtype and mc.get("dtype") is not None and _dtype_name(mc["dtype"]) != _dtype_name(want_dtype):
        problems.append(f"server dtype {mc['dtype']}, the trainer needs {want_dtype}")
    need = expect.get("min_max_model_len")
    have = mc.get("max_model_len") or entry.get("max_model_len")
    if need and have and int(have) < int(need):
        problems.append(f"server max_model_len {have} < {need} (max_prompt_length + max_completion_length)")
    return problems


def _same_model(a: str, b: str) -> bool:
    if a == b:
        return True
    ra, rb = os.path.realpath(a), os.path.realpath(b)
    return os.path.exists(ra) and ra == rb


def _dtype_name(d: Any) -> str:
    text = str(d).removeprefix("torch.")
    return {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16",
            "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}.get(text, text)


# Seeds stay below 2**31: vLLM passes them to torch.Generator.manual_seed and numpy, which take 32-bit values
# (less room for the offsets the server adds per prompt and completion: ogrpo.patches.vllm_completions)
_SEED_SPAN = 2**31 - 2**20


def seeded_generation_kwargs(generation_kwargs: dict | None, run_seed: int, call_index: int) -> dict:
    """TRL's generation_kwargs with a vLLM sampling seed for generation call CALL_INDEX of a run seeded RUN_SEED.

    Unseeded, the server samples from its engine-wide generator, whose draws depend on which requests share an
    engine step (and on every request the server served before): two runs of one config differed from their first
    step. A seed per request gives each its own generator. The server spreads it over the request's prompts and
    completions (seed + prompt index x n + completion index), so no two sequences of a call share their draws, and
    a new call gets a new base (different samples for a prompt seen again). A seed the recipe sets in
    generation_kwargs is kept as it is.
    """
    kwargs = dict(generation_kwargs or {})
    if kwargs.get("seed") is None:
        kwargs["seed"] = (int(run_seed) * 1_000_003 + int(call_index) * 65_537) % _SEED_SPAN
    return kwargs


def group_calls(client, prompts: list, sampling: dict, flavor: str, per_completion: bool = False,
                on_tokens: Callable[[int, int, list], Any] | None = None) -> list | None:
    """One thunk per prompt group (each prompt with its n completions) that together ask the server for what
    `client.generate(prompts=prompts, **sampling)` asks in one request, each group with the sampling seeds it has
    inside that one request, so the completions are the same; None where the request must stay whole.

    Sent at once, the groups' requests reach the server together and its engine batches them as it would the
    one request (vLLM's API server; for TRL 1.9's client, ogrpo.serve.trl_stream), while each answer comes back
    when its group finishes (ogrpo.overlap.pipeline.Stream). A request that carries images stays whole. The seeds: a
    seeded request's prompt i samples with seed + i x n on O-GRPO's vLLM API server
    (ogrpo.patches.vllm_completions.spread_seed), so group i is sent with that seed; TRL 1.9's server samples
    every prompt of a request with the request's seed, so each group keeps it; an unseeded request stays unseeded
    (the engine's generator: no two runs agree anyway).

    `per_completion` (vLLM's API server only, at most MAX_COMPLETION_CALLS requests): each group is a list of n
    thunks, one request per completion with n=1, so each completion comes back as soon as it ends. vLLM samples a
    seeded request's j-th completion with the request's seed + j (its parallel sampling), so completion j of
    prompt i is sent with seed + i x n + j; the engine runs the same sequences either way. `on_tokens(i, j, ids)`
    (with per_completion): each such request streams (ogrpo.serve.prefix_stream), and completion j of prompt i's
    token ids so far go to it as they are sampled."""
    images = sampling.get("images")
    if len(prompts) < 2 or sampling.get("features") is not None \
            or (images is not None and any(i is not None for i in images)):
        return None
    seeded = getattr(client, "seeded_kwargs", None)
    sampling = seeded(dict(sampling)) if seeded is not None else dict(sampling)  # one seed per call, as generate
    n = max(1, int(sampling.get("n") or 1))
    base = dict(sampling.get("generation_kwargs") or {})
    spread = flavor == compat.VLLM_API
    one_each = per_completion and spread and n > 1 and len(prompts) * n <= MAX_COMPLETION_CALLS
    _widen_pool(client, len(prompts) * (n if one_each else 1))
    # the class's generate: the instance's is the overlap pipeline's; a seeded part is not seeded again
    call = functools.partial(functools.partial, type(client).generate, client)
    calls = []
    for i, prompt in enumerate(prompts):
        part = dict(sampling)
        part["prompts"] = [prompt]
        seed = base.get("seed") if spread else None
        if not one_each:
            if seed is not None:
                part["generation_kwargs"] = {**base, "seed": int(seed) + i * n}
            calls.append(call(**part))
            continue
        group = []
        for j in range(n):
            one = {**part, "n": 1}
            if seed is not None:
                one["generation_kwargs"] = {**base, "seed": int(seed) + i * n + j}
            if on_tokens is not None and prefix_stream.streamable(one):
                group.append(functools.partial(prefix_stream.generate, client, functools.partial(on_tokens, i, j),
                                               **one))
            else:
                group.append(call(**one))
        calls.append(group)
    return calls


# one thread and one connection per request in flight: a larger batch streams group by group
MAX_COMPLETION_CALLS = 256


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # requests session -> connections mounted


def _widen_pool(client, connections: int) -> None:
    """requests keeps 10 connections per host: the groups' concurrent requests would open and drop the others.
    The wider adapter keeps the session's retries (TRL's client retries a reset connection: the server closes a
    keep-alive connection idle for 5 s, and a request sent on it as it closes is reset; without them a step that
    takes about that long fails the run)."""
    session = getattr(client, "session", None)
    if session is None or _POOLS.get(session, 0) >= connections:
        return
    from requests.adapters import HTTPAdapter

    for prefix in ("http://", "https://"):
        retries = session.get_adapter(prefix).max_retries
        session.mount(prefix, HTTPAdapter(pool_connections=4, pool_maxsize=connections, max_retries=retries))
    _POOLS[session] = connections


class SeededGenerate:
    """Mixed in before TRL's VLLMClient: generation requests carry a seed derived from the run's
    (`seeded_generation_kwargs`), so server-mode CPU runs rerun identically. A request that already carries a seed
    (the recipe's, or one part of a split request: `group_calls`) keeps it and takes no call index: the indices
    are those of the requests whose seed they choose."""

    run_seed: int | None = None
    _generation_calls: int = 0

    def generate(self, *args, **kwargs):
        return super().generate(*args, **self.seeded_kwargs(kwargs))

    def seeded_kwargs(self, kwargs: dict) -> dict:
        """generate's keywords with this call's sampling seed."""
        if self.run_seed is not None and (kwargs.get("generation_kwargs") or {}).get("seed") is None:
            kwargs["generation_kwargs"] = seeded_generation_kwargs(kwargs.get("generation_kwargs"), self.run_seed,
                                                                   self._generation_calls)
            self._generation_calls += 1
        return kwargs


def _cpu_client_cls():
    from trl.generation.vllm_client import VLLMClient

    class CPUVLLMClient(SeededGenerate, VLLMClient):
        """VLLMClient whose weight sync goes through the server's `cpu_shm` backend, and whose generation requests
        carry a seed derived from the run's (SeededGenerate)."""

        expect: dict | None = None
        server_dtype: str | None = None
        _files: WeightsFileServer | None = None  # set by init_communicator when the server is on another host

        # TRL's signature kept (functools.wraps): callers that pass only the keywords a TRL line takes read it
        @functools.wraps(VLLMClient.generate)
        def generate(self, *args, **kwargs):
            return SeededGenerate.generate(self, *args, **kwargs)

        def init_communicator(self, device: Any = 0) -> None:
            info = self.get_server_info()
            self.server_dtype = server_dtype(info)
            wt = info.get("weight_transfer_config") or {}
            if wt.get("backend") != "cpu_shm":
                raise RuntimeError(
                    f"vLLM server at {self.base_url} has weight transfer {wt or None}; start it with "
                    "`ogrpo serve` on CPU (it selects the cpu_shm backend)"
                )
            _verify(self, self.expect)
            from urllib.parse import urlsplit

            url = urlsplit(self.base_url)
            remote = not is_local_address(url.hostname or "127.0.0.1")
            self._files = WeightsFileServer(url.hostname, url.port or 80) if remote else None
            print(f"ogrpo: weight push to {self.base_url}: "
                  + (f"over HTTP from {self._files.url.rsplit('/', 1)[0]} (server on another host)" if remote
                     else "through /dev/shm (server on this host)"), flush=True)
            self._post(f"{self.base_url}/init_weight_transfer_engine", json={"init_info": {}})

        def update_named_params(self, metadata, named_params) -> None:
            path, n = write_weights_file(named_params, dtype=self.server_dtype)
            try:
                if not self._updating_weights:
                    self._start_weight_update()
                where = {"path": path} if self._files is None else {"url": self._files.publish(path)}
                self._post(f"{self.base_url}/update_weights", json={"update_info": {**where, "num_tensors": n}})
                if not self._updating_weights:
                    self._finish_weight_update()
            finally:
                if self._files is not None:
                    self._files.publish(None)
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass

        def close_communicator(self) -> None:
            self.communicator = None
            if getattr(self, "_files", None) is not None:
                self._files.close()
                self._files = None

    return CPUVLLMClient


def cpu_client_needs_vllm() -> bool:
    """Whether the trainer-side CPU client `install_cpu_client` installs for the installed TRL uses vLLM's modules.
    TRL 1.9's (trl_serve_cpu) joins vLLM's process group; ours for the vLLM-API line overrides every method of
    TRL's client that touches vLLM (`init_communicator`, `update_named_params`, `close_communicator`), so its
    trainer can load TRL without vLLM (compat.trl_imports). Package metadata only: called before TRL is imported."""
    from importlib import metadata

    return compat.server_flavor(metadata.version("trl")) == compat.TRL_VLLM_SERVE


def install_cpu_client(expect: dict | None = None, seed: int | None = None):
    """Make TRL's server-mode generation use the CPU weight-sync client. Returns the class installed.

    `expect` (see `expected_from_run_config`) makes `init_communicator` refuse a server that serves another
    model, revision, dtype or a shorter context than the trainer needs. `seed`: the run's seed, from which each
    generation request's sampling seed is derived (`seeded_generation_kwargs`); None leaves requests unseeded.
    """
    import trl

    if compat.server_flavor(trl.__version__) == compat.TRL_VLLM_SERVE:
        # TRL 1.9 (the images' line, CI's second env) talks to `trl vllm-serve`: a gloo group instead of NCCL;
        # that server has no /server_info to check `expect` against
        from ogrpo.serve.trl_serve_cpu import install_client

        return install_client()

    install_client_key()  # every request carries the job key
    cls = _cpu_client_cls()
    cls.expect = dict(expect) if expect else None
    cls.run_seed = seed
    trl_vllm_client.install_client_class(cls)
    return cls


def _verify(client, expect: dict | None) -> None:
    if not expect:
        return
    info = client.get_server_info()
    models = client._get(f"{client.base_url}/v1/models")
    problems = check_server_matches(info, models, expect)
    if problems:
        raise ServerMismatchError(f"vLLM server at {client.base_url}: " + "; ".join(problems))


def install_gpu_sync_timeout(timeout_s: float = 600.0, expect: dict | None = None, push_dtype: str | None = None):
    """Bound TRL's NCCL weight sync: past `timeout_s` dump all stacks and exit(1) instead of hanging.

    faulthandler's watchdog runs outside the GIL-holding thread, so it fires even while NCCL blocks in C++;
    the supervisor then sees the trainer exit and tears the job down. `expect` as in `install_cpu_client`.
    Weights are pushed in the server's dtype: the one its /server_info reports, else `push_dtype` (the plan's
    server dtype; TRL 1.9's `trl vllm-serve` has no server-info route).
    """
    import faulthandler

    import trl
    from trl.generation.vllm_client import VLLMClient

    auth.install_client_key()  # every request carries the job key; TRL 1.9's group binds the server's address
    # TRL 1.9's client talks to `trl vllm-serve`: no server-info route to verify against, one tensor per call.
    verify = compat.server_flavor(trl.__version__) != compat.TRL_VLLM_SERVE

    def guarded(method):
        def wrapper(self, *args, **kwargs):
            faulthandler.dump_traceback_later(timeout_s, exit=True)
            try:
                return method(self, *args, **kwargs)
            finally:
                faulthandler.cancel_dump_traceback_later()

        wrapper.__name__ = method.__name__
        return wrapper

    class TimedVLLMClient(VLLMClient):
        sync_timeout_s = timeout_s
        server_dtype = _dtype_name(push_dtype) if push_dtype else None

        @guarded
        def init_communicator(self, device=0):
            if verify:
                _verify(self, expect)
                self.server_dtype = server_dtype(self.get_server_info()) or self.server_dtype
            auth.bind_group_near(self.base_url)  # TRL 1.16: the trainer's group socket, not on every interface
            return VLLMClient.init_communicator(self, device)

    trl_vllm_client.around_sync(TimedVLLMClient, VLLMClient, guarded)
    _push_in_server_dtype(TimedVLLMClient)

    trl_vllm_client.install_client_class(TimedVLLMClient)
    return TimedVLLMClient


def _push_in_server_dtype(cls) -> None:
    """The class's weight push (TRL 1.16: update_named_params(metadata, iterator); TRL 1.9:
    update_named_param(name, tensor)) sends floating tensors in `self.server_dtype`."""
    trl_vllm_client.convert_push(cls, lambda self, metadata: metadata_in_server_dtype(metadata, self.server_dtype),
                                 lambda self, named_params: in_server_dtype(named_params, self.server_dtype))
