"""`trl vllm-serve` (TRL 1.9, the GPU images' server) on CPU, and the trainer-side client that talks to it.

TRL 1.9's server and its `VLLMClient` move weights over an NCCL group: the client opens it with its CUDA
device's uuid (`init_communicator`), then for each parameter posts `/update_named_param/` and broadcasts the
tensor; each server worker receives it and calls `model.load_weights([(name, tensor)])`. On CPU three things
break: there is no CUDA uuid, NCCL needs a GPU, and vLLM's CPU build packs every linear weight after loading, so
a per-parameter load fails or gives NaN (ogrpo.patches.vllm_cpu_reload). Here only those pieces are replaced:

- the group is a gloo one with the interface TRL's code calls on its NCCL communicator (`broadcast(t, src=)`,
  `group.barrier()`), so TRL's own `update_named_param`, `generate`, `reset_prefix_cache` and
  `close_communicator` run unchanged on both sides;
- the server worker collects the received tensors and loads them in ONE layerwise reload when TRL's
  `sync_weights` ends with `/reset_prefix_cache/` (it always does), before the next generation;
- the server is TRL's own `trl.scripts.vllm_serve` (routes, request handling, data-parallel workers), started
  through `python -m ogrpo.serve.trl_serve_cpu ARGS` with `trl vllm-serve`'s arguments, behind the job-key
  guard like `ogrpo.serve.trl_api`; its engine gets the worker extension below instead of TRL's NCCL one
  (the swap in TRL's script: ogrpo.patches.trl_vllm_serve).

The GPU path is untouched: on a GPU node `ogrpo serve` starts `python -m trl.scripts.vllm_serve` itself.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

from ogrpo.patches import trl_vllm_client
from ogrpo.patches.vllm_cpu_reload import reload_weights
from ogrpo.serve import trl_stream
from ogrpo.serve.auth import install_client_key

EXTENSION_CLS = "ogrpo.serve.trl_serve_cpu.CPUWeightSyncExtension"
# Same prefix as TRL's XCCL branch, so the store keys cannot collide with anything else on the port.
_STORE_PREFIX = "client2server"
_TIMEOUT_S = float(os.environ.get("OGRPO_WEIGHT_SYNC_TIMEOUT_S", "600"))


class GlooCommunicator:
    """A gloo process group behind the two calls TRL 1.9 makes on its PyNcclCommunicator."""

    def __init__(self, pg: Any, store: Any):
        self.pg = pg
        self._store = store  # the master side's store must outlive the group
        self.group = self  # TRL calls `communicator.group.barrier()`

    def broadcast(self, tensor: Any, src: int) -> None:
        self.pg.broadcast(tensor, src).wait()

    def barrier(self) -> None:
        self.pg.barrier().wait()


def connect(host: str, port: int, rank: int, world_size: int) -> GlooCommunicator:
    """Join the weight-sync group: rank 0 (the first server worker) hosts the store, the trainer is the last rank."""
    from torch import distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=_TIMEOUT_S)
    store = dist.TCPStore(host_name=host, port=port, world_size=world_size, is_master=(rank == 0),
                          timeout=timeout)
    pg = c10d.ProcessGroupGloo(c10d.PrefixStore(_STORE_PREFIX, store), rank, world_size, timeout)
    return GlooCommunicator(pg, store)


# ---- server side ----------------------------------------------------------------------------------------


def _extension_base():
    from trl.scripts.vllm_serve import WeightSyncWorkerExtension

    return WeightSyncWorkerExtension


class CPUWeightSyncExtension(_extension_base()):
    """TRL's worker extension with a gloo group and one deferred, layerwise load per sync."""

    _pending: list | None = None

    def init_communicator(self, host: str, port: int, world_size: int, client_device_uuid: str) -> None:
        from vllm.distributed.parallel_state import get_world_group

        if self.communicator is not None:
            raise RuntimeError("Weight update group already initialized. Call close_communicator first.")
        self.communicator = connect(host, port, get_world_group().rank, world_size)
        self.client_rank = world_size - 1
        self._pending = []

    def update_named_param(self, name: str, dtype: str, shape) -> None:
        import torch

        if self.communicator is None:
            raise RuntimeError("Communicator not initialized. Call `init_communicator` first.")
        weight = torch.empty(tuple(shape), dtype=getattr(torch, dtype.split(".")[-1]))
        self.communicator.broadcast(weight, src=self.client_rank)
        self.communicator.group.barrier()
        self._pending.append((name, weight))

    def ogrpo_load_pending(self) -> int:
        """Load what arrived since the last call as one layerwise reload; returns the number of tensors."""
        pending, self._pending = self._pending or [], []
        if pending:
            runner = self.model_runner
            reload_weights(runner.model, runner.model_config, pending)
        return len(pending)

    def close_communicator(self) -> None:
        super().close_communicator()
        self._pending = []


def _cpu_llm(base):
    class CPUWeightSyncLLM(base):
        """vLLM's LLM as TRL's server builds it, with the CPU extension, loading pushed weights before the
        prefix cache is reset (the last call of every TRL weight sync)."""

        def __init__(self, *args, **kwargs):
            kwargs["worker_extension_cls"] = EXTENSION_CLS
            super().__init__(*args, **kwargs)

        def reset_prefix_cache(self, *args, **kwargs):
            self.collective_rpc("ogrpo_load_pending")
            return super().reset_prefix_cache(*args, **kwargs)

    return CPUWeightSyncLLM


def main(argv: list[str] | None = None) -> None:
    """TRL's `vllm-serve` main, with its own argument parser, on CPU, behind the job-key guard."""
    trl_stream.serve("ogrpo.serve.trl_serve_cpu", _cpu_llm, argv)  # its engine workers build CPUWeightSyncLLM


# ---- trainer side ---------------------------------------------------------------------------------------


def _client_cls():
    import atexit
    import time

    from trl.generation.vllm_client import VLLMClient

    class TrlServeCPUClient(VLLMClient):
        """TRL 1.9's VLLMClient whose weight-sync group is gloo: everything but `init_communicator` is TRL's."""

        def init_communicator(self, device: Any = 0) -> None:
            response = self.session.get(f"{self.base_url}/get_world_size/")
            if response.status_code != 200:
                raise RuntimeError(f"Request failed: {response.status_code}, {response.text}")
            world_size = response.json()["world_size"] + 1  # the server's workers and this client
            self.rank = world_size - 1
            response = self.session.post(f"{self.base_url}/init_communicator/", json={
                "host": "0.0.0.0", "port": self.group_port, "world_size": world_size,
                "client_device_uuid": "cpu"})
            if response.status_code != 200:
                raise RuntimeError(f"Request failed: {response.status_code}, {response.text}")
            time.sleep(0.1)  # as TRL: lets the server's worker open the store first
            self.communicator = connect(self.host, self.group_port, self.rank, world_size)
            print(f"ogrpo: weight push to {self.base_url}: gloo group on port {self.group_port} "
                  f"(trl vllm-serve on CPU)", flush=True)
            atexit.register(self.close_communicator)

    return TrlServeCPUClient


def install_client():
    """Make TRL 1.9's server-mode generation use the gloo client (sending the job key). Returns the class."""
    install_client_key()

    cls = _client_cls()
    trl_vllm_client.install_client_class(cls)
    return cls


if __name__ == "__main__":
    main()
