"""Serving: `ogrpo serve` (server.py), the CPU weight-transfer backend (cpu_transfer.py) and the trainer-side
client (client.py). Nothing here imports vLLM at package import."""

# Names shared by the server (which selects them) and cpu_transfer (which registers them), kept here so that
# building the server command line does not import vLLM.
CPU_BACKEND = "cpu_shm"
CPU_EXTENSION_CLS = "ogrpo.serve.cpu_transfer.CPUWeightSyncExtension"

# On CPU the server's engine runs the model in its own process, with every core of the server's device set.
# vLLM's CPU platform otherwise splits it into an EngineCore process that busy-polls one core and a worker
# bound to the other(s): on 2 cores that halves generation throughput (ogrpo bench rollout, 78.7M bf16:
# 936 -> 1,662 tok/s). The OpenAI server keeps its EngineCore in a separate process either way.
CPU_SERVER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

# vLLM options every O-GRPO server gets from its plan (ogrpo/plan.py gives the reason): the offline `LLM` that
# TRL's own vllm-serve wraps has the same defaults.
SERVER_ARGS = {"disable_log_stats": True}
