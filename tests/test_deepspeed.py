"""DeepSpeed ZeRO in the CPU stack: the strategies real GPU plans pick, run for real with two gloo trainer processes.

Fast tests (no marks): `ogrpo.strategy` in the config and the plan, the CPU deepspeed.json, and how the trainer
finds it. Integration tests (slow, ~5 min on 2 cores): the tiny recipe through `ogrpo submit --backend local`
under ZeRO-2, ZeRO-3 and ZeRO-3 + optimizer offload with HF generate, ZeRO-3 in server mode with cpu_shm weight
pushes, and a preemption → DeepSpeed checkpoint → resume that must end where the uninterrupted run ended. What
ran is read from the run manifest's `distributed` record, which the trainer takes from the live DeepSpeed engine.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ogrpo.config import load_run_config
from ogrpo.errors import ConfigError
from ogrpo.plan import Plan, plan_from_config
from ogrpo.planner.types import Strategy
from ogrpo.render import accelerate_config, deepspeed_config

REPO = Path(__file__).resolve().parents[1]
OGRPO = str(Path(sys.executable).with_name("ogrpo"))
STEPS = 3
# Metrics that depend on the weights each step starts from (not timings, not names of reward functions).
LEARNING_KEYS = ("loss", "reward", "reward_std", "grad_norm", "kl", "entropy", "completions/mean_length")


def _tiny(tmp_path: Path, name: str, gpus: str, **ogrpo) -> Path:
    """The built-in tiny recipe, cut to STEPS steps of 2 x 8 completions (what the other integration tests use)."""
    recipe = yaml.safe_load((REPO / "ogrpo" / "recipes" / "tiny.yaml").read_text())
    recipe.update({"max_steps": STEPS, "save_steps": 100, "per_device_train_batch_size": 8, "num_generations": 4})
    recipe["ogrpo"].update({"gpus": gpus, **ogrpo})
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _plan(tmp_path, gpus="2xcpu", **ogrpo):
    return plan_from_config(load_run_config(str(_tiny(tmp_path, "r", gpus, **ogrpo))))


def _setting(plan, name):
    return next(s for s in plan.settings if s.name == name)


# --- config, plan, render (fast) ----------------------------------------------------------------------------


def test_strategy_option_is_validated_with_a_hint(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_run_config(str(_tiny(tmp_path, "bad", "2xcpu", strategy="zero-3")))
    assert "ogrpo.strategy: 'zero-3' is not one of ddp, zero2, zero3, zero3_offload (did you mean zero3?)" in str(
        err.value)


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "zero3_offload"])
def test_cpu_plan_honours_the_strategy_and_says_why(tmp_path, strategy):
    plan = _plan(tmp_path, strategy=strategy)
    assert plan.fits and plan.trainer.strategy == strategy and plan.trainer.num_processes == 2
    s = _setting(plan, "trainer.strategy")
    assert s.value == strategy and f"ogrpo.strategy {strategy}" in s.reason and "gloo" in s.reason
    # without the option a CPU plan stays on DDP, and says how to get ZeRO
    default = _plan(tmp_path)
    assert default.trainer.strategy is Strategy.DDP and "ogrpo.strategy" in _setting(default, "trainer.strategy").reason


def test_gpu_plan_takes_the_strategy_instead_of_the_cheapest_that_fits(tmp_path):
    # 1.5B on 4 x A40: DDP fits, so the planner would pick it; an explicit ZeRO-3 is kept (and still checked)
    text = ("model_name_or_path: Qwen/Qwen2.5-1.5B-Instruct\ndataset_name: ogrpo:tiny\n"
            "reward_funcs: [tiny_letter]\nper_device_train_batch_size: 8\nnum_generations: 8\n"
            "max_completion_length: 256\n")
    (tmp_path / "auto.yaml").write_text(text)
    (tmp_path / "zero3.yaml").write_text(text + "ogrpo:\n  strategy: zero3\n")
    chosen = plan_from_config(load_run_config(str(tmp_path / "zero3.yaml")), gpus="4xA40")
    auto = plan_from_config(load_run_config(str(tmp_path / "auto.yaml")), gpus="4xA40")
    assert auto.trainer.strategy is Strategy.DDP
    assert chosen.fits and chosen.trainer.strategy is Strategy.ZERO3
    assert chosen.trainer.memory_gib_per_gpu < auto.trainer.memory_gib_per_gpu  # sharded weights


@pytest.mark.slow
def test_strategy_flag_on_plan_render_and_submit(tmp_path):
    run = lambda *a: subprocess.run([OGRPO, *a], capture_output=True, text=True, timeout=120)  # noqa: E731
    plan = run("plan", "--gpus", "2xcpu", "--config", "tiny", "--strategy", "zero3", "--json")
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["trainer"]["strategy"] == "zero3"
    bad = run("plan", "--gpus", "2xcpu", "--config", "tiny", "--strategy", "zero4")
    assert bad.returncode == 2 and "--strategy 'zero4': choose one of ddp, zero2, zero3, zero3_offload" in bad.stderr
    out = tmp_path / "job"
    assert run("render", "--gpus", "2xcpu", "--config", "tiny", "--strategy", "zero2", "-o", str(out)).returncode == 0
    assert json.loads((out / "deepspeed.json").read_text())["zero_optimization"]["stage"] == 2
    dry = run("submit", "--backend", "local", "--gpus", "2xcpu", "--config", "tiny", "--strategy", "zero3_offload",
              "--dry-run")
    assert dry.returncode == 0 and "zero3_offload" in dry.stdout + dry.stderr


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_lora_plans_with_a_zero_strategy(tmp_path, strategy):
    # LoRA is no longer DDP-only: TRL trains a peft model under DeepSpeed, and ZeRO-3 shards the frozen base
    # (an explicit strategy used to exit 2 with "LoRA plans train with DDP").
    recipe = _tiny(tmp_path, "lora", "2xcpu", strategy=strategy)
    recipe.write_text(recipe.read_text() + "use_peft: true\nlora_r: 4\n")
    plan = plan_from_config(load_run_config(str(recipe)))
    assert plan.fits and plan.trainer.strategy == strategy
    assert deepspeed_config(plan)["zero_optimization"]["stage"] == int(strategy[-1])


def test_cpu_deepspeed_config_runs_in_fp32_without_cuda_only_settings(tmp_path):
    for strategy, stage in (("zero2", 2), ("zero3", 3), ("zero3_offload", 3)):
        plan = _plan(tmp_path, strategy=strategy)
        ds = deepspeed_config(plan)
        assert ds["zero_optimization"]["stage"] == stage
        # "auto": transformers fills them from GRPOConfig's bf16/fp16 (both False on CPU) -> fp32 like the plan
        assert ds["bf16"] == {"enabled": "auto"} and ds["fp16"] == {"enabled": "auto"}
        if strategy == "zero3_offload":
            assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
            assert ds["zero_force_ds_cpu_optimizer"] is False and "optimizer" not in ds
        # the CPU launch stays accelerate's gloo multi-process one; the trainer turns DeepSpeed on itself
        acc = accelerate_config(plan, "/job")
        assert acc["distributed_type"] == "MULTI_GPU" and acc["use_cpu"] is True and "deepspeed_config" not in acc
    assert deepspeed_config(_plan(tmp_path)) is None


def test_gpu_deepspeed_config_is_unchanged_by_the_cpu_path(tmp_path):
    recipe = tmp_path / "gpu.yaml"
    recipe.write_text("model_name_or_path: Qwen/Qwen2.5-1.5B-Instruct\ndataset_name: ogrpo:tiny\n"
                      "reward_funcs: [tiny_letter]\nogrpo:\n  strategy: zero3_offload\n")
    plan = plan_from_config(load_run_config(str(recipe)), gpus="4xA40")
    ds = deepspeed_config(plan)
    assert ds["bf16"] == {"enabled": True} and ds["optimizer"]["type"] == "AdamW"
    assert ds["zero_optimization"]["offload_optimizer"]["pin_memory"] is True
    assert accelerate_config(plan, "/job")["distributed_type"] == "DEEPSPEED"


def test_trainer_uses_the_rendered_deepspeed_json(tmp_path):
    from ogrpo.trainer.settings import cpu_deepspeed, grpo_config_kwargs

    plan = _plan(tmp_path, strategy="zero3")
    job = tmp_path / "job"
    job.mkdir()
    (job / "run.yaml").write_text("x: 1\n")
    # not rendered (e.g. `ogrpo train --config x.yaml`): the same config, built from the plan
    assert cpu_deepspeed(plan, job / "run.yaml") == deepspeed_config(plan)
    (job / "deepspeed.json").write_text(json.dumps(deepspeed_config(plan)))
    kwargs, _ = grpo_config_kwargs({}, plan, tmp_path / "out", fields=frozenset({"deepspeed", "use_cpu"}),
                                   config_source=str(job / "run.yaml"))
    assert kwargs["deepspeed"] == str((job / "deepspeed.json").resolve())
    assert cpu_deepspeed(_plan(tmp_path), job / "run.yaml") is None  # DDP


def test_install_built_deepspeed_with_its_cpu_op():
    # requirements/install.sh: the lock's [source] pins are built after the wheels, DeepSpeed with the one op a
    # CPU run loads (the shared-memory all-reduce) prebuilt, so no test pays a JIT compile
    from ogrpo.stacks import read_lock

    pins = read_lock(REPO / "requirements" / "cpu.lock")
    source = [ln.split("==")[0] for ln in (REPO / "requirements" / "cpu.lock").read_text().splitlines()
              if "# [source]" in ln]
    assert source == ["deepspeed"]
    version_info = pytest.importorskip("deepspeed.git_version_info")
    assert version_info.version.split("+")[0] == pins["deepspeed"]
    assert version_info.installed_ops["deepspeed_shm_comm"], "rebuild with requirements/install.sh"


def test_weight_push_refuses_an_ungathered_zero3_parameter(tmp_path):
    import torch
    from ogrpo.serve.client import write_weights_file

    params = [("model.embed_tokens.weight", torch.ones(4, 2)), ("model.norm.weight", torch.empty(0))]
    with pytest.raises(RuntimeError, match="model.norm.weight is empty"):
        write_weights_file(iter(params), str(tmp_path))


# --- real runs (integration) --------------------------------------------------------------------------------


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _steps(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: {k: r[k] for k in LEARNING_KEYS if k in r} for r in _jsonl(run_dir / "metrics.jsonl")
            if "loss" in r}


def _submit(cfg: Path, job_dir: Path, gpus: str, timeout: int = 420, env: dict | None = None):
    proc = subprocess.run([OGRPO, "submit", "--backend", "local", "--gpus", gpus, "--config", str(cfg),
                           "--output", str(job_dir)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((job_dir / "run" / "manifest.json").read_text())


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _check_deepspeed_run(job_dir: Path, manifest: dict, stage: int, offload: bool) -> dict[int, dict]:
    run = job_dir / "run"
    # what ran, from the live engine: DeepSpeed at the stage asked for, over gloo, 2 processes
    dist = manifest["distributed"]
    assert dist["distributed_type"] == "DEEPSPEED" and dist["backend"] == "gloo" and dist["num_processes"] == 2
    assert dist["deepspeed"]["zero_stage"] == stage and dist["deepspeed"]["offload_optimizer"] is offload
    zero_optimizer = "DeepSpeedZeroOptimizer" if stage == 2 else "DeepSpeedZeroOptimizer_Stage3"
    assert dist["deepspeed"]["optimizer"] == zero_optimizer
    # ... configured by the job's rendered deepspeed.json (the file, not a copy of it)
    assert manifest["grpo_config"]["deepspeed"] == str((job_dir / "deepspeed.json").resolve())
    assert manifest["plan"]["trainer"]["strategy"] == {2: "zero2", 3: "zero3_offload" if offload else "zero3"}[stage]
    # the plan's linear_logprobs kernel scored every call (policy and old policy), ZeRO-3's partitioned lm_head
    # gathered for it (the updates still match ZeRO-2's: test_zero_stages_compute_the_same_updates)
    lp = manifest["kernels"]["linear_logprobs"]
    assert manifest["plan"]["kernels"]["linear_logprobs"] and lp["installed"] is True
    assert lp["calls"]["kernel"] >= STEPS and lp["calls"]["trl"] == 0, lp
    steps = _steps(run)
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for row in steps.values() for v in row.values()), steps
    # a DeepSpeed checkpoint: one optimizer shard per rank, and full (gathered) weights that moved
    ckpt = run / f"checkpoint-{STEPS}"
    shards = sorted(p.name for p in (ckpt / f"global_step{STEPS}").glob("*optim_states.pt"))
    assert len(shards) == 2, shards
    before, after = _weights(Path(manifest["model_path"]) / "model.safetensors"), _weights(ckpt / "model.safetensors")
    assert set(before) <= set(after)
    assert all(after[k].shape == before[k].shape for k in before)  # no shape-[0] ZeRO-3 placeholders
    assert any(not after[k].float().equal(before[k].float()) for k in before), "the policy did not change"
    return steps


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    """One run per strategy, shared by the tests below: {strategy: (job_dir, manifest)}."""
    pytest.importorskip("deepspeed")
    base = tmp_path_factory.mktemp("zero")
    runs = {}
    for strategy in ("zero2", "zero3", "zero3_offload"):
        job = base / strategy
        runs[strategy] = (job, _submit(_tiny(base, strategy, "2xcpu", strategy=strategy), job, "2xcpu"))
    return runs


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("strategy, stage, offload", [("zero2", 2, False), ("zero3", 3, False),
                                                      ("zero3_offload", 3, True)])
def test_tiny_grpo_trains_under_zero(zero_runs, strategy, stage, offload):
    job, manifest = zero_runs[strategy]
    _check_deepspeed_run(job, manifest, stage, offload)


@pytest.mark.slow
@pytest.mark.integration
def test_zero_stages_compute_the_same_updates(zero_runs):
    # Same seed, same data, same fp32 math: sharding the optimizer (ZeRO-2), the weights (ZeRO-3) or stepping it
    # outside the engine (offload) must not change what is learned. Step 1 is before any update; steps 2-3 see
    # the updated weights, so a wrong shard or a lost gradient shows there.
    steps = {s: _steps(job / "run") for s, (job, _) in zero_runs.items()}
    ref = steps["zero2"]
    for strategy in ("zero3", "zero3_offload"):
        for step, row in ref.items():
            for key, value in row.items():
                assert steps[strategy][step][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (strategy, step, key)
    assert len({round(r["loss"], 6) for r in ref.values()}) > 1


@pytest.mark.slow
@pytest.mark.integration
def test_one_process_without_a_launcher_trains_under_zero2(tmp_path):
    """`ogrpo train` on a `cpu` plan (no accelerate launch, no torch.distributed): DeepSpeed gets a one-process gloo
    group (it would look for MPI otherwise) and the config built from the plan (nothing was rendered)."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    proc = subprocess.run([OGRPO, "train", "--config", str(_tiny(tmp_path, "one", "cpu", strategy="zero2")),
                           "--output-dir", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["distributed"]["num_processes"] == 1
    assert manifest["distributed"]["deepspeed"]["zero_stage"] == 2
    assert manifest["grpo_config"]["deepspeed"] == deepspeed_config(Plan.from_dict(manifest["plan"]))
    assert all(math.isfinite(r["loss"]) for r in _steps(out).values())


