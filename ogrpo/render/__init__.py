"""Plan + JobSpec -> the files of one job (pure text): job.sbatch, accelerate.yaml, deepspeed.json (when the
plan picked ZeRO), run.yaml (the run config with `ogrpo.plan`, which `ogrpo train`/`serve` read) and
manifest.json. `write_job` is the only function here that touches the disk.
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
from pathlib import Path

from ogrpo import __version__
from ogrpo.errors import OgrpoError

TEMPLATES = Path(__file__).with_name("templates")

# Placeholders of Step.argv as the sbatch's bash variables.
_BASH_VARS = {
    "{job_dir}": "$JOB_DIR",
    "{server_host}": "$SERVER_HOST",
    "{server_port}": "$SERVER_PORT",
    "{rendezvous_host}": "$RENDEZVOUS_HOST",
    "{rendezvous_port}": "$RENDEZVOUS_PORT",
    "{node_rank}": "$SLURM_PROCID",
}


def _plan_dict(plan) -> dict:
    return plan.to_dict() if hasattr(plan, "to_dict") else dict(plan)


def deepspeed_config(plan) -> dict | None:
    """DeepSpeed JSON for a ZeRO plan ("auto" values are filled by transformers from GRPOConfig)."""
    p = _plan_dict(plan)
    strategy = p["trainer"]["strategy"]
    if strategy == "ddp":
        return None
    stage = 2 if strategy == "zero2" else 3
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
    if p["precision"] == "fp16":
        # V100: dynamic loss scaling (loss_scale 0) starting at 2^16 (shared/compat.md).
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1}
        cfg["bf16"] = {"enabled": False}
    else:
        cfg["bf16"] = {"enabled": True}
        cfg["fp16"] = {"enabled": False}
    if strategy == "zero3_offload":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        # ZeRO-Offload steps the optimizer on the CPU: it needs DeepSpeed's CPU Adam, not the client's.
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                         "weight_decay": "auto"}}
    return cfg


def accelerate_config(plan, job_dir: str) -> dict:
    p = _plan_dict(plan)
    t = p["trainer"]
    is_cpu = bool(p["cluster"]["gpu"]["is_cpu"])
    n = int(t["num_processes"])
    nodes = len(t["nodes"])
    cfg: dict = {"compute_environment": "LOCAL_MACHINE", "debug": False}
    if t["strategy"] != "ddp" and not is_cpu:
        cfg["distributed_type"] = "DEEPSPEED"
        cfg["deepspeed_config"] = {
            "deepspeed_config_file": f"{job_dir}/deepspeed.json",
            "zero3_init_flag": t["strategy"].startswith("zero3"),
            "deepspeed_multinode_launcher": "standard",
        }
    else:
        # On CPU, MULTI_GPU + use_cpu gives real gloo workers (`--cpu` with 2 processes starts one).
        cfg["distributed_type"] = "MULTI_GPU" if n > 1 else "NO"
        cfg["mixed_precision"] = {"bf16": "bf16", "fp16": "fp16"}.get(p["precision"], "no")
    cfg.update({
        "downcast_bf16": "no",
        "machine_rank": 0,
        "main_training_function": "main",
        "num_machines": nodes,
        "num_processes": n,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": is_cpu,
    })
    if not is_cpu:
        cfg["gpu_ids"] = "all"
    return cfg


def run_yaml(plan, run_config) -> str:
    from ogrpo.config import dump_yaml

    p = _plan_dict(plan)
    d = run_config.to_dict()
    opts = dict(d.pop("ogrpo", {}) or {})
    opts["gpus"] = p["cluster"]["spec"]
    opts["profile"] = p["profile"]
    opts["plan"] = p
    d["ogrpo"] = opts
    head = ("# Resolved run config written by `ogrpo render`: the run config plus the plan under ogrpo.plan,\n"
            "# which `ogrpo train` and `ogrpo serve` apply. Re-render instead of editing the plan by hand.\n")
    return head + dump_yaml(d)


def _arg(a: str) -> str:
    text = a
    for ph, var in _BASH_VARS.items():
        text = text.replace(ph, var)
    if "$" in text:
        return '"' + text.replace('"', '\\"') + '"'
    return shlex.quote(text)


def _lines(srun: list[str], command: list[str]) -> str:
    """srun options one per line, then `env` assignments, then the command with each `--flag value` pair on
    its own line: readable, and a diff shows which setting changed."""
    rows = list(srun)
    cur: list[str] = []
    for tok in command:
        starts_option = tok.startswith("-") and not tok.lstrip("-").isdigit()
        if cur and (starts_option or cur[0] == "env") and not (cur[0] == "env" and "=" in tok):
            rows.append(" ".join(cur))
            cur = []
        if cur and cur[-1].startswith("-") and not starts_option and len(cur) >= 2 and cur[0].startswith("-"):
            rows.append(" ".join(cur))
            cur = []
        cur.append(tok)
    if cur:
        rows.append(" ".join(cur))
    return " \\\n  ".join(rows)


def _env_prefix(env: dict, exclude: dict) -> list[str]:
    own = {k: v for k, v in env.items() if exclude.get(k) != v}
    if not own:
        return []
    return ["env"] + [f"{k}={shlex.quote(str(v))}" for k, v in sorted(own.items())]


def _srun(step, p: dict, cpus: int, log: str) -> list[str]:
    is_cpu = bool(p["cluster"]["gpu"]["is_cpu"])
    nodes = len(step.nodes)
    opts = ["srun", "--exact", f"--nodes={nodes}", f"--ntasks={step.ntasks}"]
    if nodes > 1:
        opts.append("--ntasks-per-node=1")
    if step.nodes == [0]:
        opts.append('--nodelist="${NODES[0]}"')
    else:
        opts.append('--nodelist="$TRAINER_NODELIST"')
    if not is_cpu:
        opts.append(f"--gres=gpu:{len(step.gpus)}")
    opts.append(f"--cpus-per-task={cpus}")
    opts.append(f'--output="$JOB_DIR/logs/{log}.log"')
    return opts


def _cpus_per_device(p: dict, run_config) -> int:
    cpg = getattr(getattr(run_config, "ogrpo", None), "cpus_per_gpu", None)
    if cpg:
        return int(cpg)
    return 1 if p["cluster"]["gpu"]["is_cpu"] else 8


def job_sbatch(plan, run_config, jobspec) -> str:
    p = _plan_dict(plan)
    opts = run_config.ogrpo
    cl = p["cluster"]
    is_cpu = bool(cl["gpu"]["is_cpu"])
    gpn = int(cl["gpus_per_node"])
    cpd = _cpus_per_device(p, run_config)
    lines = [f"#SBATCH --job-name={jobspec.name}", f"#SBATCH --nodes={cl['nodes']}", "#SBATCH --ntasks-per-node=1"]
    if is_cpu:
        lines.append(f"#SBATCH --cpus-per-task={cpd * gpn}")
    else:
        lines.append(f"#SBATCH --gres=gpu:{gpn}")
        lines.append(f"#SBATCH --cpus-per-task={cpd * gpn}")
        if opts.mem_per_gpu:
            lines.append(f"#SBATCH --mem-per-gpu={opts.mem_per_gpu}")
    for key, flag in (("partition", "partition"), ("account", "account"), ("qos", "qos"), ("time", "time")):
        val = getattr(opts, key)
        if val:
            lines.append(f"#SBATCH --{flag}={val}")
    lines.append(f"#SBATCH --output={jobspec.job_dir}/logs/slurm-%j.out")
    lines.append("#SBATCH --open-mode=append")

    env_lines = [f"export {k}={shlex.quote(str(v))}" for k, v in sorted(jobspec.env.items())] or [":"]

    server = jobspec.step("server")
    trainer = jobspec.step("trainer")
    if trainer.nodes and trainer.nodes[0] != 0:
        rdzv = "${NODES[" + str(trainer.nodes[0]) + "]}"
    else:
        rdzv = "$SERVER_HOST"

    server_block = ""
    if server is not None:
        scpus = cpd * max(1, len(server.gpus))
        srun_opts = _srun(server, p, scpus, "server")
        inner = _env_prefix(server.env, jobspec.env) + [_arg(a) for a in server.argv]
        tmo = jobspec.health_timeout_s
        server_block = "\n".join([
            "",
            f"# vLLM server: {p['vllm']['num_gpus'] or 1} {'process' if is_cpu else 'GPU(s)'}, tensor parallel "
            f"{p['vllm']['tensor_parallel_size']}, in the background.",
            _lines(srun_opts, inner) + " &",
            "SERVER_PID=$!",
            "",
            "# Wait for the server's health endpoint; fail fast if its step dies first.",
            f"deadline=$((SECONDS + {tmo}))",
            f'until curl -fsS -o /dev/null "http://$SERVER_HOST:$SERVER_PORT{jobspec.health_path}" 2>/dev/null; do',
            '  if ! kill -0 "$SERVER_PID" 2>/dev/null; then',
            '    echo "ogrpo: the server step exited before it was healthy; see $JOB_DIR/logs/server.log" >&2',
            "    exit 1",
            "  fi",
            "  if (( SECONDS >= deadline )); then",
            f'    echo "ogrpo: the server was not healthy after {tmo} s; see $JOB_DIR/logs/server.log" >&2',
            "    exit 1",
            "  fi",
            '  sleep "${OGRPO_HEALTH_POLL_S:-5}"',
            "done",
            'echo "ogrpo: server healthy at $SERVER_HOST:$SERVER_PORT"',
        ])

    tcpus = cpd * (max(1, len(trainer.gpus)) if not is_cpu else max(1, int(p["trainer"]["num_processes"])))
    tl = [""]
    if trainer.nodes != [0]:
        first, count = trainer.nodes[0], len(trainer.nodes)
        tl.append(f'TRAINER_NODELIST="$(IFS=,; echo "${{NODES[*]:{first}:{count}}}")"')
    tl.append(f"# Trainer: {p['trainer']['num_processes']} process(es), {p['trainer']['strategy']}.")
    srun = _srun(trainer, p, tcpus, "trainer")
    inner = _env_prefix(trainer.env, jobspec.env) + [_arg(a) for a in trainer.argv]
    if len(trainer.nodes) > 1:
        # One launcher per node; each needs its own rank, known only inside the task.
        tl.append("# shellcheck disable=SC2016  # expanded by the per-node shell, not here")
        tl.append(_lines(srun, ["bash", "-c"]) + " " + shlex.quote("exec " + " ".join(inner)) + " &")
    else:
        tl.append(_lines(srun, inner) + " &")
    tl.append("TRAINER_PID=$!")
    tl.append("")
    if server is not None:
        tl += [
            "# The job ends with the trainer; a server that dies mid-run stops it (it would wait on HTTP).",
            'while kill -0 "$TRAINER_PID" 2>/dev/null; do',
            '  if ! kill -0 "$SERVER_PID" 2>/dev/null; then',
            '    echo "ogrpo: the server step died; stopping the trainer (see $JOB_DIR/logs/server.log)" >&2',
            "    exit 1",
            "  fi",
            '  sleep "${OGRPO_WATCH_POLL_S:-10}"',
            "done",
        ]
    tl += [
        "rc=0",
        'wait "$TRAINER_PID" || rc=$?',
        'TRAINER_PID=""',
        'echo "ogrpo: trainer exited with $rc"',
        'exit "$rc"',
    ]

    summary = (f"{cl['spec']}, {p['model']['name']}, mode {p['mode']}, precision {p['precision']}, "
               f"server GPUs {p['vllm']['gpus'] if p['mode'] == 'server' else '-'}, trainer "
               f"{p['trainer']['num_processes']} x {p['trainer']['strategy']}"
               f"{'' if p['fits'] else ' (DOES NOT FIT: ' + '; '.join(p['reasons']) + ')'}")
    text = (TEMPLATES / "job.sbatch").read_text()
    subs = {
        "@@TITLE@@": f"O-GRPO job {jobspec.name}",
        "@@VERSION@@": __version__,
        "@@SUMMARY@@": summary,
        "@@SBATCH@@": "\n".join(lines),
        "@@JOB_DIR@@": jobspec.job_dir,
        "@@ENV@@": "\n".join(env_lines),
        "@@RENDEZVOUS_HOST@@": rdzv,
        "@@SERVER@@": server_block,
        "@@TRAINER@@": "\n".join(tl),
    }
    for k, v in subs.items():
        text = text.replace(k, v)
    return text


def manifest(plan, run_config, jobspec, files: list[str], inputs: dict | None = None) -> str:
    p = _plan_dict(plan)
    doc = {
        "ogrpo_version": __version__,
        "inputs": {"config": run_config.source, "gpus": p["cluster"]["spec"], "profile": p["profile"],
                   "model": p["model"]["name"], **(inputs or {})},
        "files": sorted(files),
        "plan": p,
        "jobspec": jobspec.to_dict(),
        "warnings": list(run_config.warnings),
    }
    return json.dumps(doc, indent=2, sort_keys=False) + "\n"


def render_job(plan, run_config, jobspec, inputs: dict | None = None) -> dict[str, str]:
    """filename -> text for one job directory."""
    from ogrpo.config import dump_yaml

    files: dict[str, str] = {}
    files["job.sbatch"] = job_sbatch(plan, run_config, jobspec)
    files["accelerate.yaml"] = dump_yaml(accelerate_config(plan, jobspec.job_dir))
    ds = deepspeed_config(plan)
    if ds is not None:
        files["deepspeed.json"] = json.dumps(ds, indent=2) + "\n"
    files["run.yaml"] = run_yaml(plan, run_config)
    files["manifest.json"] = manifest(plan, run_config, jobspec, list(files) + ["manifest.json"], inputs)
    return files


def write_job(files: dict[str, str], out_dir) -> list[Path]:
    """Write the files atomically: all into a temporary sibling directory, then moved into place one by one
    with os.replace. Refuses a path that exists and is not a directory; nothing is written on error."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OgrpoError(f"-o {out}: exists and is not a directory; choose another output directory")
    parent = out.parent if str(out.parent) else Path(".")
    existing = parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise OgrpoError(f"-o {out}: cannot write in {existing}; choose a writable directory")
    # Missing parents are created (like `mkdir -p`) and removed again if the write fails.
    created = [d for d in [parent, *parent.parents] if not d.exists()]
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    written: list[Path] = []
    ok = False
    try:
        for name, text in files.items():
            (tmp / name).write_text(text)
            if name.endswith(".sbatch"):
                os.chmod(tmp / name, 0o755)
        out.mkdir(exist_ok=True)
        (out / "logs").mkdir(exist_ok=True)
        for name in files:
            os.replace(tmp / name, out / name)
            written.append(out / name)
        ok = True
    finally:
        for leftover in tmp.iterdir():
            leftover.unlink()
        tmp.rmdir()
        if not ok:
            for d in created:  # innermost first
                if d.is_dir() and not any(d.iterdir()):
                    d.rmdir()
    return written
