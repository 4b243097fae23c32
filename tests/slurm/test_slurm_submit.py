"""`ogrpo submit` against the test cluster: bad input is refused before anything is written or submitted."""

from __future__ import annotations

import subprocess

import pytest

from .conftest import ogrpo

pytestmark = pytest.mark.slurm

# The tiny model: its 3xA40 plan asks for 14 GiB of host RAM, which the test node (80 % of this machine) has
CONFIG = ("model_name_or_path: ogrpo:tiny\ndataset_name: trl-lib/tldr\nreward_funcs: [accuracy]\n"
          "max_completion_length: 64\nogrpo:\n  max_prompt_length: 64\n")


def _ids(argv: list[str]) -> set[int]:
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()
    return {int(x.split("_")[0].split(".")[0]) for x in out}


def newest_job_id() -> int:
    """The highest job ID the controller (every job of the last MinJobAge seconds) or the accounting DB knows.
    A count of sacct rows is not a test of "nothing was submitted": slurmdbd records jobs asynchronously, so an
    earlier test's job can appear there seconds later; its ID is still below this one."""
    ids = _ids(["squeue", "-h", "-t", "all", "-o", "%i"])
    ids |= _ids(["sacct", "-n", "-X", "-P", "-a", "-S", "2000-01-01", "-o", "JobID"])
    return max(ids, default=0)


@pytest.mark.parametrize("args,message", [
    (["--gpus", "3xA40", "--partition", "nope"], "unknown partition 'nope': use one of debug"),
    (["--gpus", "3xA40", "--account", "nope"], "unknown account 'nope' for this user: use one of ogrpo"),
    (["--gpus", "4xA40"], "4 GPUs per node requested but nodes of this cluster have at most 3"),
    (["--gpus", "3xA40", "--qos", "nope"], "Slurm would not accept this job"),
    # ZeRO-3 offload of a 7B model: ~130 GiB of optimizer and weights in host RAM, more than a CI node has
    (["--gpus", "2xA40", "--model", "Qwen/Qwen2.5-7B-Instruct"],
     "GiB of host RAM per node (server "),
])
def test_bad_requests_are_refused_before_submitting(slurm_cluster, tmp_path, args, message):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG)
    before = newest_job_id()
    out = ogrpo("submit", "--config", str(cfg), "-o", str(tmp_path / "job"), *args)
    assert out.returncode == 2, out.stderr
    error = [line for line in out.stderr.splitlines() if not line.startswith(("warning:", "change:"))]
    assert len(error) == 1 and message in error[0], out.stderr  # one line (after the plan's notes), naming the fix
    if "host RAM" in message:  # names both numbers: the need and what sinfo says the nodes have
        assert "but nodes of this cluster have at most" in error[0] and "sinfo -o %m" in error[0]
    assert not (tmp_path / "job").exists()
    assert newest_job_id() == before  # nothing submitted


def test_dry_run_submits_nothing(slurm_cluster, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG)
    before = newest_job_id()
    out = ogrpo("submit", "--config", str(cfg), "--gpus", "3xA40", "--dry-run", "-o", str(tmp_path / "job"),
                "--slurm", "mail-type=END", check=True)
    assert "#SBATCH --gres=gpu:a40:3" in out.stdout and "#SBATCH --mail-type=END" in out.stdout
    assert "#SBATCH --signal=B:USR2@90" in out.stdout and "#SBATCH --requeue" in out.stdout
    assert "server: srun --exact" in out.stdout and "--gres=gpu:1" in out.stdout and "--gres=gpu:2" in out.stdout
    assert not (tmp_path / "job").exists()
    assert newest_job_id() == before  # nothing submitted
