"""Serving: `ogrpo serve` (server.py), the CPU weight-transfer backend (cpu_transfer.py) and the trainer-side
client (client.py). Nothing here imports vLLM at package import."""

# Names shared by the server (which selects them) and cpu_transfer (which registers them), kept here so that
# building the server command line does not import vLLM.
CPU_BACKEND = "cpu_shm"
CPU_EXTENSION_CLS = "ogrpo.serve.cpu_transfer.CPUWeightSyncExtension"
