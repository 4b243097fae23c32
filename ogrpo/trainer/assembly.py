"""`ogrpo train`: run config (+ plan) → TRL GRPOTrainer with the plan's settings, profiled, in a run directory.

Order matters: everything the user can get wrong (config, model path, rewards, dataset, GRPOConfig values) is
checked before the run directory is created, so bad input gives one line and leaves nothing behind.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ogrpo import tiny
from ogrpo.compat import replace_trl_range_warning, trl_imports
from ogrpo.config import load_run_config
from ogrpo.device_check import check_devices
from ogrpo.dtypes import from_trainer_flags
from ogrpo.errors import NoFitError, OgrpoError
from ogrpo.kernels.fused_sample import implementation
from ogrpo.launch import run_state
from ogrpo.launch.ports import free_ports
from ogrpo.overlap import zero3_push
from ogrpo.overlap.pipeline import OFF, ONE_STEP, plan_mode, unsupported
from ogrpo.patches import transformers_fused_sample
from ogrpo.patches import trl_colocate_cpu as colocate_cpu
from ogrpo.plan import Plan, plan_from_config
from ogrpo.planner.types import OldPolicyPass, OverlapStream
from ogrpo.profile import timeline
from ogrpo.profile.profiler import StageProfiler, render_table, summarize
from ogrpo.rewards.registry import resolve_rewards
from ogrpo.sandbox import policy as sandbox_policy
from ogrpo.serve import client
from ogrpo.trainer import data_fingerprint, model_revision, rundir
from ogrpo.trainer.callbacks import default_callbacks, use_quiet_progress
from ogrpo.trainer.data import chat_prompts, load_prompts
from ogrpo.trainer.peft_config import peft_config
from ogrpo.trainer.settings import build_grpo_config, grpo_config_kwargs
from ogrpo.trainer.guard import NonFiniteError


@dataclass
class Prepared:
    """Everything validated, nothing written yet."""

    run_config: object
    plan: object  # Plan (ogrpo/planner/types.py)
    model_path: str
    run_dir: Path
    args: object  # GRPOConfig
    tokenizer: object
    dataset: object
    reward_funcs: list
    resume_from: str | None
    notes: list[str] = field(default_factory=list)
    data: dict | None = None  # the dataset's fingerprint (ogrpo/trainer/data_fingerprint.py)
    model_commit: str | None = None  # the hub commit of the model (ogrpo/trainer/model_revision.py)


def load_config(source, overrides: dict | None = None):
    return load_run_config(source, overrides)


def resolve_model_path(name) -> str:
    """A built-in tiny model (built on demand), a local directory with config.json, or a hub name."""
    if not name:
        raise OgrpoError("no model: set model_name_or_path in the run config (a local directory, a hub name, or "
                         "ogrpo:tiny)")
    if tiny.builtin_model(name):
        return str(tiny.ensure_model(name))
    path = Path(str(name)).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise OgrpoError(f"model path {name} has no config.json; point model_name_or_path at a directory "
                             "written by save_pretrained (or a hub name)")
        return str(path)
    if path.exists():
        raise OgrpoError(f"model path {name} is a file; point model_name_or_path at the model's directory")
    if str(name).startswith(("/", ".", "~")) or str(name).count("/") > 1:
        raise OgrpoError(f"model path {name} does not exist; fix model_name_or_path")
    return str(name)  # a hub name: transformers resolves it (cache or network)


def plan_for(run_config, model_path: str, gpus: str | None = None):
    """The Plan a rendered config carries (its dict form, parsed here once), else a plan for this machine."""
    carried = getattr(run_config.ogrpo, "plan", None)
    if carried:
        return Plan.from_dict(carried)
    if gpus is None:
        import torch

        gpus = None if torch.cuda.is_available() else "cpu"
    plan = plan_from_config(run_config, gpus=gpus, model=model_path)
    if not plan.fits:
        reasons = "; ".join(plan.reasons) or "does not fit"
        fixes = "; ".join(plan.fixes)
        raise NoFitError(f"plan does not fit: {reasons}" + (f"; try: {fixes}" if fixes else ""))
    return plan


def apply_env(plan) -> None:
    """The Plan's environment for this process (what the launcher sets for a job's steps)."""
    for key, value in plan.env.items():
        os.environ.setdefault(key, str(value))
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        import torch

        torch.set_num_threads(int(threads))


def load_tokenizer(model_path: str, trl: dict):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model_path, revision=trl.get("model_revision") or None,
                                            trust_remote_code=bool(trl.get("trust_remote_code")))
    except Exception as exc:  # OSError for missing files/hub, ValueError for unknown tokenizer classes
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OgrpoError(f"model {model_path!r}: cannot load its tokenizer ({type(exc).__name__}: {first}); "
                         "check model_name_or_path") from None
    if trl.get("chat_template"):
        # open-r1's `chat_template`: the template its recipe trains with replaces the tokenizer's own (TRL
        # applies the processing class's template to conversational prompts in every mode)
        tok.chat_template = trl["chat_template"]
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def default_run_dir(run_config) -> Path:
    stem = Path(str(getattr(run_config, "source", "run"))).stem or "run"
    return Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def _resume_from(run_dir: Path, resume: str | None, recipe: str | None = None) -> str | None:
    """The checkpoint to resume from: --resume (auto: the run directory's last complete checkpoint), else the
    recipe's `resume_from_checkpoint` (as TRL's scripts read it); `auto` falls back to the recipe's where the run
    directory has none yet (a job's first start)."""
    # heavy: torch, transformers
    from ogrpo.trainer import preemption

    if run_dir.exists() and not run_dir.is_dir():
        raise OgrpoError(f"--output-dir {run_dir}: a file is in the way (the run directory must be a directory)")
    if recipe is not None and not (Path(recipe).expanduser() / "trainer_state.json").is_file():
        raise OgrpoError(f"resume_from_checkpoint {recipe}: not a checkpoint directory (no trainer_state.json)")
    recipe = str(Path(recipe).expanduser()) if recipe is not None else None
    if resume in (None, "", "no", "never"):
        if preemption.complete_checkpoints(run_dir):
            raise OgrpoError(f"{run_dir} already has checkpoints; pass --resume auto to continue that run or "
                             "choose a new --output-dir")
        if run_dir.is_dir() and any(run_dir.iterdir()):
            # a new run writes its manifest, logs and model card there: what the directory holds would be lost
            raise OgrpoError(f"--output-dir {run_dir} is not empty; choose a new or empty directory (or pass "
                             "--resume auto to continue a run there)")
        return recipe
    if resume == "auto":
        return preemption.resume_checkpoint(run_dir) or recipe
    path = Path(resume).expanduser()
    if not (path / "trainer_state.json").is_file():
        raise OgrpoError(f"--resume {resume}: not a checkpoint directory (no trainer_state.json); pass --resume "
                         "auto or a checkpoint-N directory")
    return str(path)


def check_server_url(url: str | None) -> None:
    """--vllm-url as http(s)://HOST[:PORT][/PATH]: anything else would have the trainer wait out the server
    timeout (900 s) for a server it cannot reach, then fail."""
    if url is None:
        return
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port is None or parts.port > 0)
    except ValueError:  # a port that is no number or out of range
        ok = False
    if not ok:
        raise OgrpoError(f"--vllm-url {url!r}: expected http://HOST:PORT (the server `ogrpo serve` started)")


