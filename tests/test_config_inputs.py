"""Inputs a cluster user writes that used to pass `plan` and fail later (issue 33, "Configs"): each is either
made right for the job or refused at plan time with one line (exit 2), never a traceback.

Unit checks run in-process; the few CLI checks go through the real executable, some as an unprivileged uid
(root ignores mode bits)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from ogrpo.config import load_run_config
from ogrpo.errors import ConfigError
from ogrpo.load_plan import load_and_plan

TINY = "model_name_or_path: ogrpo:tiny\nreward_funcs: [tiny_letter]\nmax_completion_length: 32\n"
NOBODY = 65534


def _one_line_refusal(proc, *words):
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-1500:])
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-1500:]
    errors = [line for line in proc.stderr.splitlines() if not line.startswith(("change: ", "warning: "))]
    assert len(errors) == 1, proc.stderr[-1500:]  # the plan's change lines may precede it
    for w in words:
        assert w in errors[0], errors[0]


# --- 1. local dataset paths are made absolute (the job runs in its job directory) -----------------------------


def test_local_dataset_paths_become_absolute_changes(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    row = json.dumps({"prompt": "Say A", "solution": "A"}) + "\n"
    for name in ("train.jsonl", "more.jsonl"):
        (tmp_path / "data" / name).write_text(row)
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "near.jsonl").write_text(row)  # next to the config, not in the submit directory
    monkeypatch.chdir(tmp_path)
    cfg = conf / "recipe.yaml"
    cfg.write_text(TINY + "dataset_name: ./data/train.jsonl\n")
    rc, plan = load_and_plan(str(cfg), "cpu", None, None, None, None)
    want = str(tmp_path / "data" / "train.jsonl")
    assert rc.trl["dataset_name"] == want  # what run.yaml gets
    change = plan.change("dataset_name")
    assert change is not None and (change.old, change.new) == ("./data/train.jsonl", want)
    assert "job directory" in change.reason

    cfg.write_text(TINY + "dataset_mixture:\n  datasets:\n  - id: data/train.jsonl\n  - id: ./data/more.jsonl\n"
                   "  - id: near.jsonl\n  seed: 1\n")
    rc, plan = load_and_plan(str(cfg), "cpu", None, None, None, None)
    ids = [d["id"] for d in rc.trl["dataset_mixture"]["datasets"]]
    assert ids == [want, str(tmp_path / "data" / "more.jsonl"), str(conf / "near.jsonl")]
    listed = {c.key: c.new for c in plan.changes}
    assert listed["dataset_mixture.datasets[0].id"] == want
    assert listed["dataset_mixture.datasets[2].id"] == str(conf / "near.jsonl")
    # --strict refuses exactly the listed changes; an absolute path is no change; a hub id stays as written
    with pytest.raises(ConfigError, match="dataset_mixture.datasets.0..id would change"):
        load_and_plan(str(cfg), "cpu", None, None, None, None, strict=True)
    cfg.write_text(TINY + f"dataset_name: {want}\n")
    _, plan = load_and_plan(str(cfg), "cpu", None, None, None, None)
    assert plan.change("dataset_name") is None


def test_the_planner_lists_the_input_checks_changes_after_its_own():
    """The checks read files before the planner; what they changed enters it as input (a plan is a pure function
    of its inputs), and it lists those changes after its own, as they always were."""
    from ogrpo.local_paths import ABSOLUTE_REASON
    from ogrpo.plan import plan_from_config
    from ogrpo.planner.types import Change

    rc = load_run_config("tiny")
    made = Change("dataset_name", "./train.jsonl", "/data/train.jsonl", ABSOLUTE_REASON)
    own = plan_from_config(rc, gpus="4xV100-32G").changes
    assert own and all(c.key != "dataset_name" for c in own)
    assert plan_from_config(rc, gpus="4xV100-32G", input_changes=[made]).changes == [*own, made]
    assert plan_from_config(rc, gpus="4xV100-32G").changes == own  # handed in per plan, never kept on rc


# --- 2. YAML alias bombs and self-containing aliases refused at load time ---------------------------------------

BOMB = TINY + "dataset_name: ogrpo:tiny\ngradient_checkpointing_kwargs:\n  l0: &l0 [" + ", ".join(["lol"] * 9) + "]\n" \
    + "".join(f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 9))
RECURSIVE = TINY + "dataset_name: ogrpo:tiny\nmodel_init_kwargs:\n  trust_remote_code: false\n  loop: &me [1, *me]\n"


@pytest.mark.parametrize("text, words", [
    (BOMB, ["gradient_checkpointing_kwargs:", "expand to more than"]),
    (RECURSIVE, ["model_init_kwargs:", "inside its own anchor &me"]),
])
def test_alias_bombs_are_refused_by_every_command(run_cli, tmp_path, text, words):
    cfg = tmp_path / "recipe.yaml"
    cfg.write_text(text)
    for args in (["plan"], ["plan", "--json"], ["render", "-o", tmp_path / "job"]):
        start = time.monotonic()
        proc = run_cli(*args, "--gpus", "cpu", "--config", cfg)
        assert time.monotonic() - start < 30  # the old code allocated for a minute, then MemoryError
        _one_line_refusal(proc, *words)
    assert not (tmp_path / "job").exists()


def test_aliases_within_bounds_still_load(tmp_path):
    cfg = tmp_path / "recipe.yaml"
    cfg.write_text(TINY + "dataset_name: ogrpo:tiny\ngradient_checkpointing_kwargs: &kw {use_reentrant: false}\n"
                   "model_init_kwargs: {trust_remote_code: false, <<: *kw}\nreward_weights: [&w 1.0]\n")
    rc = load_run_config(str(cfg))
    assert rc.trl["model_init_kwargs"] == {"trust_remote_code": False, "use_reentrant": False}


# --- 3. `off`/`no` unquoted where a setting's values are words ------------------------------------------------


def test_yaml_booleans_are_taken_as_the_words_they_spell(tmp_path):
    cfg = tmp_path / "recipe.yaml"
    cfg.write_text(TINY + "dataset_name: ogrpo:tiny\nsave_strategy: no\nlogging_strategy: steps\n"
                   "ogrpo:\n  overlap: off\n  use_vllm: off\n")
    rc = load_run_config(str(cfg))
    assert rc.ogrpo.overlap == "off" and rc.trl["save_strategy"] == "no"
    assert rc.ogrpo.use_vllm is False  # a boolean setting keeps its boolean
    assert any("ogrpo.overlap" in w and "'off'" in w for w in rc.warnings)
    # a boolean that spells none of the words is still refused, naming the key
    cfg.write_text(TINY + "dataset_name: ogrpo:tiny\nogrpo:\n  overlap: on\n")
    with pytest.raises(ConfigError, match="ogrpo.overlap: expected str, got bool True .*on, yes or true.*quote"):
        load_run_config(str(cfg))


# --- 4. render -o DIR: a non-writable parent; an earlier job's files -------------------------------------------


@pytest.mark.slow
def test_render_refuses_to_overwrite_an_earlier_job(run_cli, tmp_path):
    cfg = tmp_path / "recipe.yaml"
    cfg.write_text(TINY + "dataset_name: ogrpo:tiny\n")
    out = tmp_path / "job"
    out.mkdir()
    (out / "notes.txt").write_text("mine")  # a non-empty directory without a job is fine
    run_cli("render", "--gpus", "cpu", "--config", cfg, "-o", out, check_rc=0)
    (out / "job.sbatch").write_text("#!/bin/bash\n# edited by hand\n")
    proc = run_cli("render", "--gpus", "cpu", "--config", cfg, "-o", out)
    _one_line_refusal(proc, "already holds job.sbatch", "--force")
    assert (out / "job.sbatch").read_text().endswith("# edited by hand\n") and (out / "notes.txt").exists()
    run_cli("render", "--gpus", "cpu", "--config", cfg, "-o", out, "--force", check_rc=0)
    assert "edited by hand" not in (out / "job.sbatch").read_text()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_submit_writes_through_the_same_guard(tmp_path):
    from ogrpo.errors import OgrpoError
    from ogrpo.render import write_job

    out = tmp_path / "run"
    write_job({"job.sbatch": "one\n", "run.yaml": "a: 1\n"}, out)
    with pytest.raises(OgrpoError, match="already holds job.sbatch, run.yaml .*--force"):
        write_job({"job.sbatch": "two\n", "run.yaml": "a: 2\n"}, out)
    assert (out / "job.sbatch").read_text() == "one\n"
    write_job({"job.sbatch": "two\n", "run.yaml": "a: 2\n"}, out, force=True)
    assert (out / "job.sbatch").read_text() == "two\n"
    import inspect

    from ogrpo.commands import jobs

    assert "write_job(files, job_dir, force=force)" in inspect.getsource(jobs.submit)


@pytest.fixture(scope="module")
def unprivileged():
    """(run as nobody, a world-readable scratch directory): root ignores mode bits."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root (to become nobody) and setpriv")
    scratch = Path(tempfile.mkdtemp(prefix="ogrpo-i33-"))  # pytest's tmp_path is root-only (0700)
    scratch.chmod(0o755)
    home = scratch / "home"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)

    def run(*args, env=None, cwd=None):
        cmd = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups",
               sys.executable, "-m", "ogrpo", *map(str, args)]
        full = {"PATH": os.environ["PATH"], "HOME": str(home), "PYTHONPATH": str(Path(__file__).parents[1]),
                "SLURM_CONF": "/nonexistent/slurm.conf", "COLUMNS": "160", **(env or {})}
        return subprocess.run(cmd, capture_output=True, text=True, env=full, cwd=str(cwd or home), timeout=120)

    yield run, scratch
    shutil.rmtree(scratch)


