"""`ogrpo plan`, `ogrpo render`, `ogrpo doctor` (owned by the planning core).

Implementations are imported inside the functions so that `ogrpo --help` stays fast, and typer is not imported
here (ogrpo.commands.options): `plan` and `render` run without it.
"""

from __future__ import annotations

from typing import Optional

from ogrpo.commands.options import Option, echo
from ogrpo.load_plan import load_and_plan  # noqa: F401  (its home, below the commands; submit, sweep use it)
from ogrpo.errors import NoFitError, OgrpoError

GPUS_HELP = "Cluster: [NODESx]COUNTxTYPE[-MEM], e.g. 3xA40, 4xV100-16G, 2x8xA100-80G, cpu, 2xcpu."
CONFIG_HELP = "Run config: TRL flat recipe YAML (with an optional `ogrpo:` section) or a built-in recipe name."
GRES_TYPE_HELP = ("Slurm GRES type of the GPUs (--gres=gpu:TYPE:N; default: the catalog's, e.g. a40, v100; "
                  "'any': untyped). Also ogrpo.gres_type.")
STRICT_HELP = "Refuse (exit 2) when the run would differ from the recipe in any way, instead of listing the changes."
STRATEGY_HELP = "Trainer strategy: ddp | zero2 | zero3 | zero3_offload (default: the cheapest that fits; DDP on CPU)."
OVERLAP_HELP = ("Server and trainer at work together on the split placement: off | lossless | one-step "
                "(default: the plan's; off where no separate server exists).")


