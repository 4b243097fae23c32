"""Typed GRES on the test cluster's two fake GPU types (tests/slurm/cluster.sh: 3 A40s on `debug`, 2 V100s on
`v100`): a GPU plan asks Slurm for its type, `submit` refuses a partition without it naming those with it, and a
GPU plan that lands where it finds no CUDA fails in seconds with one line instead of training on the CPU."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from .conftest import ogrpo, processes_of_job, sacct_state, wait_gone
from .test_slurm_submit import CONFIG, newest_job_id

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def two_types(slurm_cluster):
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%P %G"], capture_output=True, text=True, check=True).stdout
    if "v100 gpu:v100:2" not in out:
        pytest.skip("no V100 partition: node2 needs root and `ip netns` (tests/slurm/cluster.sh)")
    return out


def _errors(out) -> list[str]:
    return [ln for ln in out.stderr.splitlines() if not ln.startswith(("warning:", "change:", "note:"))]


@pytest.mark.parametrize("gpus,partition,missing,where", [
    ("2xV100", "debug", "partition debug has no v100 GPUs (its GPUs: a40 x3)", "partitions with 2 per node: two, v100"),
    ("2xV100", None, "partition debug has no v100 GPUs", "submit with --partition two"),  # the default partition
    ("3xA40", "v100", "partition v100 has no a40 GPUs (its GPUs: v100 x2)", "partitions with 3 per node: debug, two"),
])
def test_a_partition_without_the_plans_gpu_type_is_refused(two_types, tmp_path, gpus, partition, missing, where):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG)
    before = newest_job_id()
    out = ogrpo("submit", "--config", str(cfg), "--gpus", gpus, "-o", str(tmp_path / "job"),
                *(["--partition", partition] if partition else []))
    assert out.returncode == 2, out.stdout + out.stderr
    errors = _errors(out)
    assert len(errors) == 1 and missing in errors[0] and where in errors[0], out.stderr
    assert not (tmp_path / "job").exists() and newest_job_id() == before  # nothing written, nothing submitted


def test_the_type_is_overridable(two_types, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG)
    # 'any': an untyped request, which the A40 partition's sbatch --test-only accepts
    out = ogrpo("submit", "--config", str(cfg), "--gpus", "2xV100", "-p", "debug", "--gres-type", "any", "--dry-run",
                "-o", str(tmp_path / "job"), check=True)
    assert "#SBATCH --gres=gpu:2\n" in out.stdout
    # the site's spelling of the type, checked against sinfo like the catalog's
    out = ogrpo("submit", "--config", str(cfg), "--gpus", "2xV100", "-p", "v100", "--gres-type", "V100",
                "-o", str(tmp_path / "job2"))
    assert out.returncode == 2 and "names these GPUs 'v100', not 'V100': submit with --gres-type v100" in out.stderr


def test_a_v100_plan_is_accepted_on_the_v100_partition_and_refuses_to_run_without_cuda(two_types, tmp_path):
    """Accepted: the job asks for gpu:v100:2 and Slurm starts it on node2 with those devices. The steps find no
    CUDA there (the GPUs are fake): the server and the trainer exit at once with one line, and the job FAILS
    (before, an untyped request landed anywhere and the plan trained on the CPU to COMPLETED)."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG)
    job = tmp_path / "job"
    out = ogrpo("submit", "--config", str(cfg), "--gpus", "2xV100", "-p", "v100", "-o", str(job), check=True)
    job_id = out.stdout.split("submitted job ", 1)[1].split()[0]
    assert "#SBATCH --gres=gpu:v100:2" in (job / "job.sbatch").read_text().splitlines()
    start = time.monotonic()
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    assert "gres/gpu:v100=2" in shown or "gres:gpu:v100:2" in shown, shown
    wait_gone(job_id, timeout=600)
    elapsed = time.monotonic() - start
    assert sacct_state(job_id) == "FAILED"
    logs = {p.name: p.read_text() for p in (job / "run" / "logs").glob("*.log")}
    refused = [ln for text in logs.values() for ln in text.splitlines() if "sees no CUDA device" in ln]
    assert refused and all(ln.startswith("error: ") and "the plan is for 2xV100" in ln for ln in refused), logs
    assert not [ln for text in logs.values() for ln in text.splitlines() if ln.startswith("Traceback")]
    # the job's summary is that one line (before: the last 30 lines of the log, ~40 with torch's traceback)
    result = json.loads((job / "slurm" / "result.json").read_text())
    assert len(result["message"].splitlines()) == 1 and "sees no CUDA device" in result["message"], result
    shown = json.loads(ogrpo("status", job_id, "--json", check=True).stdout)["result"]["message"]
    assert shown == result["message"]
    supervisor = (job / "logs" / f"slurm-{job_id}.out").read_text()
    failed = [ln for ln in supervisor.splitlines() if "job failed:" in ln]
    assert len(failed) == 1 and "sees no CUDA device" in failed[0], supervisor[-3000:]
    assert processes_of_job(job_id) == []
    print(f"V100 plan without CUDA: job {job_id} failed {elapsed:.0f} s after submission")