@pytest.mark.slow
def test_render_into_a_writable_dir_under_a_read_only_parent(unprivileged):
    run, scratch = unprivileged
    parent = scratch / "jobs"  # root's, 0755: the usual cluster layout (a project dir, one job dir per user)
    parent.mkdir()
    out = parent / "mine"
    out.mkdir()
    os.chown(out, NOBODY, NOBODY)
    cfg = scratch / "recipe.yaml"
    cfg.write_text(TINY + "dataset_name: ogrpo:tiny\n")
    cfg.chmod(0o644)
    proc = run("render", "--gpus", "cpu", "--config", cfg, "-o", out)
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert {"job.sbatch", "run.yaml", "manifest.json"} <= {p.name for p in out.iterdir()}
    assert not [p for p in out.iterdir() if p.name.startswith(".")] and os.listdir(parent) == ["mine"]
    # a new directory there still needs the parent: one line naming it
    _one_line_refusal(run("render", "--gpus", "cpu", "--config", cfg, "-o", parent / "new"),
                      f"cannot write in {parent}")


# --- 5. the system prompt against the prompt budget ------------------------------------------------------------


def test_a_system_prompt_longer_than_the_budget_is_refused(tmp_path):
    cfg = tmp_path / "recipe.yaml"
    cfg.write_text(TINY + "dataset_name: ogrpo:tiny\nsystem_prompt: \"" + "Think step by step. " * 40 + "\"\n"
                   "ogrpo:\n  max_prompt_length: 64\n")
    with pytest.raises(ConfigError, match="system prompt: at least 65 tokens .* prompt budget of 64"):
        load_and_plan(str(cfg), "cpu", None, None, None, None)
    cfg.write_text(TINY + "dataset_name: ogrpo:tiny\nsystem_prompt: \"" + "Think step by step. " * 10 + "\"\n"
                   "ogrpo:\n  max_prompt_length: 64\n")
    load_and_plan(str(cfg), "cpu", None, None, None, None)  # 40 words: fits under 64