def prepare(config, output_dir=None, vllm_url: str | None = None, resume: str | None = None,
            overrides: dict | None = None, gpus: str | None = None) -> Prepared:
    """Validate everything and build the trainer's inputs. Writes nothing except the tiny-model cache."""

    pair_note = replace_trl_range_warning()
    check_server_url(vllm_url)

    rc = load_config(config, overrides)
    model_path = resolve_model_path(rc.trl.get("model_name_or_path"))
    funcs, weights = resolve_rewards(rc.trl.get("reward_funcs"),
                                     rc.ogrpo.reward_weights if rc.ogrpo.reward_weights is not None
                                     else rc.trl.get("reward_weights"), params=rc.trl)

    sandbox_policy.configure(rc)  # code rewards fail closed at job start, not at the first reward
    plan = plan_for(rc, model_path, gpus)

    check_devices(plan, "trainer")  # a GPU plan refuses a process without its GPUs: one line, in seconds
    apply_env(plan)
    dataset = load_prompts(rc.trl, rc.ogrpo.prompt_column, rc.ogrpo.system_prompt)
    data = data_fingerprint.fingerprint(dataset)
    data_fingerprint.check_pinned(data, rc.ogrpo.data_sha256, rc.trl.get("dataset_name") or "dataset_mixture")
    tokenizer = load_tokenizer(model_path, rc.trl)
    commit = model_revision.hub_commit(model_path, rc.trl.get("model_revision"))
    if getattr(tokenizer, "chat_template", None) is None and chat_prompts(dataset):
        raise OgrpoError(f"the prompts are chat messages, and the tokenizer of {model_path} has no chat template "
                         "to render them; set chat_template in the run config, or give text prompts")
    run_dir = Path(output_dir).expanduser() if output_dir else default_run_dir(rc)
    recipe_resume = rc.trl.get("resume_from_checkpoint")
    resume_from = _resume_from(run_dir, resume, str(recipe_resume) if recipe_resume not in (None, "") else None)
    trl = dict(rc.trl)
    trl["model_name_or_path"] = model_path
    if weights is not None:
        trl["reward_weights"] = weights
    _, notes = grpo_config_kwargs(trl, plan, run_dir, vllm_url, config_source=rc.source)
    notes = ([pair_note] if pair_note else []) + notes
    if resume_from and (changed := data_fingerprint.resumed_note(data, rundir.recorded(run_dir, "data"))):
        notes.append(changed)
    args = build_grpo_config(trl, plan, run_dir, vllm_url, config_source=rc.source)
    return Prepared(rc, plan, model_path, run_dir, args, tokenizer, dataset, funcs, resume_from, notes, data,
                    commit)


