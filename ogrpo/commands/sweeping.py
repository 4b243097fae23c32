"""`ogrpo sweep`, and what `status`, `cancel` and `reproduce` do when their argument is a sweep.

Implementations are imported inside the functions so that `ogrpo --help` stays fast.
"""

from __future__ import annotations

from typing import Optional

import typer

from ogrpo.commands.planning import _short
from ogrpo.errors import OgrpoError

GPUS_HELP = "Cluster: [NODESx]COUNTxTYPE[-MEM], e.g. 3xA40, 4xV100-16G, cpu. Every point runs on one such job."
CONFIG_HELP = "Run config: TRL flat recipe YAML (with an optional `ogrpo:` section) or a built-in recipe name."
GRID_HELP = ("KEY=V1,V2,...: a run-config key (TRL's, or ogrpo.KEY) and its values (repeatable; the points are "
             "every combination).")
# the options `ogrpo reproduce` passes again to repeat a sweep (sweep.json "options"); Slurm's only to Slurm
_SLURM_ONLY = ("partition", "time", "account", "qos", "gres_type", "max_requeues")
_REPEATED = ("gpus", "partition", "time", "account", "qos", "gres_type", "max_requeues", "profile", "model",
             "params", "vllm_gpus", "strategy", "overlap", "max_parallel")