def test_a_huge_system_prompt_is_refused_quickly(run_cli, tmp_path):
    cfg = tmp_path / "recipe.yaml"
    cfg.write_text(TINY + "dataset_name: ogrpo:tiny\nsystem_prompt: \"" + "Answer with one letter. " * 1_000_000
                   + "\"\n")  # 24 MB
    start = time.monotonic()
    proc = run_cli("render", "--gpus", "cpu", "--config", cfg, "-o", tmp_path / "job")
    took = time.monotonic() - start
    _one_line_refusal(proc, "system prompt: at least", "prompt budget of 512")
    assert took < 30 and not (tmp_path / "job").exists()  # the old code rendered for a minute, 100 MB of run.yaml


# --- 6. an unreadable Hugging Face cache: columns not checked, not a refusal -----------------------------------


def test_an_unreadable_hf_cache_is_noted(unprivileged):
    run, scratch = unprivileged
    cache = scratch / "root-hf"  # another user's HF_HOME
    (cache / "hub").mkdir(parents=True)
    cache.chmod(0o700)
    cfg = scratch / "hub.yaml"
    # a hub model (its config.json looked up in the cache too) and a hub dataset
    cfg.write_text("model_name_or_path: someorg/unknown-model\nreward_funcs: [tiny_letter]\n"
                   "dataset_name: org/some-dataset\n")
    cfg.chmod(0o644)
    proc = run("plan", "--gpus", "3xA40", "--params", "1B", "--config", cfg, "--json", env={"HF_HOME": str(cache)})
    assert proc.returncode in (0, 3), proc.stderr[-1500:]
    warnings = json.loads(proc.stdout)["warnings"]
    assert any("columns not checked" in w and "cannot be read" in w for w in warnings), warnings


# --- 7. model_init_kwargs.attn_implementation against the top-level key -----------------------------------------


def test_model_init_kwargs_attention_wins_and_is_listed(tmp_path):
    cfg = tmp_path / "recipe.yaml"
    cfg.write_text("model_name_or_path: Qwen/Qwen2.5-1.5B-Instruct\ndataset_name: ogrpo:tiny\n"
                   "reward_funcs: [tiny_letter]\nattn_implementation: flash_attention_2\n"
                   "model_init_kwargs:\n  attn_implementation: eager\n")
    _, plan = load_and_plan(str(cfg), "3xA40", None, None, None, None)
    assert plan.attn_implementation == "eager"
    assert plan.trainer_args.to_dict()["model_init_kwargs"]["attn_implementation"] == "eager"
    c = plan.change("attn_implementation")
    assert c is not None and (c.old, c.new) == ("flash_attention_2", "eager")
    with pytest.raises(ConfigError, match="attn_implementation would change"):
        load_and_plan(str(cfg), "3xA40", None, None, None, None, strict=True)
    # where the hardware forbids the inner value, both keys are listed with the reason
    cfg.write_text(cfg.read_text().replace("eager", "flash_attention_2").replace(
        "attn_implementation: flash_attention_2\nmodel", "attn_implementation: sdpa\nmodel"))
    _, plan = load_and_plan(str(cfg), "2xV100-32G", None, None, None, None)
    assert plan.attn_implementation == "sdpa"
    assert plan.change("model_init_kwargs.attn_implementation") is not None
