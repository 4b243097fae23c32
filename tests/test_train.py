"""`ogrpo train` on the embedded default, end to end on CPU: run directory, profile, determinism, resume, and
bad input (one line, exit 2, nothing written)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

OGRPO = str(Path(sys.executable).with_name("ogrpo"))
TIMING_KEYS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def _run(args, cwd, timeout=300):
    env = dict(os.environ, COLUMNS="120", OMP_NUM_THREADS="2")
    return subprocess.run(args, capture_output=True, text=True, cwd=str(cwd), env=env, timeout=timeout)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _learning_metrics(run_dir: Path) -> list[dict]:
    rows = _jsonl(run_dir / "metrics.jsonl")
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS and "time" not in k} for r in rows]


@pytest.mark.slow
def test_tiny_end_to_end_writes_a_complete_run_directory(tmp_path):
    out = tmp_path / "run"
    proc = _run([OGRPO, "train", "--config", "tiny", "--output-dir", str(out), "--set", "max_steps=4",
                 "--set", "save_steps=2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Stage profile" in proc.stdout and f"run directory: {out}" in proc.stdout
    # TRL's checkpoints (save_steps=2 of 4 steps), each loadable
    for step in (2, 4):
        ckpt = out / f"checkpoint-{step}"
        assert (ckpt / "model.safetensors").is_file() and (ckpt / "optimizer.pt").is_file()
        assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == step
    metrics = _jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics if "reward" in m] == [1, 2, 3, 4]
    assert all(0.0 <= m["reward"] <= 1.0 for m in metrics if "reward" in m)
    profile = _jsonl(out / "profile.jsonl")
    assert [r["step"] for r in profile] == [1, 2, 3, 4]
    for row in profile:
        for stage in ("generation", "reward", "logprobs", "train"):
            assert row[f"{stage}_s"] > 0, (stage, row)
        assert row["completion_tokens"] > 0 and row["gen_tokens_per_s"] > 0 and row["peak_mem_gib"] > 0
        # the passes' waste: each scoring pass (the reference here) and the loss forward saw the same real
        # positions, the prompt's and the completions' (more than the completion tokens alone), plus padding
        real, computed = row["pass_real_tokens"], row["pass_tokens"]
        assert real["score"] == row["logprob_passes"] * real["loss"] > row["completion_tokens"], row
        for kind in ("score", "loss"):
            assert 0 < real[kind] <= computed[kind]
            assert row["pad_share"][kind] == pytest.approx(1 - real[kind] / computed[kind], abs=1e-6)
    assert "padding computed (pad_share): scoring passes" in proc.stdout
    for png in ("reward.png", "profile.png"):
        data = (out / "plots" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "finished" and manifest["global_step"] == 4 and manifest["seed"] == 42
    assert manifest["config"]["model_name_or_path"] == "ogrpo:tiny"
    assert manifest["plan"]["precision"] == "fp32" and manifest["plan"]["mode"] == "none"
    for dist in ("python", "torch", "transformers", "trl", "vllm"):
        assert manifest["versions"][dist], dist
    assert manifest["hardware"]["cpus"] >= 1 and "git_sha" in manifest
    assert manifest["grpo_config"]["use_cpu"] is True and manifest["grpo_config"]["bf16"] is False


TRAIN_REPORT_VLLM = Path(__file__).with_name("train_report_vllm.py")


@pytest.mark.slow
def test_two_seeded_runs_give_identical_metrics(tmp_path):
    """Also: a trainer that does not generate with vLLM never imports it (TRL's module-level vLLM imports cost a
    third of its start-up), and hiding it changes nothing: the second run has vLLM loaded before TRL."""
    runs, loaded = [], []
    for name, first in (("a", "-"), ("b", "vllm")):
        out, report = tmp_path / name, tmp_path / f"{name}-vllm.json"
        proc = _run([sys.executable, str(TRAIN_REPORT_VLLM), first, str(report), "--config", "tiny",
                     "--output-dir", str(out), "--set", "max_steps=3", "--set", "save_strategy=no"], tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(_learning_metrics(out))
        loaded.append(json.loads(report.read_text()))
    assert loaded == [False, True]
    assert len(runs[0]) >= 3
    assert runs[0] == runs[1]
    assert len({r["loss"] for r in runs[0] if "loss" in r}) > 1  # not trivially constant


@pytest.mark.slow
def test_resume_auto_continues_from_the_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    base = [OGRPO, "train", "--config", "tiny", "--output-dir", str(out), "--set", "save_steps=2"]
    first = _run([*base, "--set", "max_steps=2"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    # the same directory again without --resume is refused (it would mix two runs' checkpoints)
    again = _run([*base, "--set", "max_steps=4"], tmp_path)
    assert again.returncode == 2 and "--resume auto" in again.stderr
    # a hard kill after step 3 was logged but before its checkpoint: the resumed run logs step 3 again
    for name in ("metrics.jsonl", "profile.jsonl"):
        with (out / name).open("a") as f:
            f.write(json.dumps({"step": 3, "loss": 99.0, "step_s": 99.0}) + "\n")
    resumed = _run([*base, "--set", "max_steps=4", "--resume", "auto"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["resumed_from"].endswith("checkpoint-2") and manifest["global_step"] == 4
    assert (out / "checkpoint-4" / "trainer_state.json").is_file()
    for name, key in (("metrics", "loss"), ("profile", "step_s")):
        steps = [r["step"] for r in _jsonl(out / f"{name}.jsonl") if key in r]
        assert steps == [1, 2, 3, 4], (name, steps)  # each step once, in order
        assert 99.0 not in [r[key] for r in _jsonl(out / f"{name}.jsonl") if key in r]
        assert _jsonl(out / f"{name}.superseded.jsonl") == [{"step": 3, "loss": 99.0, "step_s": 99.0}]
    # requeued after the last checkpoint: nothing is trained (the Trainer alone runs a step 5 and saves it)
    after = _run([*base, "--set", "max_steps=4", "--resume", "auto"], tmp_path)
    assert after.returncode == 0, after.stderr[-3000:]
    assert "checkpoint-4 holds the last step (4): nothing left to train" in after.stderr
    assert not (out / "checkpoint-5").exists()
    assert [r["step"] for r in _jsonl(out / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "finished" and manifest["global_step"] == 4


def _bad_cases(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """name -> (run config YAML, text the error must contain)."""
    no_prompt = tmp_path / "no_prompt.jsonl"
    no_prompt.write_text('{"question": "2+2?"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    no_config = tmp_path / "not_a_model"
    no_config.mkdir()
    base = ("model_name_or_path: ogrpo:tiny\ndataset_name: ogrpo:tiny\nreward_funcs: [tiny_letter]\n"
            "max_completion_length: 12\nogrpo:\n  max_prompt_length: 32\n")
    return {
        "unknown_reward": (base.replace("[tiny_letter]", "[tiny_leter]"), "did you mean 'tiny_letter'"),
        "unimportable_reward": (base.replace("[tiny_letter]", "[no_such_pkg.rewards:score]"),
                                "cannot import module 'no_such_pkg.rewards'"),
        "no_prompt_column": (base.replace("dataset_name: ogrpo:tiny", f"dataset_name: {no_prompt}"),
                             "no 'prompt' column (columns: question); set ogrpo.prompt_column"),
        "empty_dataset": (base.replace("dataset_name: ogrpo:tiny", f"dataset_name: {empty}"), "no rows"),
        "model_without_config": (base.replace("model_name_or_path: ogrpo:tiny",
                                              f"model_name_or_path: {no_config}"), "has no config.json"),
    }


@pytest.mark.parametrize("case", ["unknown_reward", "unimportable_reward", "no_prompt_column", "empty_dataset",
                                  "model_without_config"])
@pytest.mark.slow
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, case):
    text, needle = _bad_cases(tmp_path)[case]
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    out = tmp_path / "out"
    proc = _run([OGRPO, "train", "--config", str(cfg), "--output-dir", str(out)], tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_prompt_column_option_and_local_csv(tmp_path):
    """A CSV with another column name trains once ogrpo.prompt_column names it (validation path only)."""
    from ogrpo.trainer.assembly import prepare

    csv = tmp_path / "p.csv"
    csv.write_text("question,letter\nWrite the letter a:,a\nWrite the letter b:,b\n")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model_name_or_path: ogrpo:tiny\ndataset_name: {csv}\nreward_funcs: [tiny_letter]\n"
                   "max_completion_length: 12\nogrpo:\n  prompt_column: question\n  max_prompt_length: 32\n")
    p = prepare(str(cfg), output_dir=tmp_path / "out")
    assert p.dataset.column_names == ["prompt", "letter"] and len(p.dataset) == 2
    assert not (tmp_path / "out").exists()


def test_local_prompt_files_load_through_datasets(tmp_path):
    import datasets

    from ogrpo.trainer.data import load_prompts

    rows = [{"prompt": "Write the letter a:", "letter": "a"}, {"prompt": "Write the letter b:", "letter": "b"}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "p.parquet"))
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for name in ("p.parquet", "p.jsonl", "saved"):
        ds = load_prompts({"dataset_name": str(tmp_path / name)})
        assert ds.to_list() == rows, name
    chat = load_prompts({"dataset_name": str(tmp_path / "p.jsonl")}, system_prompt="Be brief.")
    assert chat[0]["prompt"] == [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Write the letter a:"}]


@pytest.mark.slow
def test_an_output_dir_that_holds_anything_or_is_a_file_is_refused_and_left_as_it_was(tmp_path):
    """A new run writes its manifest, logs and model card into --output-dir: a directory holding files, or a file
    in the way, is one line and exit 2, the files untouched."""
    full = tmp_path / "full"
    full.mkdir()
    (full / "README.md").write_text("precious")
    (full / "metrics.jsonl").write_text("precious")
    afile = tmp_path / "afile"
    afile.write_text("precious")
    for out, needle in ((full, "is not empty"), (afile, "a file is in the way")):
        proc = _run([OGRPO, "train", "--config", "tiny", "--output-dir", str(out)], tmp_path, timeout=120)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 2 and len(errors) == 1 and needle in errors[0], proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in full.iterdir()) == ["README.md", "metrics.jsonl"]
    assert {p.read_text() for p in (full / "README.md", full / "metrics.jsonl", afile)} == {"precious"}


def test_the_recipes_resume_from_checkpoint_is_where_a_run_resumes(tmp_path):
    """TRL's scripts resume from the recipe's `resume_from_checkpoint`; O-GRPO's trainer too: --resume wins over
    it, `auto` takes the run directory's own checkpoint first, and a directory that is no checkpoint is refused."""
    from ogrpo.errors import OgrpoError
    from ogrpo.trainer.assembly import _resume_from

    ckpt = tmp_path / "other" / "checkpoint-3"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    run = tmp_path / "run"
    assert _resume_from(run, None, str(ckpt)) == str(ckpt)
    assert _resume_from(run, "auto", str(ckpt)) == str(ckpt)  # the run directory has none yet
    own = run / "checkpoint-5"
    own.mkdir(parents=True)
    (own / "trainer_state.json").write_text("{}")
    assert _resume_from(run, "auto", str(ckpt)) == str(own)
    assert _resume_from(tmp_path / "new", str(own), str(ckpt)) == str(own)
    with pytest.raises(OgrpoError, match="resume_from_checkpoint .*not a checkpoint directory"):
        _resume_from(tmp_path / "new", None, str(tmp_path / "other"))


@pytest.mark.slow
def test_a_trainer_the_recipe_cannot_build_here_is_one_line_with_its_traceback_kept(tmp_path):
    """A logger the node does not have (wandb): one line and exit 2, not a traceback; the manifest says failed and
    the traceback is kept in the run directory."""
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here: the recipe builds")
    out = tmp_path / "run"
    proc = _run([OGRPO, "train", "--config", "tiny", "--output-dir", str(out), "--set", "report_to=wandb",
                 "--set", "max_steps=1"], tmp_path, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "TRL's trainer could not be built" in errors[0] and "wandb" in errors[0]
    assert "Traceback" not in proc.stderr
    assert json.loads((out / "manifest.json").read_text())["status"] == "failed"
    assert "Traceback" in (out / "trainer-build-error.txt").read_text()
