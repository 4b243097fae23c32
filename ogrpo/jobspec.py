"""A job as data: the steps one allocation runs, made from a Plan.

Both the rendered `job.sbatch` and the Python supervisor (local and Slurm backends) are built from the same
JobSpec, so what a user reads and what runs cannot drift apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ogrpo import compat, layout
from ogrpo.planner.host_memory import step_host_gib
from ogrpo.placeholders import PLACEHOLDERS, fill_argv  # noqa: F401  (PLACEHOLDERS: the steps' vocabulary)
from ogrpo.planner.device_rules import rules_of

@dataclass
class Step:
    role: str  # "server" | "trainer"
    nodes: list[int]  # node indices within the allocation
    gpus: list[int]  # device indices within each node (empty on CPU)
    ntasks: int  # tasks (processes launched by srun) for this step; accelerate spawns the rest
    argv: list[str]  # the command, with ogrpo.placeholders' names ({server_port}, {job_dir} ...)
    env: dict[str, str] = field(default_factory=dict)
    host_mem_gib: float = 0.0  # host RAM per node (ogrpo.planner.host_memory): what the Slurm job asks for (--mem)


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


def fill(argv: list[str], values: dict[str, object]) -> list[str]:
    """Replace the {placeholders} (ogrpo.placeholders.PLACEHOLDERS) in argv; others are left alone."""
    return fill_argv(argv, values)


def build_jobspec(plan, run_config, job_dir) -> JobSpec:
    """The steps of one job for a Plan: a server step when the plan has one, then the
    trainer."""
    p = plan
    rules = rules_of(p)
    host_gib = step_host_gib(p)
    steps: list[Step] = []
    if p.has_server:
        v = p.vllm
        steps.append(Step(
            role="server", nodes=list(v.nodes), gpus=rules.step_gpus(v.gpus), ntasks=1,
            argv=["ogrpo", "serve", "--config", "{job_dir}/run.yaml", "--host", "{server_host}", "--port",
                  "{server_port}"],
            env={**p.env, **v.env}, host_mem_gib=host_gib["server"],
        ))
    t = p.trainer
    n_nodes = len(t.nodes)
    argv = ["accelerate", "launch", "--config_file", "{job_dir}/accelerate.yaml"]
    argv += rules.launcher_flags(int(t.num_processes))
    argv += ["--num_processes", str(t.num_processes)]
    if n_nodes > 1:
        argv += ["--num_machines", str(n_nodes), "--machine_rank", "{node_rank}"]
    argv += ["--main_process_ip", "{rendezvous_host}", "--main_process_port", "{rendezvous_port}",
             "-m", "ogrpo.train", "--config", "{job_dir}/run.yaml", "--output-dir", "{job_dir}/" + layout.RUN,
             # a requeued job (preemption, time limit) reruns this same command and must continue from the last
             # complete checkpoint; a fresh run directory simply starts at step 0
             "--resume", "auto"]
    if p.has_server:
        argv += ["--vllm-url", "http://{server_host}:{server_port}", "--set", "vllm_group_port={group_port}"]
    steps.append(Step(role="trainer", nodes=list(t.nodes), gpus=rules.step_gpus(t.gpus),
                      ntasks=n_nodes, argv=argv, env={**p.env, **t.env},
                      host_mem_gib=host_gib["trainer"]))
    opts = getattr(run_config, "ogrpo", None)
    name = getattr(opts, "job_name", None) or _default_name(p)
    # The server the job's TRL line talks to decides the health path (`/health` vs TRL's `/health/`).
    health = compat.health_path(compat.plan_server_flavor(p))
    return JobSpec(name=name, job_dir=str(job_dir), steps=steps, health_path=health,
                   health_timeout_s=rules.server_health_timeout_s, env=dict(p.env))


def _default_name(p) -> str:
    model = str(p.model.name or "model").rstrip("/").split("/")[-1]
    safe = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in model)
    return f"ogrpo-{safe}"[:64]