def sweep(
    gpus: Optional[str] = typer.Option(None, "--gpus", help=GPUS_HELP),
    config: str = typer.Option(..., "--config", "-c", help=CONFIG_HELP),
    grid: Optional[list[str]] = typer.Option(None, "--grid", help=GRID_HELP),
    seeds: Optional[int] = typer.Option(None, "--seeds", help="Seeds per grid point: the recipe's seed, +1, ..."),
    max_parallel: Optional[int] = typer.Option(None, "--max-parallel", help="Points running at once (Slurm: the "
                                               "job array's %P; default: all)."),
    backend: Optional[str] = typer.Option(None, "--backend", help="slurm | local (default: slurm when sbatch is on "
                                          "PATH). local: the points run here, one after another."),
    output_dir: Optional[str] = typer.Option(None, "--output-dir", "-o", help="Sweep directory (default: "
                                             "./ogrpo-sweeps/NAME-sweep-TIME)."),
    partition: Optional[str] = typer.Option(None, "--partition", "-p", help="Slurm partition."),
    time_limit: Optional[str] = typer.Option(None, "--time", "-t", help="Time limit of each point's job."),
    account: Optional[str] = typer.Option(None, "--account", "-A", help="Slurm account to charge."),
    qos: Optional[str] = typer.Option(None, "--qos", help="Slurm QOS."),
    gres_type: Optional[str] = typer.Option(None, "--gres-type", help="Slurm GRES type of the GPUs (default: the "
                                            "catalog's; 'any': untyped)."),
    slurm: Optional[list[str]] = typer.Option(None, "--slurm", help="Extra sbatch option KEY=VALUE (repeatable)."),
    max_requeues: Optional[int] = typer.Option(None, "--max-requeues", help="Requeues allowed per point (default: "
                                               "3)."),
    profile: Optional[str] = typer.Option(None, "--profile", help="conservative | balanced | aggressive."),
    model: Optional[str] = typer.Option(None, "--model", help="Model to plan for (overrides model_name_or_path)."),
    params: Optional[str] = typer.Option(None, "--params", help="Parameter count when the model is unknown: 7B."),
    vllm_gpus: Optional[int] = typer.Option(None, "--vllm-gpus", help="GPUs for the vLLM server (0: colocate)."),
    strategy: Optional[str] = typer.Option(None, "--strategy", help="ddp | zero2 | zero3 | zero3_offload."),
    overlap: Optional[str] = typer.Option(None, "--overlap", help="off | lossless | one-step."),
    strict: bool = typer.Option(False, "--strict", help="Refuse (exit 2) when any point would differ from the "
                                "recipe plus its grid values."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Plan every point and write the sweep directory; submit "
                                 "nothing."),
) -> None:
    """Run a grid of configs (x seeds): every point planned like `ogrpo submit` (all must fit: exit 3 naming
    those that do not), then one Slurm job array (each task one point's whole job), or the points one after
    another here (--backend local). Follow with `ogrpo status SWEEP`, stop with `ogrpo cancel SWEEP`."""
    import os
    from pathlib import Path

    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.config import load_run_config
    from ogrpo.sweep import grid as g, manifest, slurm as sweep_slurm
    from ogrpo.sweep.plan import PointsDoNotFit, plan_points, write_point

    swept = g.parse_grid(grid)
    n_seeds = g.parse_seeds(seeds, swept)
    if not swept and not n_seeds:
        raise OgrpoError("nothing to sweep: give --grid KEY=V1,V2 (repeatable) and/or --seeds N")
    backend = _backend(backend, max_parallel, dry_run, gpus, config, {
        "--partition": partition, "--gres-type": gres_type, "--time": time_limit, "--account": account, "--qos": qos,
        "--slurm": slurm, "--max-requeues": max_requeues})
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.launch.slurm import grace, sbatch as sb

    given_requeues, max_requeues = max_requeues, 3 if max_requeues is None else max_requeues
    extra_sbatch = sb.parse_passthrough(slurm)
    sb.check_requeue_options(None, max_requeues)
    minutes = sb.parse_time(time_limit) if time_limit else None
    recipe = load_run_config(config)
    points = g.expand(swept, n_seeds, int(recipe.get("seed", 42)))
    extra = {"partition": partition, "account": account, "qos": qos, "time": time_limit, "strategy": strategy,
             "overlap": overlap, "gres_type": gres_type}
    # each point's KillWait/GraceTime (its run config may name the partition) for its preemption policy; no step
    # time was recorded (a sweep writes a fresh directory)
    facts = (lambda rc: grace.gather(rc, partition=partition)) if backend == "slurm" else None
    try:
        planned = plan_points(points, config, gpus, model=model, params=params, profile=profile,
                              vllm_gpus=vllm_gpus, extra=extra, strict=strict, preemption=facts)
    except PointsDoNotFit as exc:
        for line in exc.lines:
            typer.echo(f"error: {line}", err=True)
        raise typer.Exit(3) from None
    first = planned[0]
    if backend == "local":
        _check_local(planned, dry_run)

    name = first.rc.ogrpo.job_name or _job_name(first)
    sweep_dir = Path(os.path.abspath(output_dir or os.path.join("ogrpo-sweeps", manifest.new_id(name))))
    if manifest.is_sweep_dir(sweep_dir) or (sweep_dir.is_dir() and any(sweep_dir.iterdir())):
        raise OgrpoError(f"-o {sweep_dir}: exists and is not empty; a sweep writes a fresh directory")
    if sweep_dir.exists() and not sweep_dir.is_dir():
        raise OgrpoError(f"-o {sweep_dir}: exists and is not a directory")
    sweep_id = sweep_dir.name

    opts = [None] * len(planned)
    if backend == "slurm":
        opts = _slurm_options(planned, sweep_dir, time_min=minutes, extra=extra_sbatch, max_requeues=max_requeues,
                              job_name=name)
    for line in notes(planned):
        typer.echo(line, err=True)

    entries = [{**pp.point.to_dict(), "label": pp.point.label(), "dir": f"{manifest.POINTS}/{pp.index}"}
               for pp in planned]
    parallel = min(max_parallel or len(planned), len(planned))
    data = {"kind": manifest.KIND, "id": sweep_id, "dir": str(sweep_dir), "created": _now(), "backend": backend,
            "config": recipe.source, "recipe": recipe.to_dict(), "grid": swept, "seeds": n_seeds,
            "base_seed": int(recipe.get("seed", 42)), "max_parallel": parallel,
            "options": {"gpus": first.plan.cluster.spec, "partition": partition, "time": time_limit,
                        "account": account, "qos": qos, "gres_type": gres_type, "slurm": slurm or [],
                        "max_requeues": given_requeues, "profile": profile, "model": model, "params": params,
                        "vllm_gpus": vllm_gpus, "strategy": strategy, "overlap": overlap, "strict": strict,
                        "max_parallel": max_parallel},
            "points": entries}
    specs = [write_point(sweep_dir, sweep_id, pp, slurm=o, local=backend == "local") for pp, o in zip(planned, opts)]
    if backend == "slurm":
        text = sweep_slurm.render_array(sweep_dir, sweep_id, entries, specs, opts, parallel)
        (sweep_dir / manifest.SBATCH).write_text(text)
        (sweep_dir / manifest.SBATCH).chmod(0o755)
    manifest.write(sweep_dir, data)
    manifest.remember(sweep_id, sweep_dir)

    head = (f"sweep {sweep_id}: {len(planned)} points ({', '.join(f'{k} x{len(v)}' for k, v in swept.items())}"
            f"{', ' if swept and n_seeds else ''}{f'{n_seeds} seeds' if n_seeds else ''}) on {first.plan.cluster.spec}"
            f", mode {first.plan.mode}")
    typer.echo(head)
    for e in entries:
        typer.echo(f"  point {e['index']}: {e['label']}")
    typer.echo(f"sweep dir: {sweep_dir}")
    if dry_run:
        typer.echo(f"dry run: nothing submitted (submit by hand with: sbatch {sweep_dir / manifest.SBATCH})"
                   if backend == "slurm" else "dry run: nothing run (the same command without --dry-run runs the "
                   "points here)")
        return
    if backend == "slurm":
        data = sweep_slurm.submit(sweep_dir, opts[0])
        sl_ids = data["slurm"]
        typer.echo(f"submitted job array {sl_ids['array_job_id']}: {len(planned)} tasks, at most {parallel} at once"
                   + (f"; summary job {sl_ids['summary_job_id']} after it" if sl_ids.get("summary_job_id") else ""))
        typer.echo(f"follow with: ogrpo status {sweep_dir}   (stop: ogrpo cancel {sweep_dir})")
        return
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.sweep import local as sweep_local

    typer.echo(f"running {len(planned)} points here, one after another")
    rc = sweep_local.run(sweep_dir)
    print_status(sweep_dir)
    raise typer.Exit(rc)


