"""Serving: `ogrpo serve` (server.py), the CPU weight-transfer backend (cpu_transfer.py) and the trainer-side
client (client.py). Nothing here imports vLLM at package import."""

from ogrpo.planner.settings import SERVER_ARGS

# Names shared by the server (which selects them) and cpu_transfer (which registers them), kept here so that
# building the server command line does not import vLLM.
CPU_BACKEND = "cpu_shm"
CPU_EXTENSION_CLS = "ogrpo.serve.cpu_transfer.CPUWeightSyncExtension"


def __getattr__(name: str):
    # The server's arguments are the planner's decision (ogrpo/planner/settings.py); `ogrpo bench rollout` still
    # reads them here. Looked up on first use, so that importing this package stays free of the planner.
    if name == "SERVER_ARGS":
        return SERVER_ARGS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