def _short(value, limit: int = 80) -> str:
    """A value as the change line shows it: a chat template or a prompt is kept whole in the plan's JSON and
    the manifest, not on the terminal."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 20]}... ({len(text)} chars)"


def warn(rc, plan) -> None:
    """Config and plan warnings, then every change from the recipe, on stderr (the plan carries the config's
    warnings since it was made from it)."""
    for w in dict.fromkeys(list(rc.warnings) + list(plan.warnings)):
        echo(f"warning: {w}", err=True)
    for c in plan.changes:
        echo(f"change: {c.key}: {_short(c.old)} -> {_short(c.new)} ({c.reason})", err=True)


def require_fit(plan, force: bool, what: str) -> None:
    if not plan.fits and not force:
        raise NoFitError("the plan does not fit: " + "; ".join(plan.reasons)
                         + (f"; try: {', '.join(plan.fixes)}" if plan.fixes else "") + f" (or --force to {what})")


def plan(
    gpus: Optional[str] = Option(None, "--gpus", help=GPUS_HELP),
    config: Optional[str] = Option(None, "--config", "-c", help=CONFIG_HELP),
    model: Optional[str] = Option(None, "--model", help="Model to plan for (overrides model_name_or_path)."),
    params: Optional[str] = Option(None, "--params", help="Parameter count when the model is unknown: 7B."),
    profile: Optional[str] = Option(None, "--profile", help="conservative | balanced | aggressive."),
    vllm_gpus: Optional[int] = Option(None, "--vllm-gpus", help="GPUs for the vLLM server (0: colocate)."),
    strategy: Optional[str] = Option(None, "--strategy", help=STRATEGY_HELP),
    overlap: Optional[str] = Option(None, "--overlap", help=OVERLAP_HELP),
    as_json: bool = Option(False, "--json", help="Print the plan as JSON."),
    strict: bool = Option(False, "--strict", help=STRICT_HELP),
) -> None:
    """Plan placement and memory fit. Exit 0 when it fits, 3 when it does not, 2 on bad input."""
    rc, p = load_and_plan(config, gpus, model, params, profile, vllm_gpus,
                          extra={"strategy": strategy, "overlap": overlap}, strict=strict,
                          preemption=_cluster_facts_unless_local)
    if as_json:
        import json

        d = p.to_dict()
        d["preemption"] = p.preemption.to_dict() if p.preemption else None
        d["warnings"] = list(dict.fromkeys(list(rc.warnings) + d["warnings"]))
        echo(json.dumps(d, indent=2))
    else:
        warn(rc, p)
        # CLI latency: `ogrpo --help` imports this module
        from ogrpo.render.table import print_plan

        print_plan(p)
    raise SystemExit(0 if p.fits else 3)


def _cluster_facts_unless_local(rc):
    """`plan`'s cluster facts: none for a plan that runs on this machine (a CPU plan runs here unless submitted,
    and render and submit ask the cluster), so that planning it runs no scontrol."""
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.plan import cluster_of
    from ogrpo.planner.device_rules import rules_of

    if rules_of(cluster_of(rc)).runs_locally:
        return None
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.launch.slurm import grace

    return grace.gather(rc)


def render(
    gpus: Optional[str] = Option(None, "--gpus", help=GPUS_HELP),
    config: Optional[str] = Option(None, "--config", "-c", help=CONFIG_HELP),
    output: Optional[str] = Option(None, "--output", "-o", help="Job directory to write."),
    model: Optional[str] = Option(None, "--model", help="Model to plan for (overrides model_name_or_path)."),
    params: Optional[str] = Option(None, "--params", help="Parameter count when the model is unknown: 7B."),
    profile: Optional[str] = Option(None, "--profile", help="conservative | balanced | aggressive."),
    vllm_gpus: Optional[int] = Option(None, "--vllm-gpus", help="GPUs for the vLLM server (0: colocate)."),
    strategy: Optional[str] = Option(None, "--strategy", help=STRATEGY_HELP),
    overlap: Optional[str] = Option(None, "--overlap", help=OVERLAP_HELP),
    dry_run: bool = Option(False, "--dry-run", help="Print the files instead of writing them."),
    force: bool = Option(False, "--force", help="Render even when the plan does not fit, and over the files "
                   "of an earlier job in DIR."),
    job_dir_opt: Optional[str] = Option(
        None, "--job-dir", help="Path the job will have on the cluster (default: the absolute --output path)."),
    strict: bool = Option(False, "--strict", help=STRICT_HELP),
    gres_type: Optional[str] = Option(None, "--gres-type", help=GRES_TYPE_HELP),
    as_json: bool = Option(False, "--json", help="Print one JSON object: the files (their text with "
                                 "--dry-run), the changes and warnings; on failure {errors: [...]}."),
) -> None:
    """Render the Slurm job (job.sbatch, accelerate.yaml, deepspeed.json, run.yaml, manifest.json)."""
    import os

    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.jobspec import build_jobspec
    from ogrpo.render import render_job, write_job

    if not output and not dry_run:
        raise OgrpoError("render needs -o/--output DIR (or --dry-run to print the files)")
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.launch.slurm import grace
    from ogrpo.launch.slurm.sbatch import options_for

    job_dir = job_dir_opt or (os.path.abspath(output) if output else "/path/to/job")
    # the same preemption policy `submit` plans (KillWait/GraceTime when this machine reaches a cluster)
    rc, p = load_and_plan(config, gpus, model, params, profile, vllm_gpus,
                          extra={"strategy": strategy, "overlap": overlap, "gres_type": gres_type}, strict=strict,
                          preemption=lambda run_config: grace.gather(run_config, job_dir=job_dir))
    if not os.path.isabs(job_dir):
        raise OgrpoError(f"--job-dir {job_dir}: must be an absolute path (steps run from other directories)")
    warn(rc, p)
    require_fit(p, force, "render anyway")
    spec = build_jobspec(p, rc, job_dir)
    files = render_job(p, rc, spec, slurm=options_for(p, rc, job_name=spec.name,
                                                      signal_delay_s=p.preemption.signal_delay_s))
    if as_json:
        import json

        summary = {"fits": p.fits, "job_dir": job_dir, "changes": [c.to_dict() for c in p.changes],
                   "warnings": list(dict.fromkeys(list(rc.warnings) + list(p.warnings)))}
    if dry_run:
        if as_json:
            echo(json.dumps({**summary, "files": dict(files)}, indent=2))
            return
        for name, text in files.items():
            echo(f"==> {name} <==")
            echo(text.rstrip("\n"))
            echo("")
        return
    written = write_job(files, output, force=force)
    if as_json:
        echo(json.dumps({**summary, "written": [str(path) for path in written]}, indent=2))
    for path in written if not as_json else ():
        echo(str(path))
    echo(f"submit with: sbatch {os.path.join(job_dir, 'job.sbatch')}  (or: ogrpo submit)", err=True)


def doctor(
    as_json: bool = Option(False, "--json", help="Print the report as JSON."),
    patches: bool = Option(True, "--patches/--no-patches",
                                 help="Check that every library O-GRPO patches still has the patched shape "
                                      "(imports vLLM/TRL: slower)."),
) -> None:
    """Check this machine: python, torch/CUDA, GPUs, vLLM/TRL pair, DeepSpeed, Slurm, containers, patch targets."""
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.checks.doctor import print_report, run_checks
    from ogrpo.kernels._build import cache_root
    from ogrpo.trainer.quiet import libraries_note, libraries_to_log

    # the patch checks import TRL and vLLM, which warn and log at import: kept in a log, named in one line
    with libraries_to_log(cache_root().parent / "logs" / "doctor.log") as counts:
        report = run_checks(patches=patches)
    note = libraries_note(counts)
    if note:
        echo(note, err=True)
    if as_json:
        import json

        echo(json.dumps(report, indent=2))
    else:
        print_report(report)
    raise SystemExit(0 if report["can_train"] else 1)
