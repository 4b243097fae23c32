"""The job-level Slurm request of one job as data (`SlurmOptions`), and the one renderer of job.sbatch (pure, no
Slurm calls).

`render_script` is the only producer of job.sbatch: `ogrpo render`, `ogrpo submit --dry-run` and `ogrpo submit`
all write its text, so the header a user reads is the request Slurm gets and `sbatch job.sbatch` by hand runs what
`ogrpo submit` runs. The text is in submitit's layout (ogrpo.launch.slurm.submitit_adapter.render_sbatch, held to
submitit's renderer by its check()) around the supervisor command.
What only the cluster knows (its CPUs per node) is checked by `ogrpo.launch.slurm.preflight`, which may lower
`cpus_per_task` before the file is written.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import sys
from dataclasses import dataclass, field

from ogrpo import __version__
from ogrpo.errors import OgrpoError
from ogrpo.launch.slurm.parse import seconds
from ogrpo.launch.slurm.submitit_adapter import render_sbatch
from ogrpo.planner.device_rules import rules_of
from ogrpo.values import control_character, escaped

# Slurm checks time limits every 30 s (PERIODIC_TIMEOUT) and sends the warning when the end is within
# delay + 30 s, so it comes 0-30 s earlier than asked; a delay under 30 s could come too late.
MIN_SIGNAL_DELAY_S = 30
# Options the user may not replace through `--slurm KEY=VALUE`: the job's own mechanics depend on them.
FIXED = ("signal", "requeue", "open-mode", "output", "error", "chdir", "ntasks-per-node")


@dataclass
class SlurmOptions:
    partition: str | None = None
    time_min: int | None = None  # None: the partition's default limit
    account: str | None = None
    qos: str | None = None
    nodes: int | None = None  # None: the job spec's node count
    gpus_per_node: int = 0
    # GRES type of the GPUs (`--gres=gpu:TYPE:N`): the catalog's for the plan's GPU (ogrpo.hardware), or the
    # site's spelling (ogrpo.gres_type / --gres-type); None or "" asks for any GPU of the partition
    gres_type: str | None = None
    cpus_per_task: int | None = None  # CPUs of the whole allocation per node (one batch task per node)
    cpus_from_config: bool = False  # the site said how many (ogrpo.cpus_per_gpu): preflight must not lower it
    mem_gib: int | None = None  # host RAM per node; None: the steps' host_mem_gib on the busiest node
    mem_per_gpu: str | None = None  # ogrpo.mem_per_gpu: the site's rule instead of ours
    extra: dict[str, object] = field(default_factory=dict)  # `--slurm KEY=VALUE`, written as `#SBATCH --KEY=VALUE`
    signal_delay_s: int = 90
    max_requeues: int = 3
    container_image: str | None = None  # every step runs in it (ogrpo.launch.containers)
    container_runtime: str | None = None  # None: detected on the node when the job starts
    job_name: str = "ogrpo"


def parse_time(text: str | int) -> int:
    """Slurm time formats (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) → whole minutes (rounded up)."""
    text = str(text).strip()
    secs = seconds(text, bare="minutes")
    if secs is None:
        raise OgrpoError(f"--time {text!r} is not a Slurm time: use minutes (90), HH:MM:SS (01:30:00) or D-HH:MM")
    if secs <= 0:
        raise OgrpoError(f"--time {text!r} must be positive")
    return -(-secs // 60)


def format_time(minutes: int) -> str:
    """Minutes → Slurm's [D-]HH:MM:SS, the form `squeue -l` shows."""
    days, rest = divmod(int(minutes), 1440)
    text = f"{rest // 60:02d}:{rest % 60:02d}:00"
    return f"{days}-{text}" if days else text


def check_requeue_options(signal_delay_s: int | None, max_requeues: int | None) -> None:
    """--signal-delay and --max-requeues as given: refused, not raised or clamped in silence."""
    if signal_delay_s is not None and signal_delay_s < MIN_SIGNAL_DELAY_S:
        raise OgrpoError(f"--signal-delay {signal_delay_s}: at least {MIN_SIGNAL_DELAY_S} s (Slurm checks time limits "
                         "every 30 s, so a shorter warning could come after the limit)")
    if max_requeues is not None and max_requeues < 0:
        raise OgrpoError(f"--max-requeues {max_requeues}: 0 (never requeue) or more")


