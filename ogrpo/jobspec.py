"""A job as data: the steps one allocation runs, made from a Plan.

Both the rendered `job.sbatch` and the Python supervisor (local and Slurm backends) are built from the same
JobSpec, so what a user reads and what runs cannot drift apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ogrpo import compat
from ogrpo.host_memory import step_host_gib

@dataclass
class Step:
    role: str  # "server" | "trainer"
    nodes: list[int]  # node indices within the allocation
    gpus: list[int]  # device indices within each node (empty on CPU)
    ntasks: int  # tasks (processes launched by srun) for this step; accelerate spawns the rest
    argv: list[str]  # the command, with the PLACEHOLDERS below ({server_port}, {job_dir} ...)
    env: dict[str, str] = field(default_factory=dict)
    host_mem_gib: float = 0.0  # host RAM per node (ogrpo.host_memory): what the Slurm job asks for (--mem)


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


# Placeholders in Step.argv, filled by whoever runs the step (the rendered sbatch as bash variables, the
# Python supervisor with real values):
#   {job_dir}          the job directory (run.yaml, accelerate.yaml, deepspeed.json, run/, logs/)
#   {server_host}      the address the vLLM server binds and the trainer connects to (never 0.0.0.0)
#   {server_port}      the server's port (Slurm: ogrpo.launch.ports.pick_slurm_ports; locally a free port)
#   {rendezvous_host}  the trainer's main process address (accelerate --main_process_ip)
#   {rendezvous_port}  the trainer's rendezvous port (chosen like the server's)
#   {group_port}       TRL's weight-sync group port (GRPOConfig.vllm_group_port; TRL's fixed default 51216 would
#                      collide between two jobs on one node), chosen like the server's
#   {node_rank}        this trainer node's rank (0..nodes-1); only in multi-node trainer steps
PLACEHOLDERS = ("job_dir", "server_host", "server_port", "rendezvous_host", "rendezvous_port", "group_port",
                "node_rank")


def fill(argv: list[str], values: dict[str, object]) -> list[str]:
    """Replace the {placeholders} in argv (unknown braces are left alone)."""
    out = []
    for arg in argv:
        for key in PLACEHOLDERS:
            if key in values:
                arg = arg.replace("{" + key + "}", str(values[key]))
        out.append(arg)
    return out


def _plan_dict(plan) -> dict:
    return plan.to_dict() if hasattr(plan, "to_dict") else dict(plan)


def build_jobspec(plan, run_config, job_dir) -> JobSpec:
    """The steps of one job for a Plan (or its dict): a server step when the plan has one, then the trainer."""
    p = _plan_dict(plan)
    host_gib = step_host_gib(p)
    is_cpu = bool(p.get("cluster", {}).get("gpu", {}).get("is_cpu"))
    mode = p["mode"]
    steps: list[Step] = []
    if mode == "server":
        v = p["vllm"]
        steps.append(Step(
            role="server", nodes=list(v["nodes"]), gpus=[] if is_cpu else list(v["gpus"]), ntasks=1,
            argv=["ogrpo", "serve", "--config", "{job_dir}/run.yaml", "--host", "{server_host}", "--port",
                  "{server_port}"],
            env={**p.get("env", {}), **v.get("env", {})}, host_mem_gib=host_gib["server"],
        ))
    t = p["trainer"]
    n_nodes = len(t["nodes"])
    argv = ["accelerate", "launch", "--config_file", "{job_dir}/accelerate.yaml"]
    if is_cpu and t["num_processes"] >= 2:
        # `--cpu --num_processes 2` silently starts ONE process; --multi_gpu with use_cpu in the config
        # starts real gloo workers (shared/vllm-cpu/README.md).
        argv.append("--multi_gpu")
    argv += ["--num_processes", str(t["num_processes"])]
    if n_nodes > 1:
        argv += ["--num_machines", str(n_nodes), "--machine_rank", "{node_rank}"]
    argv += ["--main_process_ip", "{rendezvous_host}", "--main_process_port", "{rendezvous_port}",
             "-m", "ogrpo.train", "--config", "{job_dir}/run.yaml", "--output-dir", "{job_dir}/run",
             # a requeued job (preemption, time limit) reruns this same command and must continue from the last
             # complete checkpoint; a fresh run directory simply starts at step 0
             "--resume", "auto"]
    if mode == "server":
        argv += ["--vllm-url", "http://{server_host}:{server_port}", "--set", "vllm_group_port={group_port}"]
    steps.append(Step(role="trainer", nodes=list(t["nodes"]), gpus=[] if is_cpu else list(t["gpus"]),
                      ntasks=n_nodes, argv=argv, env={**p.get("env", {}), **t.get("env", {})},
                      host_mem_gib=host_gib["trainer"]))
    opts = getattr(run_config, "ogrpo", None)
    name = getattr(opts, "job_name", None) or _default_name(p)
    # The server the job's TRL line talks to decides the health path (`/health` vs TRL's `/health/`).
    health = compat.health_path(compat.plan_server_flavor(p))
    return JobSpec(name=name, job_dir=str(job_dir), steps=steps, health_path=health,
                   health_timeout_s=600 if is_cpu else 900, env=dict(p.get("env", {})))


def _default_name(p: dict) -> str:
    model = str(p.get("model", {}).get("name", "model")).rstrip("/").split("/")[-1]
    safe = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in model)
    return f"ogrpo-{safe}"[:64]