def _backend(backend: str | None, max_parallel: int | None, dry_run: bool, gpus: str | None,
             config: str, slurm_flags: dict) -> str:
    """--backend, checked with --max-parallel and Slurm's options (`--time`: value, refused for a local sweep); by
    default what `submit` picks (slurm where sbatch is on PATH, else local for a cluster that runs here, else
    refused)."""

    if max_parallel is not None and max_parallel < 1:
        raise OgrpoError(f"--max-parallel {max_parallel}: must be 1 or more")
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.commands.backend import default_backend, refuse_slurm_flags

    backend = default_backend(backend, dry_run, gpus, config)
    if backend == "local" and max_parallel not in (None, 1):
        raise OgrpoError(f"--max-parallel {max_parallel}: --backend local runs the points one after another")
    refuse_slurm_flags(backend, slurm_flags)
    return backend


def _check_local(planned: list, dry_run: bool) -> None:
    """What `ogrpo submit --backend local` checks of a job, for every point: it runs on this machine."""
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.commands.backend import check_local

    check_local([(pp.rc, pp.plan) for pp in planned], dry_run, "ogrpo sweep", "sweep on Slurm")


def _slurm_options(planned: list, sweep_dir, *, time_min, extra, max_requeues, job_name) -> list:
    """Each point's SlurmOptions, as `ogrpo submit` makes a job's, with one signal lead time (the longest any point
    needs: each plan's preemption policy) and the CPUs the cluster's preflight settles for the first (one request
    for every task of the array, checked once, before anything is written)."""
    import shutil

    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.jobspec import build_jobspec
    from ogrpo.launch.slurm import sbatch as sb
    from ogrpo.sweep import manifest

    delays = [pp.plan.preemption.signal_delay_s for pp in planned]
    opts = [sb.options_for(pp.plan, pp.rc, time_min=time_min, extra=extra, signal_delay_s=max(delays),
                           max_requeues=max_requeues, job_name=job_name) for pp in planned]
    if shutil.which("sbatch"):
        # CLI latency: `ogrpo --help` imports this module
        from ogrpo.launch import slurm as sl

        first = planned[0]
        sl.preflight(build_jobspec(first.plan, first.rc, str(manifest.point_dir(sweep_dir, first.index))), opts[0])
        for o in opts[1:]:
            o.cpus_per_task = opts[0].cpus_per_task
    return opts