def parse_passthrough(items: list[str] | None) -> dict[str, object]:
    """`--slurm KEY=VALUE` (repeatable; `--slurm exclusive` for a bare flag) → sbatch options."""
    out: dict[str, object] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-")
        if not key or not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", key):
            raise OgrpoError(f"--slurm {item!r}: expected KEY=VALUE with an sbatch option name, e.g. --slurm mem=64G")
        key = key.replace("_", "-")
        if key in FIXED:
            raise OgrpoError(f"--slurm {key}: set by O-GRPO for checkpoint/requeue and logs; use --signal-delay, "
                             "--max-requeues or -o instead")
        if sep and control_character(value) is not None:
            raise OgrpoError(f"--slurm {key}={escaped(value)}: the value holds a control character; sbatch "
                             "reads one option per line")
        out[key] = value if sep else True
    return out


def options_for(plan, run_config, *, nodes: int | None = None, time_min: int | None = None,
                extra: dict | None = None, signal_delay_s: int = 90, max_requeues: int = 3,
                container_runtime: str | None = None, job_name: str | None = None) -> SlurmOptions:
    """SlurmOptions for a Plan (or its dict form) and run config (ogrpo.partition/account/qos/time/cpus_per_gpu/
    mem_per_gpu/container), with command-line values already merged into the run config's ogrpo section."""
    o = run_config.ogrpo
    cl = plan.cluster
    rules = rules_of(cl)
    devices = max(1, int(cl.gpus_per_node))
    if time_min is None and o.time:
        time_min = parse_time(o.time)
    per_device = int(o.cpus_per_gpu) if o.cpus_per_gpu else rules.cpus_per_device
    return SlurmOptions(
        partition=o.partition, time_min=time_min, account=o.account, qos=o.qos,
        nodes=nodes or int(cl.nodes), gpus_per_node=int(cl.gpus_per_node) if rules.counts_gpus else 0,
        gres_type=gres_type_for(cl.gpu, getattr(o, "gres_type", None)) if rules.counts_gpus else None,
        cpus_per_task=per_device * devices, cpus_from_config=bool(o.cpus_per_gpu), mem_per_gpu=o.mem_per_gpu,
        extra=dict(extra or {}), signal_delay_s=max(MIN_SIGNAL_DELAY_S, int(signal_delay_s)),
        max_requeues=max_requeues, container_image=o.container, container_runtime=container_runtime,
        job_name=job_name or o.job_name or "ogrpo",
    )


# `ogrpo.gres_type` values that ask for any GPU of the partition (a site without GRES types in gres.conf)
UNTYPED = ("any", "none")
_GRES_TYPE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def gres_type_for(gpu, override: str | None) -> str | None:
    """The GRES type to ask for: OVERRIDE (the site's name for the type; 'any' for an untyped request), else the
    catalog's for GPU."""
    if override is not None and str(override).strip():
        text = str(override).strip()
        if text.lower() in UNTYPED:
            return None
        if not _GRES_TYPE_RE.match(text):
            raise OgrpoError(f"--gres-type {text!r}: a GRES type is a name like a40 or v100 (sinfo -o '%P %G'), "
                             "or 'any' for any GPU of the partition")
        return text
    return gpu.gres_type


def job_nodes(spec) -> int:
    return max((n for s in spec.steps for n in s.nodes), default=0) + 1


def job_mem_gib(spec) -> int:
    """Host RAM per node: the steps' needs added up on the node where most of them run."""
    per_node: dict[int, float] = {}
    for s in spec.steps:
        for n in s.nodes:
            per_node[n] = per_node.get(n, 0.0) + float(getattr(s, "host_mem_gib", 0.0) or 0.0)
    return int(math.ceil(max(per_node.values(), default=0.0)))


def directives(spec, opts: SlurmOptions) -> list[tuple[str, object]]:
    """(option, value) pairs for the job's `#SBATCH` lines, in a fixed order; value True is a bare flag. A value
    with a control character is refused: a line break would end its `#SBATCH` line and run the rest."""
    pairs = _directives(spec, opts)
    for key, value in pairs:
        if isinstance(value, str) and control_character(value) is not None:
            raise OgrpoError(f"#SBATCH --{key}={escaped(value)}: the value holds a control character; sbatch "
                             "reads one option per line")
    return pairs