def install_vllm_hooks(p: Prepared) -> None:
    """TRL's weight sync, bounded and in the server's dtype (GPU), or our CPU replacements (server: the
    cpu_shm client; colocate: an in-process engine)."""
    args = p.args
    if not getattr(args, "use_vllm", False):
        return
    import torch

    vargs = p.plan.vllm.args
    expect = None
    if args.vllm_mode == "server":
        trl = {**p.run_config.trl, "model_name_or_path": p.model_path}  # the path the server was given
        # the plan this trainer runs, carried or made here: its max_model_len is the server's
        # the server's dtype is the plan's (a bf16 server beside an fp32 CPU trainer where measured costs chose it)
        expect = client.expected_from_run_config(trl, p.run_config.ogrpo.to_dict(),
                                                 dtype=vargs.dtype or _trainer_dtype(p), plan=p.plan)
    if torch.cuda.is_available():
        client.install_gpu_sync_timeout(expect=expect, push_dtype=vargs.dtype or _trainer_dtype(p))
        return
    if args.vllm_mode == "server":
        client.install_cpu_client(expect, seed=args.seed)  # seeded requests: a rerun samples the same
    elif args.vllm_mode == "colocate":
        dtype = vargs.dtype or _trainer_dtype(p)
        colocate_cpu.install(dtype=dtype, enforce_eager=True if vargs.enforce_eager is None else vargs.enforce_eager,
                             memory_share=float(vargs.gpu_memory_utilization or colocate_cpu.CPU_MEMORY_SHARE),
                             kv_cache_bytes=vargs.kv_cache_memory_bytes)


def install_kernels(trainer, plan) -> dict:
    """O-GRPO's kernels the Plan chose (`plan.kernels`), each verified on first use against its reference;
    returns what was installed and which implementation runs, for the manifest."""
    chosen = plan.kernels
    out: dict = {}
    if chosen.linear_logprobs:
        out["linear_logprobs"] = trainer.use_linear_logprobs()  # OgrpoError if TRL's method moved
    if chosen.fused_sample and not getattr(trainer.args, "use_vllm", False):
        transformers_fused_sample.install(trainer)
        out["fused_sample"] = {"installed": True, "implementation": implementation("cpu" if trainer.args.use_cpu
                                                                                  else "cuda")}
    return out


