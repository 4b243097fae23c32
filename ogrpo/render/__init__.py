"""Plan + JobSpec -> the files of one job (pure text): job.sbatch, accelerate.yaml, deepspeed.json (when the
plan picked ZeRO), run.yaml (the run config with `ogrpo.plan`, which `ogrpo train`/`serve` read) and
manifest.json. `write_job` is the only function here that touches the disk.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ogrpo import __version__, layout
from ogrpo.config import dump_yaml
from ogrpo.errors import OgrpoError
from ogrpo.planner.device_rules import rules_of
from ogrpo.planner.types import Precision


def _rules(p):
    """The device rules of a Plan (ogrpo/planner/device_rules.py)."""
    return rules_of(p)


def deepspeed_config(plan) -> dict | None:
    """DeepSpeed JSON for a ZeRO plan ("auto" values are filled by transformers from GRPOConfig)."""
    p = plan
    strategy = p.trainer.strategy
    if not strategy.uses_deepspeed:
        return None
    rules = _rules(p)
    stage = strategy.zero_stage
    zero: dict = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
                  "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update({"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                     "stage3_gather_16bit_weights_on_model_save": True})
    cfg: dict = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
    }
    cfg.update(rules.deepspeed_precision(p.precision))
    if strategy.offloads:
        zero["offload_optimizer"], top = rules.deepspeed_offload()
        cfg.update(top)
    return cfg


def accelerate_config(plan, job_dir: str) -> dict:
    p = plan
    t = p.trainer
    rules = _rules(p)
    n = int(t.num_processes)
    nodes = len(t.nodes)
    cfg: dict = {"compute_environment": "LOCAL_MACHINE", "debug": False}
    if t.strategy.uses_deepspeed and rules.deepspeed_through_accelerate:
        cfg["distributed_type"] = "DEEPSPEED"
        cfg["deepspeed_config"] = {
            "deepspeed_config_file": f"{job_dir}/deepspeed.json",
            "zero3_init_flag": t.strategy.is_zero3,
            "deepspeed_multinode_launcher": "standard",
        }
    else:
        # On CPU, MULTI_GPU + use_cpu gives real gloo workers (`--cpu` with 2 processes starts one).
        cfg["distributed_type"] = "MULTI_GPU" if n > 1 else "NO"
        cfg["mixed_precision"] = "no" if p.precision is Precision.FP32 else p.precision.value
    cfg.update({
        "downcast_bf16": "no",
        "machine_rank": 0,
        "main_training_function": "main",
        "num_machines": nodes,
        "num_processes": n,
        "rdzv_backend": "static",
        "same_network": True,
    })
    cfg.update(rules.accelerate_device_fields())  # use_cpu (and gpu_ids)
    return cfg


def run_yaml(plan, run_config) -> str:
    p = plan
    d = run_config.to_dict()
    opts = dict(d.pop("ogrpo", {}) or {})
    if p.preemption and p.preemption.save_steps is not None:
        # the checkpoint frequency the cluster's SIGTERM window needs (a listed change): the trainer reads it here,
        # where the recipe's was (its place kept, else after the recipe's keys)
        d["save_steps"] = p.preemption.save_steps
    opts["gpus"] = p.cluster.spec
    opts["profile"] = p.profile
    opts["plan"] = p.to_dict()
    d["ogrpo"] = opts
    head = ("# Resolved run config written by `ogrpo render`: the run config plus the plan under ogrpo.plan,\n"
            "# which `ogrpo train` and `ogrpo serve` apply. Re-render instead of editing the plan by hand.\n")
    return head + dump_yaml(d)


def sbatch_script(jobspec, slurm, *, title: str | None = None, summary: str = "") -> str:
    """job.sbatch for a JobSpec and its SlurmOptions: the launch layer's one renderer (ogrpo.launch.slurm.sbatch)."""
    # CLI latency: `ogrpo plan`/`render` import this module, not this
    from ogrpo.launch.slurm.sbatch import render_script

    return render_script(jobspec, slurm, title=title, summary=summary)


