"""What `ogrpo reproduce` reads back from a finished (or failed) run: the resolved config it ran, the plan it
was made from, and the versions, code and hardware it ran on; and how today's machine differs from that.

A run leaves two manifests: the job directory's (written by render/submit: the plan, the job spec, the
changes made to the recipe) and the run directory's (written by the trainer: the resolved config, plan,
seed, versions, git sha, hardware). Reading never imports torch.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

from ogrpo import __version__, layout
from ogrpo.config import load_run_config
from ogrpo.errors import OgrpoError
from ogrpo.launch.slurm.query import resolve
from ogrpo.plan import plan_from_config
from ogrpo.planner.device_rules import rules_of
from ogrpo.planner.types import Plan

VERSIONED = ("torch", "transformers", "trl", "vllm", "accelerate", "datasets", "deepspeed", "peft")


@dataclass
class Record:
    config: dict  # the resolved run config (TRL keys + `ogrpo:`), without the carried plan
    plan: object  # the Plan the run was made from (ogrpo/planner/types.py); None in a manifest without one
    gpus: str
    backend: str  # "slurm" | "local"
    versions: dict = field(default_factory=dict)
    git_sha: str | None = None
    hardware: dict = field(default_factory=dict)
    seed: int | None = None
    source: Path | None = None
    data: dict | None = None  # the fingerprint of the rows it trained on (ogrpo/trainer/data_fingerprint.py)
    model_revision: str | None = None  # the hub commit its model came from (ogrpo/trainer/model_revision.py)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise OgrpoError(f"{path}: not valid JSON ({exc}); the run's manifest is damaged") from None


def _job_dir(ref: str) -> Path:
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    if ref.split("_")[0].isdigit():  # a Slurm job id: its run directory, from our index or the controller

        job = resolve(ref)
        if job.job_dir is None:
            raise OgrpoError(f"job {ref}: its run directory is not known here; pass the directory instead")
        return job.job_dir
    raise OgrpoError(f"{ref}: neither a run directory nor a Slurm job id")


def load_record(ref: str) -> Record:
    """A job directory (submit/render's, with run/ inside), a run directory (the trainer's), or a job id."""
    where = _job_dir(ref)
    job_manifest = _read(layout.job_manifest(where)) or {}
    run_manifest = _read(layout.run_manifest(where))
    if run_manifest is None and "config" in job_manifest:  # `where` is itself the trainer's run directory
        run_manifest, job_manifest = job_manifest, (_read(layout.job_manifest(where.parent)) or {})
    if not run_manifest or "config" not in run_manifest:
        raise OgrpoError(f"{where}: no run manifest with a resolved config (run/manifest.json); only runs that "
                         "started training can be reproduced")
    config = copy.deepcopy(run_manifest["config"])
    carried = (config.get("ogrpo") or {}).pop("plan", None)
    recorded = job_manifest.get("plan") or run_manifest.get("plan") or carried or {}
    plan = None
    if recorded.get("cluster"):  # the one place a recorded plan is read: parsed once, then typed

        plan = Plan.from_dict(recorded)
    gpus = (plan.cluster.spec if plan is not None else None) or (config.get("ogrpo") or {}).get("gpus")
    if not gpus:
        raise OgrpoError(f"{where}: the manifest names no cluster (plan.cluster.spec); pass --gpus")
    backend = "slurm" if (where / "slurm" / "job_id").is_file() else "local"
    return Record(config=config, plan=plan, gpus=gpus, backend=backend, versions=run_manifest.get("versions") or {},
                  git_sha=run_manifest.get("git_sha"), hardware=run_manifest.get("hardware") or {},
                  seed=run_manifest.get("seed"), source=where, data=run_manifest.get("data"),
                  model_revision=run_manifest.get("model_revision"))


def installed_versions() -> dict:
    from importlib import metadata

    out = {"ogrpo": __version__}
    for dist in VERSIONED:
        for name in (dist, f"{dist}-cpu"):
            try:
                out[dist] = metadata.version(name)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def rerun_config(record: Record) -> tuple[dict, list[str]]:
    """The recorded config to submit again, pinned to what the recorded run trained (`_pinned`). Also the pins
    added, as lines."""
    return _pinned(record.config, (record.data or {}).get("sha256"), record.model_revision)


def pinned_recipe(recipe: dict, records: list[Record]) -> tuple[dict, list[str]]:
    """A sweep's recipe pinned as `rerun_config` pins a run, where every point trained on the same rows (the same
    hub commit); else the recipe as it was for those, and why (a grid over the data or the model, a point that
    recorded none)."""
    why = []
    shas = {(r.data or {}).get("sha256") for r in records}
    if not (recipe.get("ogrpo") or {}).get("data_sha256"):
        if not records or None in shas:
            why.append("not every point recorded the rows it trained on")
        elif len(shas) > 1:
            why.append("its points trained on different rows (a grid over the data)")
    commits = {r.model_revision for r in records}
    if len(commits) > 1:
        why.append("its points loaded different model commits (a grid over the model)")
    one = (lambda values: next(iter(values)) if len(values) == 1 else None)
    return _pinned(recipe, one(shas), one(commits))[0], why


def _pinned(config: dict, sha: str | None, commit: str | None) -> tuple[dict, list[str]]:
    """`config` pinned to a hub model's commit (TRL's `model_revision`: a name, branch or tag may point elsewhere
    now) and to the rows' SHA-256 (`ogrpo.data_sha256`, unless it pins some already): a rerun of other weights or
    data would be another run; and the pins added."""
    config = copy.deepcopy(config)
    pins = []
    if commit and config.get("model_revision") != commit:
        config["model_revision"] = commit
        pins.append(f"model_revision: {commit}")
    section = config.get("ogrpo") or {}  # `ogrpo:` left empty reads as None
    if sha and not section.get("data_sha256"):
        config["ogrpo"] = {**section, "data_sha256": sha}
        pins.append(f"ogrpo.data_sha256: {sha}")
    return config, pins


def drift(record: Record, installed: dict | None = None, git_sha: str | None = None) -> list[str]:
    """How this machine's stack differs from the recorded one, one line each (empty: the same)."""
    installed = installed if installed is not None else installed_versions()
    lines = []
    for name, was in sorted(record.versions.items()):
        if name == "python" or was is None:
            continue
        now = installed.get(name)
        if now != was:
            lines.append(f"{name} {was} -> {now or 'not installed'}")
    if record.git_sha and git_sha and record.git_sha != git_sha:
        lines.append(f"O-GRPO code {record.git_sha} -> {git_sha}")
    return lines