PREEMPT_REWARD = '''
import os, signal
from ogrpo.rewards.registry import resolve_rewards

_letter = resolve_rewards(["tiny_letter"])[0][0]
_calls = 0


def letter(completions, **kwargs):
    """tiny_letter, and (when asked) a SIGUSR2 to this trainer process mid-step, as Slurm sends before a limit."""
    global _calls
    _calls += 1
    if os.environ.get("PREEMPT_AT_CALL") == str(_calls) and os.environ.get("RANK") == "0":
        os.kill(os.getpid(), signal.SIGUSR2)
    return _letter(completions, **kwargs)
'''


@pytest.mark.slow
@pytest.mark.integration
def test_zero3_preemption_checkpoint_resume_ends_where_the_uninterrupted_run_did(tmp_path, zero_runs):
    """USR2 in step 2 → the step finishes, a DeepSpeed checkpoint is saved, the trainer exits 75 (requeue); the
    job's own trainer command run again (--resume auto) loads the ZeRO shards and must reproduce steps 2-3 of
    the uninterrupted ZeRO-3 run."""
    mod = tmp_path / "mods"
    mod.mkdir()
    (mod / "preempt_reward.py").write_text(PREEMPT_REWARD)
    cfg = _tiny(tmp_path, "pre", "2xcpu", strategy="zero3")
    recipe = yaml.safe_load(cfg.read_text())
    recipe["reward_funcs"] = ["preempt_reward:letter"]
    cfg.write_text(yaml.safe_dump(recipe))
    job = tmp_path / "job"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{mod}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # bare `accelerate`
    proc = subprocess.run([OGRPO, "render", "--gpus", "2xcpu", "--config", str(cfg), "-o", str(job)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from ogrpo.jobspec import fill
    from ogrpo.launch.local import load_jobspec, local_values
    from ogrpo.launch.ports import free_ports, release_ports

    step = load_jobspec(job).step("trainer")

    def attempt(extra_env: dict) -> subprocess.CompletedProcess:
        ports = free_ports(3, "127.0.0.1")
        try:
            argv = fill(step.argv, local_values(ports[0], ports[1], str(job), ports[2]))
            # The launcher ignores USR2 (as under Slurm); only the trainer workers handle it.
            return subprocess.run(argv, env={**env, **step.env, **extra_env}, cwd=str(job), timeout=420,
                                  capture_output=True, text=True,
                                  preexec_fn=lambda: signal.signal(signal.SIGUSR2, signal.SIG_IGN))
        finally:
            release_ports(ports)

    # one reward call per step per rank: the 2nd call on rank 0 is inside step 2. `accelerate launch` turns the
    # workers' EXIT_PREEMPTED into 1; the marker file says why (as the Slurm backend reads it).
    first = attempt({"PREEMPT_AT_CALL": "2"})
    assert first.returncode != 0, first.stderr[-2000:]
    assert "exiting for requeue" in first.stderr, first.stderr[-3000:]
    run = job / "run"
    marker = json.loads((run / "preempted.json").read_text())
    assert marker["signal"] == "SIGUSR2" and marker["checkpoint"] == "checkpoint-2"
    assert len(list((run / "checkpoint-2" / "global_step2").glob("*optim_states.pt"))) == 2
    again = attempt({})  # the requeue
    assert again.returncode == 0, again.stderr[-3000:]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["resumed_from"].endswith("checkpoint-2") and manifest["global_step"] == STEPS
    assert manifest["distributed"]["deepspeed"]["zero_stage"] == 3
    resumed = _steps(run)
    assert sorted(resumed) == list(range(1, STEPS + 1))  # each step once
    reference = _steps(zero_runs["zero3"][0] / "run")
    for s in range(1, STEPS + 1):
        for key, value in reference[s].items():
            assert resumed[s][key] == pytest.approx(value, rel=1e-4, abs=1e-5), (s, key)


def _processes_mentioning(text: str) -> list[int]:
    """Live (non-zombie) processes whose command line mentions `text`."""
    import psutil

    return [p.pid for p in psutil.process_iter(["cmdline", "status"])
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(text in a for a in p.info["cmdline"] or [])]


@pytest.mark.slow
@pytest.mark.integration
def test_lora_trains_under_zero3_with_the_adapters_sharded(tmp_path):
    """LoRA + ZeRO-3 for real (2 gloo processes, HF generate; 35 s on a quiet 2-core host, 90-140 s loaded): the
    engine is DeepSpeed stage 3 over a peft model, the optimizer's fp32 partition holds this rank's half of the
    adapters and nothing of the frozen base (what the memory model counts: lora_params / n), and the saved
    adapters are whole and moved."""
    pytest.importorskip("deepspeed")
    import peft  # noqa: F401  (the train extra is part of the test environment: missing fails)
    import torch
    from safetensors.torch import load_file

    from ogrpo.planner.memory import lora_params
    from ogrpo.models import resolve_model
    from ogrpo.planner.lora import lora_spec

    cfg = _tiny(tmp_path, "lz3", "2xcpu", strategy="zero3")
    recipe = yaml.safe_load(cfg.read_text())
    recipe.update({"max_steps": 2, "use_peft": True, "lora_r": 4, "lora_target_modules": ["q_proj", "v_proj"]})
    cfg.write_text(yaml.safe_dump(recipe))
    job = tmp_path / "job"
    manifest = _submit(cfg, job, "2xcpu")
    assert _processes_mentioning(str(job)) == []
    dist = manifest["distributed"]
    assert dist["distributed_type"] == "DEEPSPEED" and dist["num_processes"] == 2
    assert dist["deepspeed"]["zero_stage"] == 3 and dist["deepspeed"]["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    assert manifest["plan"]["trainer"]["strategy"] == "zero3"
    ckpt = job / "run" / "checkpoint-2"
    adapters, saved = lora_params(resolve_model(manifest["model_path"]), lora_spec(recipe))
    assert saved == 0
    for rank in (0, 1):
        states = torch.load(ckpt / "global_step2" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                            map_location="cpu", weights_only=False)
        assert sum(t.numel() for t in states["optimizer_state_dict"]["fp32_flat_groups"]) == adapters // 2
    weights = load_file(ckpt / "adapter_model.safetensors")
    assert sum(v.numel() for v in weights.values()) == adapters  # whole tensors, no ZeRO-3 placeholders
    moved = [k for k, v in weights.items() if "lora_B" in k and v.abs().sum() > 0]  # B starts at zero
    assert len(moved) == sum("lora_B" in k for k in weights) > 0
    assert all(math.isfinite(r["loss"]) for r in _steps(job / "run").values())


def test_strategy_flag_with_use_peft_plans_and_renders(tmp_path):
    # `--strategy zero3` with use_peft exited 2 ("LoRA plans train with DDP"); it plans and renders ZeRO-3.
    recipe = _tiny(tmp_path, "lora", "2xcpu")
    recipe.write_text(recipe.read_text() + "use_peft: true\nlora_r: 4\n")
    run = lambda *a: subprocess.run([OGRPO, *a], capture_output=True, text=True, timeout=120)  # noqa: E731
    plan = run("plan", "--gpus", "2xcpu", "--config", str(recipe), "--strategy", "zero3", "--json")
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["trainer"]["strategy"] == "zero3"
    out = tmp_path / "job"
    assert run("render", "--gpus", "2xcpu", "--config", str(recipe), "--strategy", "zero3", "-o",
               str(out)).returncode == 0
    assert json.loads((out / "deepspeed.json").read_text())["zero_optimization"]["stage"] == 3