def _directives(spec, opts: SlurmOptions) -> list[tuple[str, object]]:
    own: list[tuple[str, object]] = [
        ("job-name", opts.job_name),
        ("nodes", opts.nodes or job_nodes(spec)),
        ("ntasks-per-node", 1),
        ("cpus-per-task", max(len(spec.steps), int(opts.cpus_per_task or len(spec.steps)))),
    ]
    if opts.gpus_per_node:
        typed = f"{opts.gres_type}:" if opts.gres_type else ""
        own.append(("gres", f"gpu:{typed}{opts.gpus_per_node}"))
    if opts.mem_per_gpu:
        own.append(("mem-per-gpu", opts.mem_per_gpu))
    else:
        mem = opts.mem_gib if opts.mem_gib is not None else job_mem_gib(spec)
        if mem:
            own.append(("mem", f"{mem}G"))
    if opts.time_min:
        own.append(("time", format_time(opts.time_min)))
    for key in ("partition", "account", "qos"):
        if getattr(opts, key):
            own.append((key, getattr(opts, key)))
    own += [
        ("signal", f"B:USR2@{max(MIN_SIGNAL_DELAY_S, int(opts.signal_delay_s))}"),
        ("requeue", True),
        ("open-mode", "append"),
        ("chdir", spec.job_dir),
        ("output", f"{spec.job_dir}/logs/slurm-%j.out"),
    ]
    extra = dict(opts.extra)
    if any(k in extra for k in ("mem", "mem-per-cpu", "mem-per-gpu")):  # the user's memory rule replaces ours
        own = [(k, v) for k, v in own if k not in ("mem", "mem-per-gpu")]
    if "gpus" in extra or "gpus-per-node" in extra:  # a site that counts GPUs another way says it that way
        own = [(k, v) for k, v in own if k != "gres"]
    if "time" in extra:
        extra["time"] = format_time(parse_time(extra["time"]))
    out = []
    for key, value in own:
        out.append((key, extra.pop(key) if key in extra else value))
    return out + list(extra.items())


def sbatch_lines(spec, opts: SlurmOptions) -> list[str]:
    """The `#SBATCH` lines of the job's script, as render_script writes them."""
    return [ln for ln in render_script(spec, opts).splitlines() if ln.startswith("#SBATCH")]


def job_python() -> str:
    """The job's default Python: OGRPO_PYTHON where the job is rendered, else the interpreter rendering it (the
    venv's, not resolved: a venv's python is a link whose target lacks the venv's packages)."""
    return os.environ.get("OGRPO_PYTHON") or sys.executable or "python3"


def _q(tok: str) -> str:
    """Shell quoting that leaves {placeholders} readable."""
    return tok if re.fullmatch(r"[\w@%+=:,./{}-]+", tok) else shlex.quote(tok)


def comment_text(text: str) -> str:
    """Text for a `#` comment line of the script: a control character shown escaped (a line break in a value would
    end the comment, and the rest of the value would run as a command of the batch script)."""
    return escaped(text)


def _wrap_comment(tokens: list[str], indent: str, width: int = 116) -> list[str]:
    """Tokens as `#` comment lines of at most `width` characters, continuation lines indented."""
    rows, cur = [], ""
    for tok in map(comment_text, tokens):
        if cur and len(cur) + 1 + len(tok) > width - len(indent) - 2:
            rows.append(cur)
            cur = tok
        else:
            cur = f"{cur} {tok}" if cur else tok
    if cur:
        rows.append(cur)
    return [f"#   {rows[0]}"] + [f"#   {indent}{r}" for r in rows[1:]]


def _steps_comment(spec) -> list[str]:
    """The job's steps as the supervisor runs them, placeholders unfilled: what a reader needs to know."""
    lines = ["# Steps ({placeholders} are filled when the job starts):"]
    if spec.env:
        lines += _wrap_comment(["every", "step:"] + [f"{k}={_q(str(v))}" for k, v in sorted(spec.env.items())], "  ")
    for step in spec.steps:
        devices = f"GPUs {step.gpus}" if step.gpus else "CPU"
        mem = f", {step.host_mem_gib:g} GiB host RAM" if step.host_mem_gib else ""
        head = [f"{step.role}:", f"(nodes {step.nodes}, {devices}, {step.ntasks} task(s){mem})"]
        own = [f"{k}={_q(str(v))}" for k, v in sorted(step.env.items()) if spec.env.get(k) != v]
        lines += _wrap_comment(head + own + [_q(a) for a in step.argv], "    ")
    return lines


