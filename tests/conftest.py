"""Shared fixtures: run configs written for the tests, a local model directory, and the real `ogrpo` CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["no_survivors"]

REPO = Path(__file__).resolve().parents[1]
# Importing TRL (several tests do, in-process) sets VLLM_LOGGING_LEVEL=ERROR for every vLLM started later
# unless it is set already; tests read vLLM's INFO lines (KV budget, weight loads) from its logs.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
# The suite keeps more threads busy than a 2-core machine has (a server, trainers, Slurm jobs and pytest side by
# side). OpenMP's default wait policy spins a thread that waits at a barrier, burning the core another process
# needs: a tiny 6-step run took 22-29 s of CPU beside the suite, 10-12 s with passive waits (alone: 10.3 s and
# 11.0 s, about 10% slower passive). Set before any test imports torch, and inherited by every process the tests
# start (local jobs, Slurm jobs, servers). Users' runs keep OpenMP's default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
OGRPO_BIN = Path(sys.executable).with_name("ogrpo")

# A TRL flat recipe, the way `trl grpo --config` reads it.
BASIC_RECIPE = """\
model_name_or_path: Qwen/Qwen2.5-1.5B-Instruct
dataset_name: trl-lib/DeepMath-103K
reward_funcs: [accuracy_reward]
learning_rate: 1.0e-6
per_device_train_batch_size: 8
gradient_accumulation_steps: 1
num_generations: 8
max_completion_length: 1024
logging_steps: 1
seed: 42
"""

# Written for the tests after open-r1's recipes/Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml: the keys its own
# scripts add (system_prompt, dataset_prompt_column, hub_model_revision, callbacks, benchmarks ...) and keys of
# older TRL (torch_dtype, max_prompt_length, warmup_ratio, overwrite_output_dir).
OPEN_R1_RECIPE = """\
# Model arguments
model_name_or_path: Qwen/Qwen2.5-1.5B-Instruct
model_revision: main
torch_dtype: bfloat16
attn_implementation: flash_attention_2

# Data training arguments
dataset_name: open-r1/OpenR1-Math-220k
dataset_prompt_column: problem
system_prompt: "You are a helpful AI Assistant that provides well-reasoned and detailed responses."

