"""Fake GPUs on the test cluster: stand-ins for the two entry points a job's steps call by name.

The test cluster's GPUs are character devices (tests/slurm/cluster.sh): Slurm allocates them per step (GRES) and
sets CUDA_VISIBLE_DEVICES, but nothing can compute on them, and a GPU plan's settings (fp16, flash-attention,
NCCL) cannot run on this machine's CPU. So everything up to a step's own process is the product, unchanged:
`ogrpo submit --gpus 3xA40` plans, renders and submits the GPU plan (job.sbatch, run.yaml, accelerate.yaml,
manifest.json with its changes), and the supervisor starts the srun steps with their GPUs. Only `ogrpo serve`
and `accelerate launch`, first on PATH (`env()`), are stand-ins. Each one:

1. rebuilds the GPU plan's step for its role from the job's run.yaml and checks that the command it was given
   is that step, filled in (so a test also proves the job ran the rendered steps);
2. plans the same run config for the CPU of the same layout (`NxCPU` for N GPUs: same server/trainer split,
   same trainer processes; refuses when they differ);
3. runs the real entry point with that CPU plan's command and environment for the role (run.yaml and
   accelerate.yaml written to JOB_DIR/fake-gpus/ROLE/), and records both commands in JOB_DIR/fake-gpus/ROLE.json.

What a test on fake GPUs can check: the submitted job and its allocation, the devices each step saw, the GPU plan
and its changes (the job's manifest.json), and that the real server and trainer run it to the end; not the
numerics of the GPU settings: the run directory's own manifest.json records the CPU plan that ran.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from pathlib import Path

# The command whose role a stand-in plays: (tool, first argument) -> role.
ROLES = {("ogrpo", "serve"): "server", ("accelerate", "launch"): "trainer"}
RECORD_DIR = "fake-gpus"


@functools.cache
def env() -> dict[str, str]:
    """The environment for `ogrpo submit` (sbatch exports it to the job, srun to the steps): the stand-ins first
    on PATH, then this Python's own bin dir, so that the supervisor puts nothing in front of them."""
    from stand_ins import path_env  # here, not at the top: the stand-ins run this file as a script

    return path_env(__file__, "ogrpo-fake-gpus-")


def record(job_dir: Path, role: str) -> dict:
    """What the stand-in of ROLE ran in JOB_DIR (written before it started the real entry point)."""
    return json.loads((Path(job_dir) / RECORD_DIR / f"{role}.json").read_text())


def _values(template: list[str], argv: list[str]) -> dict[str, str] | None:
    """The placeholder values that make TEMPLATE (a JobSpec step's argv) into ARGV, or None if no values do."""
    from ogrpo.jobspec import PLACEHOLDERS, fill

    if len(template) != len(argv):
        return None
    values: dict[str, str] = {}
    names = "|".join(PLACEHOLDERS)
    for tok, arg in zip(template, argv):
        parts = re.split(r"\{(" + names + r")\}", tok)
        pattern = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>.+?)" for i, p in enumerate(parts))
        m = re.fullmatch(pattern, arg)
        if m is None:
            return None
        for key, value in m.groupdict().items():
            if values.setdefault(key, value) != value:
                return None
    return values if fill(template, values) == argv else None


def _cpu_twin(job_dir: Path, role: str, argv: list[str]) -> tuple[list[str], dict[str, str], dict]:
    """(argv, env) of the CPU plan's ROLE step standing in for the GPU step ARGV of the job in JOB_DIR."""
    from ogrpo.config import dump_yaml, load_run_config
    from ogrpo.jobspec import build_jobspec, fill
    from ogrpo.plan import Plan, plan_from_config
    from ogrpo.render import accelerate_config, run_yaml

    rc = load_run_config(str(job_dir / "run.yaml"))
    gpu_plan = rc.ogrpo.plan  # the dict form the job carries (read below); the job's code takes the Plan
    gpu_step = build_jobspec(Plan.from_dict(gpu_plan), rc, job_dir).step(role)
    values = _values(gpu_step.argv, argv) if gpu_step else None
    if values is None:
        raise SystemExit(f"fake GPUs: {argv} is not the {role} step of {job_dir}/run.yaml's plan "
                         f"({gpu_step.argv if gpu_step else 'no such step'})")
    cluster = gpu_plan["cluster"]
    if int(cluster["nodes"]) != 1:
        raise SystemExit("fake GPUs: one-node plans only (a CPU plan is one machine)")
    n = int(cluster["gpus_per_node"])
    if gpu_plan.get("mode") in ("server", "colocate") and rc.ogrpo.use_vllm is None:
        # the GPU plan's vLLM placement, kept: left open, the CPU's measured costs may generate in the trainer
        rc = load_run_config(str(job_dir / "run.yaml"), {"ogrpo": {"use_vllm": True}})
    cpu = plan_from_config(rc, gpus=f"{n}xcpu" if n > 1 else "cpu")
    cpu_plan = cpu.to_dict()
    twin_dir = job_dir / RECORD_DIR / role
    cpu_spec = build_jobspec(cpu, rc, twin_dir)
    cpu_step = cpu_spec.step(role)
    layout = lambda p: (p["mode"], p["trainer"]["num_processes"])  # noqa: E731
    if cpu_step is None or layout(cpu_plan) != layout(gpu_plan):
        raise SystemExit(f"fake GPUs: the {n}xcpu plan (mode, trainer processes) {layout(cpu_plan)} differs from "
                         f"the GPU plan's {layout(gpu_plan)}; set ogrpo.vllm_gpus so both agree")
    twin_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("run.yaml", run_yaml(cpu, rc)),
                       ("accelerate.yaml", dump_yaml(accelerate_config(cpu, str(job_dir))))):
        tmp = twin_dir / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, twin_dir / name)
    # the twin's own files from twin_dir, everything else (run/, ports, hosts) as the GPU step had it
    template = [a.replace("{job_dir}/run.yaml", str(twin_dir / "run.yaml"))
                .replace("{job_dir}/accelerate.yaml", str(twin_dir / "accelerate.yaml")) for a in cpu_step.argv]
    env = {**cpu_spec.env, **cpu_step.env}
    return fill(template, values), env, cpu_plan


def main(tool: str, args: list[str]) -> None:
    real = str(Path(sys.executable).parent / tool)
    role = ROLES.get((tool, args[0] if args else ""))
    if role is None:  # any other use of the entry point is not a step: the real one, unchanged
        os.execv(real, [real, *args])
    argv = [tool, *args]
    config = Path(args[args.index("--config") + 1]) if "--config" in args else None
    if config is None or config.name != "run.yaml":
        raise SystemExit(f"fake GPUs: {argv}: no --config JOB_DIR/run.yaml")
    job_dir = config.parent
    cpu_argv, env, cpu_plan = _cpu_twin(job_dir, role, argv)
    rec = {"role": role, "gpu_argv": argv, "cpu_argv": cpu_argv, "env": env,
           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "cpu_plan": cpu_plan["cluster"]["spec"]}
    (job_dir / RECORD_DIR / f"{role}.json").write_text(json.dumps(rec, indent=2) + "\n")
    print(f"[fake GPUs] {role}: the {cpu_plan['cluster']['spec']} plan's step for the GPU step\n  {' '.join(argv)}\n"
          f"  -> {' '.join(cpu_argv)}", flush=True)
    os.environ.update(env)
    os.execv(real, [real, *cpu_argv[1:]])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
