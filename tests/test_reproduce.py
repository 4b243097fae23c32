"""`ogrpo reproduce`: the same run again from its manifest, and what differs when the stack moved."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ogrpo.errors import OgrpoError
from ogrpo.reproduce import Record, drift, load_record, plan_differences
from server_mode_job import _survivors
from toy_recipe import toy_recipe

OGRPO = [sys.executable, "-m", "ogrpo"]


def test_drift_names_each_moved_version_and_the_code():
    rec = Record(config={}, plan=None, gpus="cpu", backend="local", git_sha="abc",
                 versions={"python": "3.11.7", "torch": "2.13.0+cpu", "trl": "1.16.0", "vllm": None})
    assert drift(rec, installed={"torch": "2.13.0+cpu", "trl": "1.16.0"}, git_sha="abc") == []
    lines = drift(rec, installed={"torch": "2.14.0+cpu"}, git_sha="def")
    assert lines == ["torch 2.13.0+cpu -> 2.14.0+cpu", "trl 1.16.0 -> not installed", "O-GRPO code abc -> def"]


def test_plan_differences_cover_what_decides_the_run():
    from ogrpo.hardware import parse_gpus
    from ogrpo.planner.types import Plan

    a = {"cluster": parse_gpus("3xA40").to_dict(), "precision": "bf16",
         "trainer": {"strategy": "ddp", "num_processes": 2}, "vllm": {"args": {"dtype": "x"}}}
    assert plan_differences(Plan.from_dict(a), Plan.from_dict(json.loads(json.dumps(a)))) == []
    b = {**a, "precision": "fp16", "trainer": {"strategy": "zero2", "num_processes": 2}}
    assert plan_differences(Plan.from_dict(a), Plan.from_dict(b)) == [
        "plan.precision: 'bf16' -> 'fp16'", "plan.trainer.strategy: 'ddp' -> 'zero2'"]
    # O-GRPO's own settings decide how the run computes too: a value that moved (or came, or went) is named, a
    # reason reworded is not
    settings = [{"name": "overlap.train_ahead", "value": "on", "reason": "x"},
                {"name": "padding_free", "value": "on", "reason": "y"}]
    c = {**a, "settings": settings}
    d = {**a, "settings": [{**settings[0], "reason": "reworded"}, {**settings[1], "value": "off"},
                           {"name": "kernels.linear_logprobs", "value": ["a", 1], "reason": "z"}]}
    assert plan_differences(Plan.from_dict(c), Plan.from_dict(json.loads(json.dumps(c)))) == []
    assert plan_differences(Plan.from_dict(c), Plan.from_dict(d)) == [
        "plan setting kernels.linear_logprobs: None -> ['a', 1]", "plan setting padding_free: 'on' -> 'off'"]


def test_reproduce_says_which_reruns_agree_only_to_rounding(tmp_path):
    from ogrpo.config import load_run_config
    from ogrpo.plan import plan_from_config
    from ogrpo.reproduce import rerun_note

    def planned(gpus, **keys):
        import yaml

        recipe = tmp_path / "r.yaml"
        recipe.write_text(yaml.safe_dump({**yaml.safe_load(toy_recipe(2, gpus=gpus, use_vllm=True)), **keys}))
        return plan_from_config(load_run_config(str(recipe)), gpus=gpus)

    ahead = planned("2xcpu")  # lossless on the split placement: groups trained ahead
    assert ahead.train_ahead is True and "overlap.train_ahead" in rerun_note(ahead)
    assert "full_determinism: true" in rerun_note(ahead)
    assert rerun_note(planned("2xcpu", full_determinism=True)) is None  # the plan trains nothing ahead for it
    assert rerun_note(planned("cpu")) is None
    assert "CUDA" in rerun_note(planned("3xA40"))


def test_a_rerun_is_pinned_to_the_recorded_rows():
    from ogrpo.reproduce import pinned_recipe, rerun_config

    sha = "a" * 64
    rec = Record(config={"ogrpo": {"gpus": "cpu"}, "seed": 1}, plan=None, gpus="cpu", backend="local",
                 data={"rows": 4, "sha256": sha})
    assert rerun_config(rec) == ({"ogrpo": {"gpus": "cpu", "data_sha256": sha}, "seed": 1},
                                 [f"ogrpo.data_sha256: {sha}"])
    assert rec.config == {"ogrpo": {"gpus": "cpu"}, "seed": 1}  # the record itself unchanged
    own = Record(config={"ogrpo": {"data_sha256": "b" * 64}}, plan=None, gpus="cpu", backend="local",
                 data={"sha256": sha})
    assert rerun_config(own) == ({"ogrpo": {"data_sha256": "b" * 64}}, [])  # the recipe's own pin stays
    assert rerun_config(Record(config={}, plan=None, gpus="cpu", backend="local")) == ({}, [])
    # a hub model: pinned to the commit the recorded run loaded, whatever revision its config named
    hub = Record(config={"model_revision": "main"}, plan=None, gpus="cpu", backend="local", model_revision="c0ffee")
    assert rerun_config(hub) == ({"model_revision": "c0ffee"}, ["model_revision: c0ffee"])
    # a sweep: pinned where every point trained on the same rows (and loaded the same commit)
    assert pinned_recipe({"seed": 1}, [rec, rec]) == ({"seed": 1, "ogrpo": {"data_sha256": sha}}, [])
    other = Record(config={}, plan=None, gpus="cpu", backend="local", data={"sha256": "c" * 64})
    assert pinned_recipe({"seed": 1}, [rec, other]) == ({"seed": 1}, ["its points trained on different rows (a "
                                                                      "grid over the data)"])
    unrecorded = Record(config={}, plan=None, gpus="cpu", backend="local")
    assert pinned_recipe({}, [rec, unrecorded])[1] == ["not every point recorded the rows it trained on"]
    assert pinned_recipe({"ogrpo": None}, [rec])[0] == {"ogrpo": {"data_sha256": sha}}  # `ogrpo:` left empty
    assert rerun_config(Record(config={"ogrpo": None}, plan=None, gpus="cpu", backend="local", data=rec.data))[0] \
        == {"ogrpo": {"data_sha256": sha}}
    hub.data = rec.data
    assert pinned_recipe({}, [hub, hub])[0] == {"ogrpo": {"data_sha256": sha}, "model_revision": "c0ffee"}
    moved = Record(config={}, plan=None, gpus="cpu", backend="local", data=rec.data, model_revision="beef")
    assert pinned_recipe({}, [hub, moved]) == ({"ogrpo": {"data_sha256": sha}}, [
        "its points loaded different model commits (a grid over the model)"])


def test_a_directory_without_a_run_manifest_is_one_line(tmp_path):
    with pytest.raises(OgrpoError, match="no run manifest"):
        load_record(str(tmp_path))
    with pytest.raises(OgrpoError, match="neither a run directory nor a Slurm job id"):
        load_record(str(tmp_path / "missing"))


def _metrics(job: Path) -> list[dict]:
    keep = ("step", "loss", "reward", "grad_norm")
    rows = [json.loads(x) for x in (job / "run" / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in keep if k in r} for r in rows if "loss" in r]


@pytest.mark.slow
def test_reproduce_reruns_to_identical_metrics_and_strict_refuses_drift(tmp_path):
    recipe = tmp_path / "run.yaml"
    recipe.write_text(toy_recipe(3, gpus="cpu", use_vllm=False))
    first = tmp_path / "first"
    out = subprocess.run([*OGRPO, "submit", "--backend", "local", "--gpus", "cpu", "--config", str(recipe),
                          "-o", str(first)], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    recipe.unlink()  # the rerun must come from the manifest alone
    again = tmp_path / "again"
    out = subprocess.run([*OGRPO, "reproduce", str(first), "-o", str(again)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "differs from the recorded run" not in out.stderr and "agrees to rounding" not in out.stderr
    a, b = _metrics(first), _metrics(again)
    assert len(a) == 3 and a == b  # CPU, same seed, same plan: the same numbers, not merely close ones
    # the rerun was pinned to the rows the first trained on, and trained on them
    recorded = json.loads((first / "run" / "manifest.json").read_text())["data"]
    rerun = json.loads((again / "run" / "manifest.json").read_text())
    assert recorded["rows"] > 0 and rerun["data"] == recorded
    assert rerun["config"]["ogrpo"]["data_sha256"] == recorded["sha256"]
    assert f"pinned to what the recorded run trained: ogrpo.data_sha256: {recorded['sha256']}" in out.stderr
    assert rerun["model_revision"] is None and "model_revision" not in rerun["config"]  # a built-in model: no commit
    # a manifest from another stack: a warning by default, a refusal with --strict, naming what moved
    manifest = first / "run" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["versions"]["trl"] = "1.9.2"
    manifest.write_text(json.dumps(data))
    out = subprocess.run([*OGRPO, "reproduce", str(first), "--strict", "-o", str(tmp_path / "third")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert out.returncode == 2 and "trl 1.9.2 -> 1.16.0" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "third").exists()
    # a run whose rows are not those recorded (as if its dataset changed since): the rerun's trainer refuses them
    # in one line before the model loads, and nothing trains
    data["versions"]["trl"] = json.loads((again / "run" / "manifest.json").read_text())["versions"]["trl"]
    data["data"]["sha256"] = "0" * 64
    manifest.write_text(json.dumps(data))
    out = subprocess.run([*OGRPO, "reproduce", str(first), "-o", str(tmp_path / "fourth")], capture_output=True,
                         text=True, cwd=tmp_path, timeout=600)
    assert out.returncode != 0 and "not to the ogrpo.data_sha256 the run config pins" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not list((tmp_path / "fourth").glob("run/metrics.jsonl"))
    assert _survivors(tmp_path) == ()  # every job's server-less trainer and supervisor ended, the refused one's too


def test_the_hub_commit_a_model_came_from_is_recorded(tmp_path, monkeypatch):
    """A hub model (here the tiny model laid out as the HF cache keeps a download): the run's commit is the
    snapshot its name, branch or commit resolves to in the cache, read without the network; none for a repo or
    revision the cache does not hold, or a local directory."""
    import shutil

    from huggingface_hub import constants

    from ogrpo import tiny
    from ogrpo.trainer.model_revision import hub_commit

    commit, older = "0123456789abcdef0123456789abcdef01234567", "89abcdef0123456789abcdef0123456789abcdef"
    repo = tmp_path / "hub" / "models--org--tiny"
    for snap in (commit, older):
        shutil.copytree(tiny.ensure_model(tiny.TINY_NAME), repo / "snapshots" / snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / "refs" / "v1").write_text(older)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # huggingface_hub reads it at import
    assert hub_commit("org/tiny", None) == hub_commit("org/tiny", "main") == hub_commit("org/tiny", commit) == commit
    assert hub_commit("org/tiny", "v1") == hub_commit("org/tiny", older) == older
    for name, revision in (("org/absent", None), ("org/tiny", "v2"), ("org/tiny", "f" * 40),
                           ("org/tiny", "../../../etc")):
        assert hub_commit(name, revision) is None, (name, revision)
    assert hub_commit(str(repo / "snapshots" / commit), None) is None  # a directory: its path is the record
    solo = tmp_path / "hub" / "models--solo"  # a name without an organization (gpt2, bert-base-uncased)
    (solo / "snapshots" / older).mkdir(parents=True)
    (solo / "refs").mkdir()
    (solo / "refs" / "main").write_text(older)
    assert hub_commit("solo", None) == older