# "ogrpo/launch/slurm.py" below is the path rendered job.sbatch files have always named (the module is now the
# package ogrpo/launch/slurm/): kept, so that a render stays byte-identical to the ones before the move.
_ABOUT = """\
# {title}
# Written by `ogrpo render` and `ogrpo submit` (ogrpo {version}): both write this same file, and
# `sbatch job.sbatch` runs exactly what `ogrpo submit` runs. Change the run config and re-render instead of editing.
# Plan: {summary}
#
# The batch step becomes O-GRPO's Slurm supervisor (ogrpo/launch/slurm.py), which
#   1. picks the job's ports (server, rendezvous, weight-sync group) below the ephemeral range, checks that they
#      are free on the node and records them in run/ports.json (a requeued job takes its own again); the server's
#      address is the node's as Slurm knows it (NodeAddr in `scontrol show node`);
#   2. starts the steps below together, each an `srun --exact` step with its own GPUs, CPUs and memory; the
#      trainer loads while the server starts, and its first generation waits until the server answers {health};
#   3. stops every step when one dies (the job fails with that step's log tail) and ends with the trainer;
#   4. on USR2 (--signal above: {delay} s before the time limit, or a preemption warning) asks the trainer to
#      checkpoint, stops the server and requeues the job, at most {requeues} times; the trainer resumes from its
#      last complete checkpoint (--resume auto).
# Logs: logs/slurm-<job id>.out (the supervisor), run/logs/<role>.log (the steps). Follow: ogrpo logs <job id> -f
#"""

_BODY = """\
set -euo pipefail
JOB_DIR={job_dir}
cd "$JOB_DIR"
# The Python that has ogrpo installed: the one that rendered this job, so that `sbatch job.sbatch` works from any
# shell (no venv to activate); OGRPO_PYTHON in the submitting environment overrides it. The steps run in this
# Python too, or in the image's python3 when the job has a container (--container).
RENDERED_PYTHON={python}
# exec: the supervisor replaces this shell, so the warning signal (B: the batch step only) reaches it."""


def supervise_command(job_dir_var: str, opts: SlurmOptions) -> str:
    """The batch step's last line: `exec` the Slurm supervisor on the job directory the shell variable names
    (a single job's `$JOB_DIR`, a sweep task's `$POINT_DIR`), with the job's requeue, signal and container
    options."""
    delay = max(MIN_SIGNAL_DELAY_S, int(opts.signal_delay_s))
    args = [f"--max-requeues {int(opts.max_requeues)}", f"--signal-delay {delay}"]
    if opts.container_image:
        args.append(f"--container {shlex.quote(opts.container_image)}")
        if opts.container_runtime:
            args.append(f"--container-runtime {shlex.quote(opts.container_runtime)}")
    return (f'exec "${{OGRPO_PYTHON:-$RENDERED_PYTHON}}" -m ogrpo.launch.slurm supervise "{job_dir_var}"'
            + "".join(" \\\n  " + a for a in args))


def render_script(spec, opts: SlurmOptions, *, title: str | None = None, summary: str = "") -> str:
    """job.sbatch for a JobSpec and its SlurmOptions (pure text): the one batch script of the job, whose batch
    step `exec`s the supervisor."""
    delay = max(MIN_SIGNAL_DELAY_S, int(opts.signal_delay_s))
    command = supervise_command("$JOB_DIR", opts)
    about = _ABOUT.format(title=comment_text(title or f"O-GRPO job {spec.name}"), version=__version__,
                          summary=comment_text(summary or spec.name), health=comment_text(spec.health_path),
                          delay=delay, requeues=int(opts.max_requeues))
    setup = [*about.splitlines(), *_steps_comment(spec), "",
             *_BODY.format(job_dir=shlex.quote(spec.job_dir), python=shlex.quote(job_python())).splitlines()]
    params = dict(directives(spec, opts))
    return render_sbatch(command, spec.job_dir, job_name=str(params.pop("job-name")), params=params, setup=setup)


def request_flags(spec, opts: SlurmOptions) -> list[str]:
    """The resource part of the request as sbatch flags (for `sbatch --test-only`)."""
    skip = {"signal", "requeue", "chdir", "output", "error", "open-mode", "job-name"}
    return [f"--{k}" if v is True else f"--{k}={v}" for k, v in directives(spec, opts)
            if k not in skip and v is not None and v is not False]
