"""Recipes through the test cluster, on its fake GPUs (tests/slurm/fake_gpus.py: the product submits the GPU plan,
Slurm allocates the GPUs per step, the steps run the CPU plan of the same layout).

- An open-r1 recipe written for A40s (bf16, flash-attention 2), shrunk to the tiny model, is submitted unchanged
  with `--gpus 2xV100-32G`: the job Slurm ran is the one `--dry-run` shows, and its manifest lists the V100
  adaptations. The job asks for its GPU type (`--gres=gpu:v100:2`), so it runs on the `v100` partition (node2's
  fake V100s; tests/slurm/test_slurm_gres.py: the A40 partition refuses it).
- LoRA in server mode: the server serves the merged weights (log-prob gap against the trainer < 1e-4 after each
  push) and only the adapters trained — the same run and checks as tests/test_lora.py's local job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from lora_checks import (
    assert_adapters_moved, assert_only_adapters_trained, assert_server_served_merged_weights, server_lora_overrides,
)

from . import fake_gpus
from .conftest import ogrpo, read_json, sacct_state, wait_gone
from .test_slurm_job_sbatch import batch_script

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

RECIPES = Path(__file__).parent.parent / "data" / "recipes"
A40_RECIPE = "openr1_qwen2.5-1.5b-instruct_config_demo.yaml"
# What shrinks the recipe to the tiny model and two steps; everything else (bf16, torch_dtype bfloat16,
# flash_attention_2, gradient checkpointing, cosine schedule, ...) stays as open-r1 wrote it.
TINY = {"model_name_or_path": "ogrpo:tiny", "dataset_name": "ogrpo:tiny", "reward_funcs": ["tiny_letter"],
        "max_prompt_length": 64, "max_completion_length": 12, "num_generations": 4,
        "per_device_train_batch_size": 8, "per_device_eval_batch_size": 8, "gradient_accumulation_steps": 1,
        "max_steps": 2, "report_to": "none", "log_completions": False,
        "push_to_hub": False,  # no hub here
        "use_vllm": False}  # HF generate in the trainer: no vLLM start-up in a test about precision and kernels
# The tiny task has one config, its own short prompts and the job's run dir.
DROPPED = ("dataset_configs", "system_prompt", "hub_model_id", "hub_strategy", "output_dir", "overwrite_output_dir")


def submit(cfg: Path, job_dir: Path, gpus: str, *extra: str) -> str:
    out = ogrpo("submit", "--config", str(cfg), "-o", str(job_dir), "--gpus", gpus, "--time", "10", *extra,
                env=fake_gpus.env(), check=True)
    line = out.stdout.splitlines()[0]
    assert line.startswith("submitted job "), out.stdout
    return line.split()[-1]


def finished(job: str, job_dir: Path, timeout: float) -> None:
    wait_gone(job, timeout)
    if sacct_state(job) != "COMPLETED":
        logs = "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted((job_dir / "run" / "logs").glob("*")))
        raise AssertionError(f"job {job}: {sacct_state(job)}\n{ogrpo('logs', job).stdout[-3000:]}\n{logs}")


def test_a40_recipe_runs_unchanged_on_v100(slurm_cluster, tmp_path):
    recipe = yaml.safe_load((RECIPES / A40_RECIPE).read_text())
    assert (recipe["bf16"], recipe["torch_dtype"], recipe["attn_implementation"]) == (
        True, "bfloat16", "flash_attention_2")
    recipe.update(TINY)
    for key in DROPPED:
        recipe.pop(key)
    cfg = tmp_path / "a40.yaml"
    cfg.write_text(yaml.safe_dump(recipe))
    job_dir = tmp_path / "job"

    import subprocess

    if "v100" not in subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True).stdout.split():
        pytest.skip("no V100 partition: node2 needs root and `ip netns` (tests/slurm/cluster.sh)")
    dry = ogrpo("submit", "--dry-run", "--config", str(cfg), "-o", str(job_dir), "--gpus", "2xV100-32G",
                "--time", "10", "--partition", "v100", check=True).stdout
    job = submit(cfg, job_dir, "2xV100-32G", "--partition", "v100")
    finished(job, job_dir, 420)

    # what --dry-run showed is the file written, and the file written is the script Slurm ran
    script = (job_dir / "job.sbatch").read_text()
    assert script.rstrip() in dry
    assert batch_script(job).decode() == script
    # the V100 adaptations, each with its reason, in the job's manifest and the plan its steps were given
    manifest = read_json(job_dir / "manifest.json")
    changes = {c["key"]: c for c in manifest["changes"]}
    assert (changes["bf16"]["from"], changes["bf16"]["to"]) == (True, False)
    assert (changes["attn_implementation"]["from"], changes["attn_implementation"]["to"]) == (
        "flash_attention_2", "sdpa")
    assert changes["torch_dtype"]["from"] == "bfloat16" and changes["torch_dtype"]["to"] != "bfloat16"
    assert all("V100" in changes[k]["reason"] for k in ("bf16", "attn_implementation", "torch_dtype"))
    plan = yaml.safe_load((job_dir / "run.yaml").read_text())["ogrpo"]["plan"]
    assert plan == manifest["plan"] and plan["cluster"]["spec"] == "2xV100-32G" and plan["precision"] == "fp16"
    assert (plan["trainer_args"]["fp16"], plan["trainer_args"]["bf16"]) == (True, False)
    assert plan["trainer_args"]["model_init_kwargs"]["attn_implementation"] == "sdpa"
    # Slurm gave the trainer step both GPUs; the stand-in ran the rendered step as the 2xcpu plan's
    trainer = fake_gpus.record(job_dir, "trainer")
    assert len(trainer["cuda_visible_devices"].split(",")) == 2 and trainer["cpu_plan"] == "2xcpu"
    run = read_json(job_dir / "run" / "manifest.json")
    assert run["status"] == "finished" and run["global_step"] == 2
    assert run["plan"]["cluster"]["spec"] == "2xcpu"  # what computed here, recorded as such


def test_lora_server_mode_serves_merged_weights(slurm_cluster, tmp_path):
    steps = 3
    from ogrpo.config import recipe_path

    recipe = yaml.safe_load(recipe_path("tiny").read_text())
    lora = server_lora_overrides(steps)
    recipe["ogrpo"] = {**recipe["ogrpo"], **lora.pop("ogrpo")}
    del recipe["ogrpo"]["gpus"]
    recipe.update(lora)
    cfg = tmp_path / "lora.yaml"
    cfg.write_text(yaml.safe_dump(recipe))
    job_dir = tmp_path / "job"
    job = submit(cfg, job_dir, "2xA40")
    finished(job, job_dir, 480)

    run = job_dir / "run"
    devices = {r: set(fake_gpus.record(job_dir, r)["cuda_visible_devices"].split(",")) for r in ("server", "trainer")}
    assert len(devices["server"]) == len(devices["trainer"]) == 1 and not devices["server"] & devices["trainer"]
    gaps = assert_server_served_merged_weights(run, steps)
    print(f"log-prob gap per step through Slurm: {gaps}")
    assert_adapters_moved(run)
    assert_only_adapters_trained(run / f"checkpoint-{steps}")
    assert json.loads((run / "manifest.json").read_text())["status"] == "finished"