def notes(planned: list) -> list[str]:
    """Warnings and changes from the recipe, each once, with the points it concerns when not all of them."""
    seen: dict[str, list[int]] = {}
    for pp in planned:
        lines = [f"warning: {w}" for w in dict.fromkeys(list(pp.rc.warnings) + list(pp.plan.warnings))]
        lines += [f"change: {c.key}: {_short(c.old)} -> {_short(c.new)} ({c.reason})"
                  for c in pp.plan.changes]
        for line in lines:
            seen.setdefault(line, []).append(pp.index)
    everyone = len(planned)
    return [line if len(idx) == everyone else f"{line} [points {', '.join(map(str, idx))}]"
            for line, idx in seen.items()]


def _job_name(pp) -> str:
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.jobspec import build_jobspec

    return build_jobspec(pp.plan, pp.rc, "/").name


def _now() -> str:
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def sweep_states(sweep_dir) -> tuple[dict, dict[int, str]]:
    """(manifest, point index -> state) from the sweep's backend."""
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.sweep import manifest

    data = manifest.read(sweep_dir)
    if data.get("backend") == "slurm" and (data.get("slurm") or {}).get("array_job_id"):
        # CLI latency: `ogrpo --help` imports this module
        from ogrpo.sweep import slurm as sweep_slurm

        return data, sweep_slurm.states(sweep_dir, data)
    if data.get("backend") == "local":
        # CLI latency: `ogrpo --help` imports this module
        from ogrpo.sweep import local as sweep_local

        return data, sweep_local.states(sweep_dir, data)
    return data, {e["index"]: "NOT SUBMITTED" for e in data["points"]}


def print_status(sweep_dir, as_json: bool = False) -> None:
    """`ogrpo status SWEEP`: one row per point; refreshes summary.csv and rewards.png."""
    import json

    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.sweep import summary
    from ogrpo.sweep.grid import format_value

    data, states = sweep_states(sweep_dir)
    rows, csv_path, plot = summary.refresh(sweep_dir, states)
    if as_json:
        typer.echo(json.dumps({"id": data["id"], "dir": str(sweep_dir), "backend": data.get("backend"),
                               "array_job_id": (data.get("slurm") or {}).get("array_job_id"),
                               "summary": str(csv_path), "plot": str(plot) if plot else None, "points": rows},
                              indent=2, default=str))
        return
    array = (data.get("slurm") or {}).get("array_job_id")
    where = f"Slurm job array {array}, at most {data.get('max_parallel')} at once" if array else data.get("backend")
    typer.echo(f"sweep {data['id']}: {len(rows)} points ({where})")
    keys = list(data.get("grid") or {})
    head = ["point", *keys, "seed", "state", "step", "reward", "requeues"]
    table = [[str(r["index"]), *(format_value(r["values"].get(k)) for k in keys),
              "-" if r["seed"] is None else str(r["seed"]), r["state"], str(r["step"]),
              "-" if r["reward"] is None else f"{r['reward']:.4g}", str(r["requeues"])] for r in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(head)]
    for line in [head, *table]:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
    typer.echo(f"summary: {csv_path}" + (f", {plot}" if plot else ""))


