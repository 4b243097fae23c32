"""`ogrpo submit`, `status`, `logs`, `cancel` (owned by the Slurm area).

Implementations are imported inside the functions so that `ogrpo --help` stays fast.
"""

from __future__ import annotations

from typing import Optional

import typer

from ogrpo.errors import OgrpoError

GPUS_HELP = "Cluster: [NODESx]COUNTxTYPE[-MEM], e.g. 3xA40, 4xV100-16G, 2x8xA100-80G, cpu."
CONFIG_HELP = "Run config: TRL flat recipe YAML (with an optional `ogrpo:` section) or a built-in recipe name."
JOB_HELP = "Slurm job id or the job's run directory (Slurm or --backend local)."


def _ref(job: str) -> str:
    """JOB as given; an empty one is refused (as a path it would be the current directory)."""
    if not job.strip():
        raise OgrpoError("JOB is empty: give a Slurm job id or the job's run directory")
    return job


def _default_job_dir(name: str) -> str:
    import os
    import time

    return os.path.abspath(os.path.join("ogrpo-jobs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"))


def _summary(p, spec) -> list[str]:
    lines = [f"plan: {p.cluster.spec}, model {p.model.name}, mode {p.mode}, precision {p.precision}"]
    for s in spec.steps:
        what = f"GPUs {s.gpus}" if s.gpus else "CPU"
        lines.append(f"  {s.role}: nodes {s.nodes}, {what}, {s.ntasks} task(s)")
    lines.append(f"  training: {p.trainer.num_processes} process(es), {p.trainer.strategy}")
    return lines