def job_sbatch(plan, run_config, jobspec, slurm=None) -> str:
    """job.sbatch for a plan: `slurm` (SlurmOptions) as `ogrpo submit` resolved them, else the run config's."""
    # CLI latency: `ogrpo plan`/`render` import this module, not this
    from ogrpo.launch.slurm.sbatch import options_for

    p = plan
    if slurm is None:
        slurm = options_for(p, run_config, job_name=jobspec.name)
    summary = (f"{p.cluster.spec}, {p.model.name}, mode {p.mode}, precision {p.precision}, "
               f"server GPUs {p.vllm.gpus if p.has_server else '-'}, trainer "
               f"{p.trainer.num_processes} x {p.trainer.strategy}"
               f"{'' if p.fits else ' (DOES NOT FIT: ' + '; '.join(p.reasons) + ')'}")
    return sbatch_script(jobspec, slurm, summary=summary)


def manifest(plan, run_config, jobspec, files: list[str], inputs: dict | None = None) -> str:
    p = plan
    doc = {
        "ogrpo_version": __version__,
        "inputs": {"config": run_config.source, "gpus": p.cluster.spec, "profile": p.profile,
                   "model": p.model.name, **(inputs or {})},
        "files": sorted(files),
        "plan": p.to_dict(),
        "jobspec": jobspec.to_dict(),
        "warnings": list(dict.fromkeys(list(run_config.warnings) + list(p.warnings))),
        # How the run differs from the recipe as written, each with its reason (ogrpo/fields.py, plan.py).
        "changes": [c.to_dict() for c in p.changes],
    }
    return json.dumps(doc, indent=2, sort_keys=False) + "\n"


def render_job(plan, run_config, jobspec, inputs: dict | None = None, slurm=None) -> dict[str, str]:
    """filename -> text for one job directory. `slurm`: the SlurmOptions `ogrpo submit` resolved (default: the
    run config's), so that render and submit write the same job.sbatch."""
    files: dict[str, str] = {}
    files[layout.SBATCH] = job_sbatch(plan, run_config, jobspec, slurm)
    files["accelerate.yaml"] = dump_yaml(accelerate_config(plan, jobspec.job_dir))
    ds = deepspeed_config(plan)
    if ds is not None:
        files["deepspeed.json"] = json.dumps(ds, indent=2) + "\n"
    files["run.yaml"] = run_yaml(plan, run_config)
    files[layout.MANIFEST] = manifest(plan, run_config, jobspec, list(files) + [layout.MANIFEST], inputs)
    return files


def write_job(files: dict[str, str], out_dir, force: bool = False) -> list[Path]:
    """Write the files atomically: all into a temporary directory inside the output directory (which may sit in a
    directory this user cannot write, the usual cluster layout), then moved into place one by one with os.replace.
    Refuses a path that exists and is not a directory and, without `force`, a directory that already holds one of
    the files (a job rendered or submitted before: nothing already written is lost); nothing is written on
    error."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OgrpoError(f"-o {out}: exists and is not a directory; choose another output directory")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise OgrpoError(f"-o {out}: cannot write in {existing}; choose a writable directory")
    present = [name for name in files if os.path.lexists(out / name)] if out.is_dir() else []
    if present and not force:
        raise OgrpoError(f"-o {out}: already holds {', '.join(present)} from an earlier job; pass --force to replace "
                         "them, or choose another output directory")
    # Missing directories are created (like `mkdir -p`) and removed again if the write fails.
    created = [d for d in [out, *out.parents] if not d.exists()]
    written: list[Path] = []
    tmp = None
    ok = False
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".ogrpo-render.", dir=out))
        for name, text in files.items():
            (tmp / name).write_text(text)
            if name.endswith(".sbatch"):
                os.chmod(tmp / name, 0o755)
        (out / layout.LOGS).mkdir(exist_ok=True)
        for name in files:
            os.replace(tmp / name, out / name)
            written.append(out / name)
        ok = True
    except OSError as exc:  # a file system that refuses (root passes access(), /proc does not), a full disk
        what = f"{exc.filename}: " if exc.filename and Path(exc.filename).parent != tmp else ""  # what is in the way
        raise OgrpoError(f"-o {out}: cannot write the job there ({what}{exc.strerror or exc}); choose another output "
                         "directory") from None
    finally:
        if tmp is not None:
            for leftover in tmp.iterdir():
                leftover.unlink()
            tmp.rmdir()
        if not ok:
            for d in created:  # innermost first
                if d.is_dir() and not any(d.iterdir()):
                    d.rmdir()
    return written