# GRPO trainer config
bf16: true
use_vllm: true
do_eval: false
gradient_accumulation_steps: 4
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
hub_model_id: Qwen2.5-1.5B-Open-R1-GRPO
hub_model_revision: v00.00
hub_strategy: every_save
learning_rate: 2.0e-05
log_completions: true
log_level: info
logging_first_step: true
logging_steps: 1
logging_strategy: steps
lr_scheduler_type: cosine
max_prompt_length: 512
max_completion_length: 1024
max_steps: -1
num_generations: 16
num_train_epochs: 1
output_dir: data/Qwen2.5-1.5B-Open-R1-GRPO
overwrite_output_dir: true
per_device_eval_batch_size: 16
per_device_train_batch_size: 16
push_to_hub: true
report_to:
- wandb
reward_funcs:
- accuracy
- format
- tag_count
reward_weights:
- 1.0
- 1.0
- 1.0
save_strategy: "epoch"
save_total_limit: 1
seed: 42
warmup_ratio: 0.1
callbacks:
- push_to_hub_revision
benchmarks:
- math_500
"""

# A small Qwen2 shape for CPU plans (what `ogrpo.tiny` builds is of this kind).
TINY_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "max_position_embeddings": 512, "tie_word_embeddings": True, "torch_dtype": "float32",
}


@pytest.fixture(autouse=True)
def _no_cluster_outside_slurm_tests(request, monkeypatch):
    """plan/render/submit read KillWait/GraceTime from whatever cluster SLURM_CONF reaches
    (ogrpo/launch/slurm/grace.py); the Slurm tests point it at the test cluster for the whole session. Every other
    test plans as on a machine without Slurm, whatever ran before it."""
    if request.node.get_closest_marker("slurm") is None:
        monkeypatch.setenv("SLURM_CONF", "/nonexistent/slurm.conf")


@pytest.fixture(scope="session")
def server_mode_job(tmp_path_factory):
    """One server-mode CPU job (a vLLM server, two trainer runs), read by several tests (tests/server_mode_job.py)."""
    from server_mode_job import run_server_mode_job

    return run_server_mode_job(tmp_path_factory.mktemp("server-mode") / "job")


@pytest.fixture
def write_recipe(tmp_path):
    def _write(text: str, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return _write


@pytest.fixture
def basic_recipe(write_recipe) -> Path:
    return write_recipe(BASIC_RECIPE, "basic.yaml")


@pytest.fixture
def open_r1_recipe(write_recipe) -> Path:
    return write_recipe(OPEN_R1_RECIPE, "open_r1.yaml")


@pytest.fixture
def tiny_model_dir(tmp_path) -> Path:
    d = tmp_path / "tiny-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    return d


@pytest.fixture
def tiny_recipe(write_recipe, tiny_model_dir) -> Path:
    return write_recipe(
        f"model_name_or_path: {tiny_model_dir}\n"
        "per_device_train_batch_size: 4\nnum_generations: 4\nmax_completion_length: 32\n"
        # vLLM asked for: the tests that use this recipe plan the server and colocated placements (where the
        # recipe leaves it open, measured costs choose: tests/test_placement_cost.py)
        "use_vllm: true\n"
        "ogrpo:\n  max_prompt_length: 64\n",
        "tiny.yaml",
    )


@pytest.fixture
def run_cli():
    """Run the installed `ogrpo` executable; returns CompletedProcess (text)."""

    def _run(*args: str, cwd: Path | None = None, check_rc: int | None = None) -> subprocess.CompletedProcess:
        env = dict(os.environ, COLUMNS="160")
        # a bound for a hang, not a speed check: `doctor` imports vLLM, TRL and DeepSpeed, which took over 120 s
        # on 2 cores shared with the Slurm tests' jobs
        proc = subprocess.run([str(OGRPO_BIN), *map(str, args)], capture_output=True, text=True,
                              cwd=str(cwd or REPO), env=env, timeout=600)
        if check_rc is not None:
            assert proc.returncode == check_rc, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
        return proc

    return _run


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_addoption(parser):
    parser.addoption("--shuffle", type=int, default=None, metavar="SEED",
                     help="run the collected tests in an order shuffled with SEED: shows that no test's pass depends "
                          "on what ran before it (module fixtures are then built again where their tests part)")


# `make test` runs the main suite on both cores (pytest-xdist, `-n 2 --dist loadfile --no-loadscope-reorder`): a
# module's tests go to one worker, so that its module-scoped fixtures (a job many tests read) are built once. The
# modules are handed out longest first, by their seconds in tests/module_seconds.json (measured; README:
# "Development"), so that the suite does not end on one long module while the other core idles (xdist's own order,
# most tests first, put the long bench modules last).
MODULE_SECONDS = json.loads((REPO / "tests" / "module_seconds.json").read_text())


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests are skipped (and reported as skipped) where no CUDA GPU is present. `--shuffle SEED`
    reorders the tests (printed, so a failing order can be run again); otherwise modules run longest first."""
    seed = config.getoption("--shuffle")
    if seed is not None:
        import random

        random.Random(seed).shuffle(items)
        print(f"tests shuffled with seed {seed}")
    else:
        rank = {}
        for item in items:
            rank.setdefault(item.nodeid.split("::", 1)[0], len(rank))
        items.sort(key=lambda item: (-MODULE_SECONDS.get(item.nodeid.split("::", 1)[0], 0.0),
                                     rank[item.nodeid.split("::", 1)[0]]))
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
        for item in gpu_items:
            item.add_marker(skip)


def _lock_module(items):
    return next((item.module for item in items
                 if getattr(item, "originalname", None) == "test_lock_is_consistent_against_the_index"), None)


def pytest_collection_finish(session):
    """tests/test_locks.py's resolutions against the index wait on the network for about a minute: started here,
    they run beside the tests collected before them. Under pytest-xdist every worker collects every test, and
    which one runs test_locks is decided later: there its module fixture starts them."""
    module = _lock_module(session.items)
    if module is not None and "PYTEST_XDIST_WORKER" not in os.environ:
        import tempfile

        session.config._ogrpo_locks_tmp = tempfile.mkdtemp(prefix="ogrpo-locks-")
        module.start_index_resolutions(Path(session.config._ogrpo_locks_tmp))


def pytest_sessionfinish(session):
    module = _lock_module(getattr(session, "items", []))
    if module is not None:
        import shutil

        module.stop_index_resolutions()
        shutil.rmtree(getattr(session.config, "_ogrpo_locks_tmp", ""), ignore_errors=True)