def cancel_sweep(sweep_dir) -> None:
    """`ogrpo cancel SWEEP`: every task stopped; returns once no process of the sweep is left."""
    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.sweep import manifest, summary

    data = manifest.read(sweep_dir)
    if data.get("backend") == "local":
        # CLI latency: `ogrpo --help` imports this module
        from ogrpo.sweep import local as sweep_local

        sweep_local.cancel(sweep_dir, data)
    else:
        # CLI latency: `ogrpo --help` imports this module
        from ogrpo.sweep import slurm as sweep_slurm

        sweep_slurm.cancel(sweep_dir, data)
    _, states = sweep_states(sweep_dir)
    summary.refresh(sweep_dir, states)
    typer.echo(f"cancelled sweep {data['id']}: no process of it is left")


def reproduce_sweep(sweep_dir, output: str | None, backend: str | None, strict: bool, dry_run: bool) -> int:
    """`ogrpo reproduce SWEEP`: the same sweep again from its manifest (the recipe, the grid, the seeds and the
    options it was made with), warning where a point's recorded stack differs from this machine's."""
    import os
    import subprocess
    import sys
    import tempfile

    # CLI latency: `ogrpo --help` imports this module
    from ogrpo.config import dump_yaml
    from ogrpo.reproduce import drift, load_record, pinned_recipe, replanned_differences
    from ogrpo.sweep import manifest
    from ogrpo.sweep.grid import format_value
    from ogrpo.trainer.rundir import git_sha

    data = manifest.read(sweep_dir)
    problems: list[str] = []
    sha = git_sha()
    records = []
    for entry in data["points"]:
        pdir = manifest.point_dir(sweep_dir, entry["index"])
        try:
            rec = load_record(str(pdir))
        except OgrpoError:
            continue  # this point never trained: nothing recorded to differ from
        records.append(rec)
        problems += [line for line in drift(rec, git_sha=sha) + replanned_differences(rec) if line not in problems]
    recipe, unpinned = pinned_recipe(data["recipe"], records)
    for why in unpinned:
        typer.echo(f"note: the rerun is not pinned to what the recorded sweep trained: {why}", err=True)
    for line in problems:
        typer.echo(f"warning: differs from the recorded sweep: {line}", err=True)
    if problems and strict:
        raise OgrpoError(f"--strict: this sweep would differ from {sweep_dir}: " + "; ".join(problems))
    opts = data.get("options") or {}
    fd, config_path = tempfile.mkstemp(prefix="ogrpo-reproduce-sweep-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        f.write(f"# reproduces the recipe of sweep {data['id']}\n" + dump_yaml(recipe))
    argv = [sys.executable, "-m", "ogrpo", "sweep", "--config", config_path,
            "--backend", backend or data.get("backend") or "slurm"]
    for key, values in (data.get("grid") or {}).items():
        argv += ["--grid", f"{key}={','.join(format_value(v) for v in values)}"]
    if data.get("seeds"):
        argv += ["--seeds", str(data["seeds"])]
    local = (backend or data.get("backend")) == "local"
    unused = []  # a Slurm sweep's Slurm options, which a local rerun cannot take: said, not passed
    for key in _REPEATED:
        flag = f"--{key.replace('_', '-')}"
        if opts.get(key) is None or (key == "max_parallel" and local):
            continue
        if local and key in _SLURM_ONLY:
            if not (key == "max_requeues" and opts[key] == 3):  # the default, recorded by sweeps before 2026-12
                unused.append(f"{flag} {opts[key]}")
            continue
        argv += [flag, str(opts[key])]
    for item in opts.get("slurm") or []:
        if local:
            unused.append(f"--slurm {item}")
        else:
            argv += ["--slurm", item]
    if unused:
        typer.echo(f"note: {', '.join(unused)} of the recorded sweep not passed: --backend local runs on this "
                   "machine, without Slurm", err=True)
    if opts.get("strict"):
        argv.append("--strict")
    if output:
        argv += ["--output-dir", output]
    if dry_run:
        argv.append("--dry-run")
    typer.echo(f"reproducing sweep {data['id']} ({len(data['points'])} points, {opts.get('gpus')})", err=True)
    try:
        return subprocess.call(argv)
    finally:
        os.unlink(config_path)
