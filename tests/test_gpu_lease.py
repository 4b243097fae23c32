"""The GPU lease (ogrpo/gpu_lease.py) on this CPU machine: the wheelhouse is built, under the 64 MiB a device call
carries, and installs with no index into a target dir that imports beside this venv's torch/transformers; the run
command's dry mode says "no GPU" and what it would run; budgets cut a part that overruns; the run checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ogrpo import gpu_lease

REPO = Path(__file__).resolve().parent.parent
HERE_PY = f"{sys.version_info.major}.{sys.version_info.minor}"


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    """Built for this interpreter's Python: every wheel comes from this venv (no download), so CI stays cheap."""
    out = tmp_path_factory.mktemp("lease") / "wheelhouse"
    cache = tmp_path_factory.mktemp("cache")
    proc = subprocess.run([sys.executable, "-m", "ogrpo.gpu_lease", "build", "--out", str(out), "--cache",
                           str(cache), "--python-version", HERE_PY], capture_output=True, text=True, timeout=600,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not any(cache.iterdir())  # nothing downloaded for this Python
    return out, proc.stdout


@pytest.mark.slow
def test_wheelhouse_is_what_the_image_lacks_and_fits(wheelhouse):
    out, stdout = wheelhouse
    manifest = json.loads((out / "manifest.json").read_text())
    names = {w["name"] for w in manifest["wheels"]}
    assert names == {"trl", "datasets", "dill", "multiprocess", "math-verify", "latex2sympy2-extended",
                     "antlr4-python3-runtime", "ogrpo"}
    wheels = sorted(out.glob("*.whl"))
    assert len(wheels) == len(names)
    total = sum(p.stat().st_size for p in wheels) / 2**20
    assert total < gpu_lease.LIMIT_MIB and abs(total - manifest["total_mib"]) < 0.01
    # pyarrow is the big one datasets needs: the image has it, so it stays home (and the manifest says so)
    assert "pyarrow" in manifest["left_out_image_has_mib_installed"]
    assert "total" in stdout and "pyarrow" in stdout
    ours = next(p for p in wheels if p.name.startswith("ogrpo-"))
    members = zipfile.ZipFile(ours).namelist()
    assert any(n.startswith("ogrpo/kernels/linear_logprobs/csrc/") for n in members)
    assert "ogrpo/recipes/tiny-math.yaml" in members
    by = {w["name"]: w for w in manifest["wheels"]}
    assert by["dill"]["needed_by"] == ["datasets", "multiprocess"]


@pytest.mark.slow
def test_wheelhouse_installs_with_no_index_beside_this_venv(wheelhouse, tmp_path):
    out, _ = wheelhouse
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                          "--target", str(target), *map(str, sorted(out.glob("*.whl")))],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-2000:]
    code = ("import json, sys, torch, transformers, trl, datasets, math_verify, ogrpo; "
            "from ogrpo.gpu_lease import check_requirements; from pathlib import Path; "
            "print(json.dumps({m.__name__: m.__file__ for m in (trl, datasets, math_verify, ogrpo)} | "
            "{'problems': check_requirements(Path(sys.argv[1]))}))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(target)}
    proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found.pop("problems") == []
    assert all(path.startswith(str(target)) for path in found.values()), found
    assert (target / "ogrpo" / "kernels" / "fused_sample").is_dir()


@pytest.mark.integration
def test_wheelhouse_for_the_lease_python(tmp_path):
    """For the image's Python 3.12: multiprocess ships one wheel per Python, so it comes from PyPI (cached under
    build/wheel-cache, so a second build downloads nothing)."""
    if HERE_PY == gpu_lease.TARGET_PYTHON:
        pytest.skip("this interpreter is the image's Python: the module fixture's build covers it")
    manifest = gpu_lease.build(tmp_path / "wh", REPO / "build" / "wheel-cache", gpu_lease.TARGET_PYTHON)
    by = {w["name"]: w for w in manifest["wheels"]}
    assert by["multiprocess"]["wheel"].endswith("-py312-none-any.whl") and "PyPI" in by["multiprocess"]["source"]
    assert manifest["total_mib"] < gpu_lease.LIMIT_MIB


def test_dry_mode_says_no_gpu_and_what_it_would_run(tmp_path, capsys):
    if gpu_lease.gpu_report.cuda_facts()["cuda"]:
        pytest.skip("this machine has CUDA: the lease runs for real")
    # in this process (torch is imported once per session): the command's own entry point, as `make test-gpu-lease`
    assert gpu_lease.main(["run", "--wheelhouse", str(tmp_path / "none"), "--out", str(tmp_path / "r"),
                           "--work", str(tmp_path / "w")]) == 0
    report = json.loads((tmp_path / "r" / "gpu-report.json").read_text())
    assert report["status"] == "no GPU" and report["parts"] == []
    parts = {p["part"]: p for p in report["would_run"]}
    assert {"install", "requirements", "gpu tests", "selftest --gpu", "train tiny-math", "train check",
            "memory model"} <= set(parts)
    assert {f"bench step {c} kernels {k}" for c in ("default", "0.5B", "long") for k in ("on", "off")} <= set(parts)
    assert sum(p["budget_s"] for p in report["would_run"]) <= 480  # inside the lease's 8 minutes
    # the figures no lease has measured come before the gpu tests an earlier lease ran
    assert list(parts).index("train tiny-math") < list(parts).index("gpu tests") == len(parts) - 1
    assert "--no-index" in parts["install"]["command"] and "--target" in parts["install"]["command"]
    assert "--no-server" in parts["selftest --gpu"]["command"]
    assert "--tokens 2048" in parts["bench step long kernels off"]["command"]
    assert "--no-kernels" in parts["bench step long kernels off"]["command"]
    assert "--hidden 896 --layers 24" in parts["bench step 0.5B kernels on"]["command"]
    assert "1xH100" in parts["train tiny-math"]["command"]  # no device: the lease's first kind
    text = capsys.readouterr().out
    assert not (tmp_path / "w").exists()  # nothing installed or run
    assert "no GPU: nothing run" in text and "would run: train tiny-math (50 s)" in text


def test_the_commands_it_would_run_are_valid_cli(run_cli):
    """Each option the parts pass exists (a typo would only show on the lease)."""
    step = run_cli("bench", "step", "--help", check_rc=0).stdout
    assert all(opt in step for opt in ("--gpus", "--no-kernels", "--workdir", "--tokens", "--kv-heads"))
    assert "--no-server" in run_cli("selftest", "--help", check_rc=0).stdout
    assert "--set" in run_cli("train", "--help", check_rc=0).stdout
    proc = run_cli("bench", "step", "--placement", "split", "--gpus", "1xH100", check_rc=2)
    assert "single placement" in proc.stderr + proc.stdout


@pytest.mark.slow
def test_budgets_cut_a_part_that_overruns_and_keep_the_rest(tmp_path):
    sleep = ["-c", "import time; time.sleep(60)"]
    parts = [("install", ["-c", "print('ok')"], 30), ("slow", sleep, 3), ("after", ["-c", "print('ran')"], 30),
             ("hog", sleep, 300), ("late", ["-c", "print('x')"], 30)]
    facts = {"cuda": True, "devices": ["NVIDIA H100 80GB HBM3"], "torch": "2.11.0"}
    report = gpu_lease.run(tmp_path / "wh", tmp_path / "r", tmp_path / "w", budget_s=12, facts=facts, parts=parts)
    by = {p["part"]: p for p in report["parts"]}
    assert [p["part"] for p in report["parts"]] == [n for n, _, _ in parts]
    assert by["install"]["outcome"] == "pass" and by["after"]["outcome"] == "pass"
    assert by["slow"]["outcome"] == "timeout" and 3 <= by["slow"]["seconds"] < 8  # its own budget
    # the hog gets what is left of the whole budget, not its own 300 s; the last part is cut, not lost silently
    assert by["hog"]["outcome"] == "timeout" and by["hog"]["seconds"] < 12
    assert by["late"]["outcome"] == "cut" and "no time left" in by["late"]["summary"]
    assert report["status"] == "fail" and sum(p["seconds"] for p in report["parts"]) < 12 + 10
    assert "PYTHONPATH" not in os.environ or str(tmp_path) not in os.environ["PYTHONPATH"]
    assert gpu_lease.card(facts["devices"]) == "H100" and gpu_lease.card(["NVIDIA H200"]) == "H200"


def _run_dir(path: Path, rewards: list[float], checkpoint: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text("{}")
    (path / "profile.jsonl").write_text(json.dumps({"step": 1, "mem_estimate_gib": 2.0, "mem_measured_gib": 1.9})
                                        + "\n" + json.dumps({"step": 2, "mem_estimate_gib": 2.0,
                                                             "mem_measured_gib": 2.2}) + "\n")
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward": r}) + "\n"
                                                for i, r in enumerate(rewards)))
    if checkpoint:
        (path / "checkpoint-8").mkdir()
    return path


def test_run_check_and_memory_rows(tmp_path):
    assert gpu_lease.check_run(_run_dir(tmp_path / "up", [0.1, 0.2, 0.2, 0.3, 0.5, 0.6, 0.6, 0.7])) == []
    flat = gpu_lease.check_run(_run_dir(tmp_path / "flat", [0.5, 0.4, 0.5, 0.5, 0.4, 0.5, 0.4, 0.4]))
    assert len(flat) == 1 and flat[0].startswith("reward did not rise")
    bare = _run_dir(tmp_path / "bare", [0.1, 0.9, 0.9, 0.9], checkpoint=False)
    (bare / "profile.jsonl").unlink()
    assert gpu_lease.check_run(bare) == ["no profile.jsonl", "no checkpoint-N/"]
    (tmp_path / "trl-profile.jsonl").write_text(json.dumps({"mem_measured_gib": 3.0}) + "\n")
    rows = {r["run"]: r for r in gpu_lease.memory_rows(tmp_path)}
    assert set(rows) == {"up", "flat"}  # plain TRL's profile has no estimate
    assert rows["up"] == {"run": "up", "estimate_gib": 2.0, "measured_gib": 2.2, "measured_over_estimate": 1.1}
