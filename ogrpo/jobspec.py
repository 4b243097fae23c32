"""A job as data: the steps one allocation runs, made from a Plan.

Both the rendered `job.sbatch` and the Python supervisor (local and Slurm backends) are built from the same
JobSpec, so what a user reads and what runs cannot drift apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# Under Slurm every job gets its own ports, derived from the job id so that two jobs on one node never
# collide and a requeued job (same id) finds the same ports. 3 ports per job: server, rendezvous, spare.
SLURM_PORT_BASE = 20000
SLURM_PORT_STRIDE = 3
SLURM_PORT_SLOTS = 10000


def slurm_ports(job_id: int) -> tuple[int, int]:
    """(server_port, rendezvous_port) for a Slurm job id; the sbatch computes the same in bash."""
    server = SLURM_PORT_BASE + (job_id % SLURM_PORT_SLOTS) * SLURM_PORT_STRIDE
    return server, server + 1


@dataclass
class Step:
    role: str  # "server" | "trainer"
    nodes: list[int]  # node indices within the allocation
    gpus: list[int]  # device indices within each node (empty on CPU)
    ntasks: int  # tasks (processes launched by srun) for this step; accelerate spawns the rest
    argv: list[str]  # the command, with {server_port}, {rendezvous_port}, {server_host}, {job_dir} placeholders
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class JobSpec:
    name: str
    job_dir: str
    steps: list[Step]
    health_path: str = "/health"
    health_timeout_s: int = 900
    env: dict[str, str] = field(default_factory=dict)  # for every step

    def step(self, role: str) -> Step | None:
        return next((s for s in self.steps if s.role == role), None)

    def to_dict(self) -> dict:
        return asdict(self)
