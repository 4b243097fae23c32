"""TRL's VLLMClient, as the trainer's side of server mode patches it. Three names in TRL's modules are swapped,
each looked up by TRL when it runs, so no TRL file is edited:

- `VLLMClient` in TRL's generation module (`install_client_class`): O-GRPO's subclass (ogrpo.serve.client: CPU
  weight sync through the server's `cpu_shm` backend, or a deadline around the NCCL sync; ogrpo.serve.trl_serve_cpu:
  TRL 1.9's gloo group);
- `requests` in TRL's client module(s) (`install_requests`): a view whose requests carry the job key
  (ogrpo.serve.auth.install_client_key);
- `get_ip` in TRL 1.16's client module (`install_group_address`): the address the trainer's weight-sync group
  listens on (ogrpo.serve.auth.bind_group_near).

The subclasses override TRL's methods, and on TRL 1.16 the CPU client calls TRL's private request helpers
(PRIVATE_HELPERS) and reads its `_updating_weights` flag; `around_sync` and `convert_push` wrap TRL's weight-sync
methods on a subclass (a deadline around each; the pushed tensors cast), passing TRL's own parameters
(PUSH_PARAMS) positionally. `check()` vouches for all of it.
"""

from __future__ import annotations

from ogrpo import compat
from ogrpo.patches.target import moved, problems_of, resolve, trl_generation_module

NAME = "trl_vllm_client"
LIBRARY = "trl"
# TRL's push methods and the parameters O-GRPO's wrappers pass them, positionally and in this order
PUSH_PARAMS = {"update_named_params": ("self", "metadata", "named_params"), "update_named_param": ("self", "name",
                                                                                                    "weights")}
# TRL 1.16's client helpers the CPU client (ogrpo.serve.client) calls; TRL 1.9 has its own (trl_serve_cpu)
PRIVATE_HELPERS = {"_post": ("url",), "_get": ("url",), "_start_weight_update": ("self",),
                   "_finish_weight_update": ("self",)}


def client_modules():
    """TRL's VLLMClient modules present in this TRL line (trl.generation on >= 1.0, trl.extras before)."""
    import importlib

    mods = []
    for name in ("trl.generation.vllm_client", "trl.extras.vllm_client"):
        try:
            mods.append(importlib.import_module(name))
        except ImportError:  # the other TRL line's module
            continue
    return mods


def check() -> None:
    import trl

    gen = trl_generation_module(NAME)
    fused_line = compat.server_flavor(trl.__version__) != compat.TRL_VLLM_SERVE
    targets: dict = {f"{gen}:VLLMClient": ("base_url", "host", "group_port"),
                     f"{gen}:VLLMClient.init_communicator": ("self", "device"),
                     f"{gen}:VLLMClient.close_communicator": ("self",),
                     f"{gen}:VLLMClient.reset_prefix_cache": ("self",)}
    for name in compat.vllm_client_sync_methods(trl.__version__):
        targets[f"{gen}:VLLMClient.{name}"] = PUSH_PARAMS.get(name, ("self",))
    if fused_line:
        targets[f"{gen}:VLLMClient.get_server_info"] = ("self",)
        targets.update({f"{gen}:VLLMClient.{name}": params for name, params in PRIVATE_HELPERS.items()})
    problems = problems_of(targets)
    if fused_line and not problems:
        import inspect

        if "self._updating_weights" not in inspect.getsource(resolve(f"{gen}:VLLMClient.update_named_params")):
            problems.append("VLLMClient.update_named_params no longer reads `self._updating_weights` (the CPU "
                            "client's batched-update flag)")
    mods = client_modules()
    if not mods:
        problems.append("no trl.generation.vllm_client / trl.extras.vllm_client module")
    for mod in mods:
        if not hasattr(getattr(mod, "requests", None), "Session"):
            problems.append(f"{mod.__name__} no longer uses `requests` (the job-key session)")
        if fused_line and not hasattr(mod, "get_ip"):
            problems.append(f"{mod.__name__} no longer imports `get_ip` (the weight-sync group's address)")
    if problems:
        raise moved(NAME, LIBRARY, problems)


def install_client_class(cls) -> None:
    """TRL's generation builds `cls` in server mode: it looks `VLLMClient` up in its module's globals."""
    compat.vllm_generation_module().VLLMClient = cls


def install_requests(view_cls) -> None:
    """The `requests` module of TRL's client module(s) becomes `view_cls(requests)`; idempotent (a module that
    already holds a `view_cls` keeps it). Raises PatchTargetMoved rather than leave a client without the view."""
    mods = client_modules()
    if not mods:
        raise moved(NAME, LIBRARY, ["no trl.generation.vllm_client / trl.extras.vllm_client module"])
    for mod in mods:
        real = getattr(mod, "requests", None)
        if isinstance(real, view_cls):
            continue
        if not hasattr(real, "Session"):
            raise moved(NAME, LIBRARY, [f"{mod.__name__} no longer uses `requests` (the job-key session)"])
        mod.requests = view_cls(real)


def install_group_address(address: str) -> bool:
    """TRL 1.16's client module asks vLLM's `get_ip` where rank 0 of the weight-sync group listens: answer
    `address`. False on lines whose client module has no `get_ip` (TRL 1.9: the server opens the group)."""
    patched = False
    for mod in client_modules():
        if hasattr(mod, "get_ip"):
            mod.get_ip = lambda: address
            patched = True
    return patched


def around_sync(cls, base, wrapper) -> None:
    """On subclass `cls`: each of this TRL line's weight-sync methods that `base` (TRL's VLLMClient) has becomes
    `wrapper(base's method)` (a function taking self)."""
    import trl

    for name in compat.vllm_client_sync_methods(trl.__version__):
        if hasattr(base, name):
            setattr(cls, name, wrapper(getattr(base, name)))


def convert_push(cls, metadata, tensors) -> None:
    """On subclass `cls`: the weight push sends `metadata(self, metadata)` and `tensors(self, named_params)` (an
    iterator of (name, tensor)) in place of what TRL's sync passes. TRL 1.16: update_named_params(metadata,
    iterator), whose single-tensor call goes through it; TRL 1.9: update_named_param(name, tensor)."""
    batch, single = getattr(cls, "update_named_params", None), getattr(cls, "update_named_param", None)
    if batch is not None:
        def update_named_params(self, metadata_, named_params):
            return batch(self, metadata(self, metadata_), tensors(self, named_params))

        cls.update_named_params = update_named_params
    if single is not None and batch is None:
        def update_named_param(self, name, weights):
            (_, weights), = tensors(self, iter([(name, weights)]))
            return single(self, name, weights)

        cls.update_named_param = update_named_param
