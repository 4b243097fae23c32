"""One home for placeholder filling: `{name}` in a job's step commands.

Step placeholders (Step.argv and env, ogrpo.jobspec) are filled by whoever runs the step: the Python supervisor
with real values, the Slurm step wrapper with `{node_rank}`. Only the names below are replaced, so JSON in an
argument (`{"backend": ...}`) stays intact, and a name without a value is left for a later filler.

    {job_dir}          the job directory (run.yaml, accelerate.yaml, deepspeed.json, run/, logs/)
    {server_host}      the address the vLLM server binds and the trainer connects to (never 0.0.0.0)
    {server_port}      the server's port (Slurm: ogrpo.launch.ports.pick_slurm_ports; locally a free port)
    {rendezvous_host}  the trainer's main process address (accelerate --main_process_ip)
    {rendezvous_port}  the trainer's rendezvous port (chosen like the server's)
    {group_port}       TRL's weight-sync group port (GRPOConfig.vllm_group_port; TRL's fixed default 51216 would
                       collide between two jobs on one node), chosen like the server's
    {node_rank}        this trainer node's rank (0..nodes-1); only in multi-node trainer steps
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

PLACEHOLDERS = ("job_dir", "server_host", "server_port", "rendezvous_host", "rendezvous_port", "group_port",
                "node_rank")
_STEP = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")


def fill_text(text: str, values: Mapping[str, object]) -> str:
    """`text` with each step placeholder that has a value replaced; others stay as they are."""
    return _STEP.sub(lambda m: str(values[m.group(1)]) if m.group(1) in values else m.group(0), text)


def fill_argv(argv: Iterable[str], values: Mapping[str, object]) -> list[str]:
    return [fill_text(a, values) for a in argv]
