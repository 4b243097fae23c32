"""The `cpu_shm` weight-transfer backend: how new trainer weights reach a vLLM server that runs on CPU.

Every built-in vLLM backend (nccl, ipc, sparse_nccl, sharded_rdt, nccl_m2n) needs a GPU, and the base engine's
`update_weights` calls `torch.accelerator.synchronize()`, which raises on CPU-only torch. Here the trainer writes
all parameters to ONE safetensors file (under /dev/shm, so it never touches a disk) and posts its path; each
worker memory-maps the file and loads it inside one layerwise reload (see `cpu_reload`: per-parameter reloads
give NaN and a tied lm_head must be repacked). A trainer on another node (no shared /dev/shm) serves the file
over HTTP instead and posts its URL; the worker copies it to its own /dev/shm first (ogrpo.serve.client).

The server imports this module through `--worker-extension-cls ogrpo.serve.cpu_transfer.CPUWeightSyncExtension`:
vLLM imports the extension class in every worker before `Worker.load_model` builds the engine, and the import
is what registers the backend with `WeightTransferEngineFactory` in that process.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from ogrpo.patches.vllm_cpu_reload import begin_reload, finish_reload, refresh_tied_lm_head

from ogrpo.serve import CPU_BACKEND as BACKEND_NAME

log = logging.getLogger("ogrpo.serve.cpu_transfer")


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    # Nothing to rendezvous: the file path travels with every update.
    pass


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    # path: the file on this host's /dev/shm (trainer on the same node); url: where the trainer serves it over
    # HTTP when it runs on another node (shared memory is per host)
    path: str | None = None
    url: str | None = None
    # Optional count the client announces, so a truncated or foreign file is refused instead of half-loaded.
    num_tensors: int | None = None


def _read_tensors(path: str):
    from safetensors import safe_open

    if not os.path.exists(path):
        raise FileNotFoundError(
            f"cpu_shm weight file {path} does not exist on the server's host: the trainer and the server must "
            "share /dev/shm (same node)"
        )
    with safe_open(path, framework="pt") as f:
        for key in f.keys():
            yield key, f.get_tensor(key)


def _fetch(url: str) -> str:
    """Copy the trainer's weights file from URL into a local file; returns its path (the caller deletes it)."""
    import shutil
    import tempfile
    import urllib.request

    directory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    fd, path = tempfile.mkstemp(prefix="ogrpo-weights-pulled-", suffix=".safetensors", dir=directory)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=300) as resp:
            shutil.copyfileobj(resp, out, 1 << 20)
    except BaseException:
        os.unlink(path)
        raise
    return path


class CPUShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        self._in_update = False

    def start_weight_update(self) -> None:
        begin_reload(self.model)
        self._in_update = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # Overridden only to skip the base class's torch.accelerator.synchronize(), which raises on CPU torch;
        # loading here is synchronous anyway.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        if not getattr(self, "_in_update", False):
            # A load outside start/finish would be one reload per call, which is what gives NaN on CPU.
            raise RuntimeError("cpu_shm: /update_weights called without /start_weight_update first")
        source = update_info.path or update_info.url
        if not source:
            raise RuntimeError("cpu_shm: /update_weights needs update_info.path or update_info.url")
        local = update_info.path or _fetch(update_info.url)
        try:
            with_count = _Counting(_read_tensors(local))
            self.model.load_weights(with_count)
        finally:
            if not update_info.path:
                os.unlink(local)
        if update_info.num_tensors is not None and with_count.n != update_info.num_tensors:
            raise RuntimeError(
                f"cpu_shm: {source} held {with_count.n} tensors, the trainer announced "
                f"{update_info.num_tensors}"
            )
        log.info("cpu_shm: loaded %d tensors from %s", with_count.n, source)

    def finish_weight_update(self) -> None:
        if not getattr(self, "_in_update", False):
            return
        finish_reload(self.model, self.model_config)
        self._in_update = False

    def shutdown(self) -> None:
        self._in_update = False


class _Counting:
    """Iterator wrapper that counts what the model consumed."""

    def __init__(self, it):
        self._it = iter(it)
        self.n = 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._it)
        self.n += 1
        return item


def register() -> None:
    """Register `cpu_shm` in this process (idempotent)."""
    try:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, CPUShmWeightTransferEngine)
    except ValueError:  # already registered: the module may be imported by several extension lookups
        pass


register()


class CPUWeightSyncExtension:
    """Worker extension (mixed into vLLM's worker by `--worker-extension-cls`).

    Importing it registers `cpu_shm`; the method is a fallback reachable through `/collective_rpc` in dev mode
    for pushing a file without the start/update/finish protocol.
    """

    def ogrpo_reload_from_file(self, path: str) -> int:
        tensors = _Counting(_read_tensors(path))
        self.model_runner.reload_weights(weights_iterator=tensors)
        refresh_tied_lm_head(self.model_runner.model)
        return tensors.n
