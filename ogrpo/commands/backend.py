"""Which backend a job or a sweep goes to, and what running it on this machine needs: shared by submit and sweep."""

from __future__ import annotations

import sys

from ogrpo.config import load_run_config
from ogrpo.errors import OgrpoError
from ogrpo.hardware import parse_gpus
from ogrpo.planner.device_rules import rules_of
from ogrpo.sandbox.policy import check_here


def checked_backend(backend: str, dry_run: bool) -> str:
    """--backend slurm|local; slurm only where sbatch is, except for a dry run (it writes files anywhere)."""
    import shutil

    if backend not in ("slurm", "local"):
        raise OgrpoError(f"--backend {backend!r}: use slurm or local")
    if backend == "slurm" and not dry_run and shutil.which("sbatch") is None:
        raise OgrpoError("--backend slurm but `sbatch` is not on PATH: run on a Slurm login node "
                         "(or load the slurm module), or use --backend local")
    return backend


def default_backend(backend: str | None, dry_run: bool, gpus: str | None, config: str) -> str:
    """--backend, checked; by default slurm where sbatch is on PATH, else local, but only for a cluster that runs
    on this machine (--gpus, else the config's ogrpo.gpus, else this machine's CPU): without Slurm a GPU plan
    would run here, on hardware it was not planned for, and fail late. Shared by submit and sweep."""
    import shutil

    if backend is None:
        if shutil.which("sbatch") is None and not dry_run and not runs_locally(gpus, config):
            raise OgrpoError(f"no Slurm here (`sbatch` is not on PATH), so --gpus {gpus or '(from the config)'} "
                             "cannot be submitted: run on a Slurm login node, or run this machine's own plan with "
                             "--backend local --gpus cpu (or the GPUs this machine has)")
        backend = "slurm" if shutil.which("sbatch") else "local"
    return checked_backend(backend, dry_run)


# ogrpo: keys that only a Slurm job uses (its sbatch header, its container): a local run notes them unused
SLURM_ONLY_KEYS = ("partition", "gres_type", "account", "qos", "time", "cpus_per_gpu", "mem_per_gpu", "container")


def refuse_slurm_flags(backend: str, given: dict[str, object]) -> None:
    """Slurm's command-line options (`--time`: value) given for a run on this machine: refused, since nothing
    here would honor them (a recipe's ogrpo.partition and the like are noted instead: the same recipe goes to
    Slurm later)."""
    flags = [flag for flag, value in given.items() if value not in (None, [], ())]
    if backend == "local" and flags:
        raise OgrpoError(f"{', '.join(flags)}: {'Slurm options' if len(flags) > 1 else 'a Slurm option'}, and "
                         "--backend local runs on this machine without Slurm; drop "
                         f"{'them' if len(flags) > 1 else 'it'}, or submit to Slurm (--backend slurm)")


def slurm_only_note(rc) -> str | None:
    """`note: ...` for the recipe's Slurm-only keys a local run does not use, else None."""
    keys = [f"ogrpo.{k}" for k in SLURM_ONLY_KEYS if getattr(rc.ogrpo, k, None) not in (None, "")]
    return (f"note: {', '.join(keys)} not used: --backend local runs on this machine, without Slurm"
            if keys else None)


def runs_locally(gpus: str | None, config: str) -> bool:
    """Whether the cluster a job targets (--gpus, else the config's ogrpo.gpus, else this machine's CPU) can run
    here without Slurm (the device rules' `runs_locally`)."""
    if gpus is None:
        gpus = load_run_config(config).ogrpo.gpus
    return gpus is None or rules_of(parse_gpus(str(gpus))).runs_locally


def check_local(pairs: list, dry_run: bool, command: str, elsewhere: str) -> None:
    """What running (run config, plan) pairs on this machine needs, checked before anything is written: code
    rewards without an isolating level exit 2, one node only, and the stack installed (not for a dry run)."""
    for note in dict.fromkeys(filter(None, (slurm_only_note(rc) for rc, _ in pairs))):
        sys.stderr.write(note + "\n")
    for rc, plan in pairs:
        check_here(rc)
        if plan.cluster.nodes > 1:
            raise OgrpoError(f"--backend local runs on this machine; the {plan.cluster.spec} plan spans "
                             f"{plan.cluster.nodes} nodes: {elsewhere} (--backend slurm)")
    if not dry_run:  # a missing stack is the one line, before the plan's notes
        # CLI latency: `ogrpo --help` imports this module
        from ogrpo.install_hints import require

        server = any(plan.has_server for _, plan in pairs)
        require(("torch", "trl", "accelerate", *(("vllm",) if server else ())),
                f"`{command} --backend local` (it runs on this machine)")