def install_overlap(trainer, plan, asked: str | None = None) -> dict | None:
    """The plan's ogrpo.overlap (ogrpo/overlap/pipeline.py) wired into the trainer; None when it is `off`, which
    installs nothing. A mode the run config asked for (`asked`) that cannot apply to this trainer is an error; the
    plan's default falls back to `off` with a note (what only the built trainer shows: tools, a rollout_func)."""
    mode = plan_mode(plan)
    if mode == OFF:
        return None
    problems = unsupported(trainer.args, trainer)
    if problems and not asked:
        print(f"note: ogrpo.overlap {mode} (the plan's default) does not apply: {'; '.join(problems)}; running off",
              file=sys.stderr, flush=True)
        return {"mode": OFF, "reason": "; ".join(problems)}

    installed = trainer.pipeline_generation(mode, stream=plan.overlap_stream is OverlapStream.GROUPS)
    if mode == ONE_STEP:
        if zero3_push.why_not(trainer) is None:  # ZeRO-3: one gather per step, while the server generates
            zero3_push.install(trainer)  # its counts go into the manifest (zero3_push) when training ends
    return installed


def install_old_policy(trainer, plan) -> dict | None:
    """The plan's `old_policy_pass`: the old-policy log-probs from the loss forward (ogrpo/trainer/old_policy.py)
    where the plan says so and the built trainer agrees (it alone sees dropout and vision inputs); what runs and
    why, for the manifest."""
    planned = plan.old_policy_pass
    if planned is not OldPolicyPass.FROM_LOSS:
        return None if planned is None else {"pass": planned, "reason": plan.reason_of("old_policy_pass")}
    reason = trainer.old_policy_from_loss()
    if reason:
        print(f"note: old_policy_pass from_loss (the plan's) does not apply: {reason}; TRL's own pass runs",
              file=sys.stderr, flush=True)
        return {"pass": "separate", "reason": reason}
    return {"pass": "from_loss", "reason": None}


def install_train_ahead(trainer, plan) -> dict | None:
    """The plan's `overlap.train_ahead`: each streamed group's loss forward/backward while the server generates
    the rest (ogrpo/overlap/train_ahead.py), where the built trainer agrees; what runs and why, for the manifest.
    After the old-policy layer: whether TRL's separate pass still runs is part of the trainer's answer."""
    if not plan.train_ahead:
        return None if plan.train_ahead is None else {"on": False, "reason": plan.reason_of("overlap.train_ahead")}
    reason = trainer.train_groups_ahead()
    if reason:
        print(f"note: overlap.train_ahead (the plan's) does not apply: {reason}; the loss runs after the batch",
              file=sys.stderr, flush=True)
        return {"on": False, "reason": reason}
    if plan.early_backward is None:
        return {"on": True, "reason": None}
    trainer.overlap.early_backward = plan.early_backward  # the trainer's loss still decides (early_backward)
    trainer.overlap.early_backward_groups = plan.early_backward_groups
    return {"on": True, "reason": None,
            "early_backward": {"on": plan.early_backward, "reason": plan.reason_of("overlap.early_backward"),
                               "groups": plan.early_backward_groups}}


def install_rank_balance(trainer, plan) -> dict | None:
    """The plan's `rank_balance`: the ranks exchange scored rows to hold even tokens (ogrpo/trainer/rank_balance.py)
    where the built trainer agrees; what runs and why, for the manifest. After train_ahead, which rules it out."""
    if not plan.rank_balance:
        return None if plan.rank_balance is None else {"on": False, "reason": plan.reason_of("rank_balance")}
    reason = trainer.balance_ranks()
    if reason:
        print(f"note: rank_balance (the plan's) does not apply: {reason}; each rank computes the rows it sampled "
              "for", file=sys.stderr, flush=True)
        return {"on": False, "reason": reason}
    return {"on": True, "reason": None}