def submit(
    gpus: Optional[str] = typer.Option(None, "--gpus", help=GPUS_HELP),
    config: str = typer.Option(..., "--config", "-c", help=CONFIG_HELP),
    partition: Optional[str] = typer.Option(None, "--partition", "-p", help="Slurm partition."),
    gres_type: Optional[str] = typer.Option(None, "--gres-type", help="Slurm GRES type of the GPUs "
                                            "(--gres=gpu:TYPE:N; default: the catalog's, e.g. a40, v100; 'any': "
                                            "untyped). Also ogrpo.gres_type."),
    time_limit: Optional[str] = typer.Option(None, "--time", "-t", help="Time limit: minutes, HH:MM:SS or D-HH:MM."),
    account: Optional[str] = typer.Option(None, "--account", "-A", help="Slurm account to charge."),
    qos: Optional[str] = typer.Option(None, "--qos", help="Slurm QOS."),
    nodes: Optional[int] = typer.Option(None, "--nodes", "-N", help="Nodes (default: the plan's)."),
    container: Optional[str] = typer.Option(None, "--container", help="Image every step runs in (.sif, docker://, .sqsh)."),
    container_runtime: Optional[str] = typer.Option(
        None, "--container-runtime", help="apptainer | singularity | pyxis | none (default: detected)."),
    slurm: Optional[list[str]] = typer.Option(None, "--slurm", help="Extra sbatch option KEY=VALUE (repeatable)."),
    backend: Optional[str] = typer.Option(None, "--backend", help="slurm | local (default: slurm when sbatch is on PATH)."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Run directory (default: ./ogrpo-jobs/NAME-TIME)."),
    max_requeues: Optional[int] = typer.Option(None, "--max-requeues", help="Requeues allowed after preemption / "
                                               "time limit (default: 3)."),
    signal_delay: Optional[int] = typer.Option(
        None, "--signal-delay", help="Seconds before the time limit to checkpoint (>= 30; default: one step + "
        "checkpoint + server stop, at least 90)."),
    profile: Optional[str] = typer.Option(None, "--profile", help="conservative | balanced | aggressive."),
    model: Optional[str] = typer.Option(None, "--model", help="Model to plan for (overrides model_name_or_path)."),
    params: Optional[str] = typer.Option(None, "--params", help="Parameter count when the model is unknown: 7B."),
    vllm_gpus: Optional[int] = typer.Option(None, "--vllm-gpus", help="GPUs for the vLLM server (0: colocate)."),
    strategy: Optional[str] = typer.Option(None, "--strategy", help="Trainer strategy: ddp | zero2 | zero3 | "
                                           "zero3_offload (default: the cheapest that fits; DDP on CPU)."),
    overlap: Optional[str] = typer.Option(None, "--overlap", help="Server and trainer at work together on the "
                                          "split placement: off | lossless | one-step (default: the plan's)."),
    force: bool = typer.Option(False, "--force", help="Submit even when the plan does not fit, and over the files "
                               "of an earlier job in the run directory."),
    strict: bool = typer.Option(False, "--strict", help="Refuse (exit 2) when the run would differ from the "
                                "recipe in any way, instead of listing the changes."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would be submitted; submit nothing."),
    detach: bool = typer.Option(False, "--detach", help="--backend local: run in the background and return "
                                "(then: ogrpo status/logs/cancel RUN_DIR). Slurm jobs always run detached."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout: {exit_code, output: "
                                 "[lines]}, or {errors: [...]} on failure (ogrpo/cli.py collects it)."),
) -> None:
    """Plan, render and submit a job (Slurm: `sbatch job.sbatch`, or run it here with --backend local)."""
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.jobspec import build_jobspec
    from ogrpo.render import render_job, write_job

    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.commands.backend import default_backend, refuse_slurm_flags

    backend = default_backend(backend, dry_run, gpus, config)
    refuse_slurm_flags(backend, {"--partition": partition, "--gres-type": gres_type, "--time": time_limit,
                                 "--account": account, "--qos": qos, "--nodes": nodes, "--container": container,
                                 "--container-runtime": container_runtime, "--slurm": slurm,
                                 "--max-requeues": max_requeues, "--signal-delay": signal_delay})
    max_requeues = 3 if max_requeues is None else max_requeues
    rc, plan, job_dir, signal_delay = _plan(
        backend, gpus, config, model, params, profile, vllm_gpus, strict, force, dry_run, output, signal_delay, slurm,
        max_requeues=max_requeues,
        extra={"partition": partition, "account": account, "qos": qos, "time": time_limit, "container": container,
               "strategy": strategy, "overlap": overlap, "gres_type": gres_type})
    spec = build_jobspec(plan, rc, job_dir)
    executor = _executor(backend, plan, rc, spec, detach, nodes=nodes, time_limit=time_limit, slurm=slurm,
                         signal_delay=signal_delay, max_requeues=max_requeues, container_runtime=container_runtime)
    # the one job.sbatch: what --dry-run shows, what `render` writes for the same inputs, what sbatch gets
    files = render_job(plan, rc, spec, **({"slurm": executor.opts} if backend == "slurm" else {}))
    summary = _summary(plan, spec)
    if dry_run:
        typer.echo("\n".join([*summary, *executor.dry_run(spec, files)]))
        return
    write_job(files, job_dir, force=force)
    if backend == "local" and not detach:
        typer.echo("\n".join(summary) + f"\nrunning locally in {job_dir}")
    job = executor.submit(spec)
    if backend == "local" and not detach:
        raise typer.Exit(job.exit_code() or 0)
    typer.echo("\n".join(_submitted(job, spec, summary)))


def _plan(backend, gpus, config, model, params, profile, vllm_gpus, strict, force, dry_run, output, signal_delay,
          slurm_items, extra, max_requeues=None):
    """The run config and the plan for it, with what the backend needs checked: (run config, plan, run dir,
    signal delay)."""
    import os

    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.commands.planning import load_and_plan, require_fit, warn
    from ogrpo.launch import slurm as sl

    sl.parse_passthrough(slurm_items)  # bad --slurm or --time input is the one line before any planning
    sl.check_requeue_options(signal_delay, max_requeues)
    if extra.get("time"):
        sl.parse_time(extra["time"])

    def cluster_facts(run_config):
        """KillWait/GraceTime, the step time an earlier attempt in -o DIR recorded (a default run directory is
        new: its name has the time) and --signal-delay: the plan's signal lead time and save_steps follow."""
        if backend != "slurm":
            return None
        # CLI latency: `ogrpo --help` imports this module
        from ogrpo.launch.slurm import grace

        return grace.gather(run_config, job_dir=os.path.abspath(output) if output else None,
                            partition=extra.get("partition"), signal_delay_s=signal_delay)

    rc, plan = load_and_plan(config, gpus, model, params, profile, vllm_gpus, extra=extra, strict=strict,
                             preemption=cluster_facts)
    if backend == "local":
        # CLI latency: `ogrpo --help` imports this module
        from ogrpo.commands.backend import check_local

        check_local([(rc, plan)], dry_run, "ogrpo submit", "submit it to Slurm")
    job_dir = os.path.abspath(output) if output else _default_job_dir(rc.ogrpo.job_name or "ogrpo")
    if backend == "slurm":
        signal_delay = plan.preemption.signal_delay_s
    warn(rc, plan)
    require_fit(plan, force, "submit anyway")
    return rc, plan, job_dir, signal_delay


def _executor(backend, plan, rc, spec, detach, *, nodes, time_limit, slurm, signal_delay, max_requeues,
              container_runtime):
    """The executor with its options; Slurm's checked against the cluster (preflight) before anything is written."""
    import shutil

    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.launch import slurm as sl
    from ogrpo.launch.containers import make_container
    from ogrpo.launch.executor import LocalExecutor, SlurmExecutor

    if backend == "local":
        return LocalExecutor(detach=detach)
    if container_runtime is not None:
        make_container(rc.ogrpo.container, container_runtime, [spec.job_dir])  # refuses a bad runtime first
    opts = sl.options_for(plan, rc, nodes=nodes, time_min=sl.parse_time(time_limit) if time_limit else None,
                          extra=sl.parse_passthrough(slurm), signal_delay_s=signal_delay, max_requeues=max_requeues,
                          container_runtime=container_runtime, job_name=spec.name)
    return SlurmExecutor(sl.preflight(spec, opts) if shutil.which("sbatch") else opts)


def _submitted(job, spec, summary: list[str]) -> list[str]:
    """What `submit` prints for a job it started in the background."""
    if job.backend == "local":
        rec = job.record()
        return [*summary, f"started job {job.job_id} in the background (pid {rec['pid']})",
                f"run dir:    {job.job_dir}",
                *(f"{role + ':':11} {' '.join(str(p) for p in job.log_files(role))}"
                  for role in ("supervisor", *dict.fromkeys(s.role for s in spec.steps))),
                f"follow with: ogrpo logs {job.job_dir} --follow   (status: ogrpo status {job.job_dir}, "
                f"stop: ogrpo cancel {job.job_dir})"]
    sub = job.submitted
    return [f"submitted job {sub.job_id}", f"run dir:    {sub.job_dir}",
            f"job:        {sub.job_dir}/job.sbatch", f"supervisor: {sub.supervisor_log}",
            *(f"{role + ':':11} {path}" for role, path in sub.logs.items()), *summary,
            f"follow with: ogrpo logs {sub.job_id} --follow   (status: ogrpo status {sub.job_id})"]


def status(
    job: str = typer.Argument(..., help=JOB_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the status as JSON."),
) -> None:
    """State of a job: Slurm state and steps, requeues, devices each role saw, last checkpoint and metrics. A sweep
    (its directory or id): one row per point."""
    import json

    job = _ref(job)
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.sweep.manifest import find as find_sweep

    if (sweep := find_sweep(job)) is not None:
        # heavy: typer
        from ogrpo.commands.sweeping import print_status

        return print_status(sweep, as_json)
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.launch.executor import find

    info = find(job).status()
    if as_json:
        typer.echo(json.dumps(info, indent=2, default=str))
        return
    head = f"job {info.get('job_id')}: {info.get('state')}"
    if info.get("reason") and info["reason"] not in ("None", ""):
        head += f" ({info['reason']})"
    if info.get("elapsed"):
        head += f", elapsed {info['elapsed']}"
    if info.get("exit_code"):
        head += f", exit {info['exit_code']}"
    typer.echo(head)
    if info.get("backend") == "local":
        typer.echo(f"local run: pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}")
    if info.get("message"):
        typer.echo(info["message"])
    for s in info.get("steps", []):
        typer.echo(f"  step {s['id']} {s['name']}: {s['state']} (exit {s['exit_code']})")
    if "job_dir" in info:
        typer.echo(f"run dir: {info['job_dir']}")
        req = f"requeues: {info.get('requeues', 0)}"
        if info.get("max_requeues") is not None:
            req += f" of {info['max_requeues']}"
        if "attempts" in info:  # Slurm's requeue bookkeeping
            typer.echo(f"attempts: {info.get('attempts', 0)}, {req}")
        for role, dev in info.get("devices", {}).items():
            typer.echo(f"  {role} saw CUDA_VISIBLE_DEVICES={dev}" if dev is not None else
                       f"  {role}: CPU step (no GPU, CUDA_VISIBLE_DEVICES unset)")
        if info.get("last_checkpoint"):
            typer.echo(f"last checkpoint: {info['last_checkpoint']}")
        if info.get("last_metrics"):
            typer.echo(f"last metrics: {json.dumps(info['last_metrics'])}")


def logs(
    job: str = typer.Argument(..., help=JOB_HELP),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job ends."),
    role: Optional[str] = typer.Option(None, "--role", help="server | trainer | supervisor (default: all)."),
) -> None:
    """Print a job's logs (supervisor, server, trainer) from its run directory."""
    import sys

    job = _ref(job)
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.launch.executor import find

    if role not in (None, "server", "trainer", "supervisor"):
        raise OgrpoError(f"--role {role!r}: use server, trainer or supervisor")

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    find(job).logs(role, follow, write)


def cancel(
    job: str = typer.Argument(..., help=JOB_HELP),
) -> None:
    """Cancel a job (Slurm: scancel; local: SIGTERM to the run) and wait until its processes are gone (exit 1
    naming any still alive after a bounded wait). A sweep (its directory or id): every point."""
    job = _ref(job)
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.sweep.manifest import find as find_sweep

    if (sweep := find_sweep(job)) is not None:
        # heavy: typer
        from ogrpo.commands.sweeping import cancel_sweep

        return cancel_sweep(sweep)
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.launch.executor import find

    handle = find(job)
    handle.cancel()
    typer.echo(f"cancelled job {handle.job_id}: no process of it is left")