def _shown(value):
    """A plan field as its JSON form (an enum as its string, a typed section as its dict), as records show it."""
    from enum import Enum

    if hasattr(value, "to_dict"):
        return value.to_dict()
    return value.value if isinstance(value, Enum) else value


def plan_differences(recorded, now) -> list[str]:
    """The Plan fields that decide how a run executes, where today's planner chooses differently."""
    keys = ("precision", "attn_implementation", "mode", "trainer_args", "env")
    out = [f"plan.{k}: {_shown(getattr(recorded, k))!r} -> {_shown(getattr(now, k))!r}" for k in keys
           if getattr(recorded, k) != getattr(now, k)]
    for role, fields in (("trainer", ("num_processes", "strategy")),
                         ("vllm", ("tensor_parallel_size", "data_parallel_size", "args"))):
        a, b = getattr(recorded, role), getattr(now, role)
        out += [f"plan.{role}.{k}: {_shown(getattr(a, k))!r} -> {_shown(getattr(b, k))!r}" for k in fields
                if getattr(a, k) != getattr(b, k)]
    # O-GRPO's own choices (overlap, train_ahead, padding_free, kernels, the old policy's pass...) decide how the
    # run computes as much as the TRL keys do; their reasons may be reworded, their values not
    was, new = (_setting_values(p) for p in (recorded, now))
    out += [f"plan setting {name}: {was.get(name)!r} -> {new.get(name)!r}" for name in sorted(set(was) | set(new))
            if was.get(name) != new.get(name)]
    return out


def replanned_differences(record: Record, source=None) -> list[str]:
    """How today's planner plans the recorded config (`source`: the file it is resubmitted from, else the config
    itself) unlike the recorded plan (empty: alike, or no plan recorded)."""
    if record.plan is None:
        return []
    now = plan_from_config(load_run_config(record.config if source is None else source), gpus=record.gpus)
    return plan_differences(record.plan, now)


def _setting_values(plan) -> dict:
    """name -> value of a plan's settings, as its manifest holds them (JSON: a tuple reads back as a list)."""
    return {s.name: json.loads(json.dumps(s.value, default=str)) for s in plan.settings}


def rerun_note(plan) -> str | None:
    """Why a rerun of this plan agrees with the recorded run only to rounding, else None (bit for bit on CPU)."""
    if not rules_of(plan).reruns_bit_for_bit:
        return "a GPU run: its rerun agrees to rounding, not bit for bit (CUDA kernels are not deterministic)"
    if plan.train_ahead:
        return ("the recorded run trained groups ahead (overlap.train_ahead): its gradients were summed in the "
                "order completions ended, so the rerun agrees to rounding, not bit for bit; full_determinism: true "
                "(or ogrpo.train_ahead: off) in the recipe gives identical reruns")
    return None