def install_packing(trainer, plan) -> dict | None:
    """The plan's `padding_free`: packed log-prob passes (ogrpo/trainer/packing.py) where the built model allows
    them exactly; what runs and why, for the manifest."""
    if not plan.padding_free:
        return None if plan.padding_free is None else {"on": False, "reason": plan.reason_of("padding_free")}
    reason = trainer.pack_sequences()
    if reason:
        print(f"note: padding_free (the plan's) does not apply: {reason}; TRL's padded passes run", file=sys.stderr,
              flush=True)
        return {"on": False, "reason": reason}
    if plan.padding_free_layout is not None:  # "rows": no prompt computed once for its rows
        trainer.packing.layout = plan.padding_free_layout
        return {"on": True, "reason": None, "layout": plan.padding_free_layout}
    return {"on": True, "reason": None}


def _trainer_dtype(p: Prepared) -> str:
    return from_trainer_flags(p.args) or "float32"


def init_cpu_deepspeed(p: Prepared) -> None:
    """A CPU ZeRO run (GRPOConfig.deepspeed, ogrpo/trainer/settings.py) starts torch.distributed through
    accelerate's CPU state, which never initializes deepspeed.comm; ZeRO-3's zero.Init at model load then reads
    a world size of 1 and refuses the batch sizes ("16 != 8 * 1 * 1"). Wrapping the existing gloo group first
    gives it the real one. A single process started without a launcher (`ogrpo train` on a `cpu` plan) has no
    group at all, and DeepSpeed would go looking for MPI: it gets a one-process gloo group instead."""
    if not getattr(p.args, "deepspeed", None) or not getattr(p.args, "use_cpu", False):
        return
    import deepspeed
    import torch.distributed

    if not torch.distributed.is_initialized() and "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": str(free_ports(1, "127.0.0.1")[0])})
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())


def _trl_needs_vllm(args) -> bool:
    """Whether this trainer uses vLLM's modules through TRL: to generate in process (colocate), or to push weights
    over vLLM's NCCL engine (server mode on a GPU). On CPU, server mode pushes through the cpu_shm client
    (`install_vllm_hooks`), which on TRL's vLLM-API line uses none of them."""
    if not getattr(args, "use_vllm", False):
        return False
    if args.vllm_mode != "server":
        return True
    import torch

    return torch.cuda.is_available() or client.cpu_client_needs_vllm()


def _loading_trl(p: Prepared, own_process: bool):
    return trl_imports(needs_vllm=_trl_needs_vllm(p.args) or not own_process)


BUILD_ERROR = "trainer-build-error.txt"  # in the run directory: the traceback behind a one-line build error


def build_trainer(p: Prepared, own_process: bool = False):
    """`own_process`: this process exists for this one run (the trainer entry points), so TRL's modules may load
    without vLLM where the run does not use it (`_trl_needs_vllm`); in a process that may run more (a test, a
    notebook), TRL is imported as it is, since a module imported without vLLM stays so for the process's life."""
    with _loading_trl(p, own_process):
        # heavy: trl, torch
        from ogrpo.trainer.grpo import OgrpoGRPOTrainer

    return OgrpoGRPOTrainer(model=p.model_path, reward_funcs=p.reward_funcs, args=p.args, train_dataset=p.dataset,
                       processing_class=p.tokenizer, peft_config=peft_config(p.run_config.trl))


def train(config, output_dir=None, vllm_url: str | None = None, resume: str | None = None,
          overrides: dict | None = None, gpus: str | None = None, console=None, own_process: bool = False) -> Path:
    """Run one GRPO training; returns the run directory. `own_process`: see `build_trainer`."""
    from rich.console import Console

    console = console or Console()  # results on stdout; progress (tqdm) and logs on stderr
    p = prepare(config, output_dir, vllm_url, resume, overrides, gpus)
    run_dir = p.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    is_main = int(os.environ.get("RANK", "0")) == 0
    if is_main:
        for note in p.notes:  # also in the manifest
            print(f"note: {note}", file=sys.stderr, flush=True)
    if is_main:
        if p.resume_from:
            rundir.rewind_logs(run_dir, rundir.checkpoint_step(p.resume_from))
        rundir.write_manifest(run_dir, config=p.run_config.to_dict(), plan=p.plan.to_dict(), seed=p.args.seed,
                              model_path=p.model_path,
                              extra={"grpo_config": _config_summary(p.args), "notes": p.notes, "data": p.data,
                                     "model_revision": p.model_commit,
                                     "resumed_from": p.resume_from, "status": "running"})
    with _loading_trl(p, own_process):  # the hooks import TRL's client module
        install_vllm_hooks(p)
    init_cpu_deepspeed(p)
    try:
        trainer = build_trainer(p, own_process)
    except OgrpoError:
        raise
    except Exception as exc:  # what the recipe asks that this node cannot give (a logger not installed, a hub
        # out of reach): one line, the manifest saying so, not a traceback
        import traceback

        why = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        where = ""
        if is_main:
            run_state.record_status(run_dir, "failed", why)
            (run_dir / BUILD_ERROR).write_text(traceback.format_exc())
            where = f" (traceback: {run_dir / BUILD_ERROR})"
        raise OgrpoError(f"TRL's trainer could not be built from {p.run_config.source or 'the run config'}: "
                         f"{why}{where}") from exc
    # the layers of OgrpoGRPOTrainer (ogrpo/trainer/grpo.py) turned on; their order is the class's, not this one.
    # Always on: the generation stream's state (one-step's batch in flight, the seed counter) goes into each
    # checkpoint, so a resumed server-mode run samples what the uninterrupted one did.
    kernels = install_kernels(trainer, p.plan)
    if is_main and kernels:
        run_state.update_manifest(run_dir, kernels=kernels)
    overlap = install_overlap(trainer, p.plan, getattr(p.run_config.ogrpo, "overlap", None))
    if is_main and overlap:
        run_state.update_manifest(run_dir, overlap=overlap)
    old_policy = install_old_policy(trainer, p.plan)
    if is_main and old_policy:
        run_state.update_manifest(run_dir, old_policy_pass=old_policy)
    ahead = install_train_ahead(trainer, p.plan)
    if is_main and ahead:
        run_state.update_manifest(run_dir, train_ahead=ahead)
    unit = trainer.stream_completions()  # after the layers whose passes and losses run per completion
    if is_main and unit:
        run_state.update_manifest(run_dir, overlap={**overlap, **unit})
    balance = install_rank_balance(trainer, p.plan)
    if is_main and balance:
        run_state.update_manifest(run_dir, rank_balance=balance)
    packing = install_packing(trainer, p.plan)
    if is_main and packing:
        run_state.update_manifest(run_dir, padding_free=packing)
    prefixes = trainer.stream_prefixes()  # after the padding-free layer, whose positions the pieces give
    if is_main and prefixes:
        run_state.update_manifest(run_dir, overlap={**(overlap or {}), **(unit or {}), **prefixes})
    profiler = StageProfiler(run_dir / rundir.PROFILE if is_main else None, memory_terms=p.plan.trainer.memory_terms)
    profiler.attach(trainer)  # after the overlap: its timeline and pipeline are the overlap's
    for cb in default_callbacks(run_dir):
        trainer.add_callback(cb)
    use_quiet_progress(trainer)
    from ogrpo.trainer import preemption  # USR2/TERM → checkpoint at the end of the step, exit for requeue

    preempt_cb = preemption.install(trainer, run_dir)
    trainer.guard_nonfinite()  # inf/NaN loss: stop naming the step (exit 1), not train on NaN weights
    done = preemption.finished_step(p.resume_from, p.args.max_steps)
    try:
        if done is None:
            trainer.train(resume_from_checkpoint=p.resume_from)
        else:  # requeued after the last checkpoint: the run is over (the Trainer would train one step past it)
            from transformers import TrainerState

            print(f"[ogrpo] {Path(p.resume_from).name} holds the last step ({done}): nothing left to train",
                  file=sys.stderr, flush=True)
            trainer.state = TrainerState.load_from_json(str(Path(p.resume_from) / "trainer_state.json"))
    except NonFiniteError as exc:
        if is_main:
            run_state.update_manifest(run_dir, status="failed", error=str(exc))
        raise
    except Exception as exc:  # the manifest says how the run ended, not "running" forever
        preemption.leave_after_failed_step(preempt_cb, exc)  # the stop took the server: exit for requeue
        if is_main:
            run_state.record_status(run_dir, "failed", f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")
        raise
    preemption.exit_if_preempted(preempt_cb)
    if trainer.accelerator.is_main_process:
        rows = run_state.read_jsonl(run_dir / rundir.PROFILE)
        plots = rundir.write_plots(run_dir)

        picture = timeline.write(run_dir, rows)  # the split placement's lanes, first steps
        plots += [picture] if picture else []
        if trainer.logprobs_scorer is not None:  # which scoring calls ran the kernel and which fell back to TRL's
            kernels["linear_logprobs"]["calls"] = dict(trainer.logprobs_scorer.calls)
        if trainer.packing is not None:  # which passes ran packed and which kept TRL's padded rows
            packing["calls"] = dict(trainer.packing.calls)
        if ahead and ahead["on"]:  # the batches whose groups' gradients were dropped, and why
            ahead["fallbacks"] = list(trainer.overlap.train_ahead_fallbacks)
            if "early_backward" in ahead:  # the batches whose early rows' rewards alone differed from their group's
                ahead["early_backward"]["redone"] = list(trainer.overlap.early_backward_redone)
        if trainer.rank_balance is not None:  # how uneven the ranks' tokens were, and are
            balance.update(trainer.rank_balance.summary())
        run_state.update_manifest(run_dir, status="finished", global_step=trainer.state.global_step,
                                  profile=summarize(rows), plots=[str(x.relative_to(run_dir)) for x in plots],
                                  distributed=distributed_summary(trainer), kernels=kernels,
                                  **({"padding_free": packing} if packing else {}),
                                  **({"train_ahead": ahead} if ahead else {}),
                                  **({"rank_balance": balance} if balance else {}))
        render_table(rows, console)
        console.print(f"run directory: {run_dir}")
    return run_dir


def leave_process_group() -> None:
    """Tear the default process group down before the interpreter does: left to interpreter teardown, a gloo
    group's threads can be destroyed while joinable, and the rank aborts after a finished run ("terminate called
    without an active exception", SIGABRT: seen with torch 2.10 in server mode). Only at a process's end: a
    later train() in the same process would find accelerate's state pointing at a destroyed group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank tears down while another still talks to it
        dist.destroy_process_group()


def distributed_summary(trainer) -> dict:
    """How the trainer really ran, read from the live accelerator and DeepSpeed engine (not from the plan): the
    manifest's proof that a ZeRO plan trained under DeepSpeed at its stage."""
    acc = trainer.accelerator
    out = {"distributed_type": str(acc.distributed_type).rsplit(".", 1)[-1], "num_processes": acc.num_processes,
           "backend": getattr(acc.state, "backend", None)}
    engine = getattr(trainer, "deepspeed", None)  # the DeepSpeedEngine once accelerate prepared it
    if engine is not None:
        opt = engine.optimizer  # the ZeRO optimizer's own flag: what it did, not what the config asked
        offload = getattr(opt, "offload_optimizer", getattr(opt, "cpu_offload", None))
        out["deepspeed"] = {"zero_stage": engine.zero_optimization_stage(),
                            "offload_optimizer": bool(offload if offload is not None else engine.zero_cpu_offload()),
                            "optimizer": type(engine.optimizer).__name__,
                            "client_optimizer": type(getattr(engine, "client_optimizer", None)).__name__}
    return out


def _config_summary(args) -> dict:
    keys = ("seed", "learning_rate", "max_steps", "num_generations", "per_device_train_batch_size",
            "gradient_accumulation_steps", "max_completion_length", "beta", "bf16", "fp16", "tf32", "optim",
            "torch_compile", "gradient_checkpointing", "dataloader_num_workers", "use_vllm", "vllm_mode",
            "vllm_server_base_url", "model_init_kwargs", "use_cpu", "reward_weights", "deepspeed")
    return {k: getattr(args, k, None) for k in keys}
