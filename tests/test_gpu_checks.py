"""A GPU plan asks Slurm for its GPU type and refuses devices it was not planned for: the typed GRES request and
its `sinfo` check (ogrpo.launch.slurm.sbatch, ogrpo.launch.slurm.gres), and the CUDA/GPU-model check the server and the
trainer make at start (ogrpo.device_check). tests/slurm/test_slurm_gres.py runs the same against real Slurm."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ogrpo.device_check import device_problem, planned_gpu
from ogrpo.errors import OgrpoError
from ogrpo.hardware import parse_gpus
from ogrpo.launch.slurm.gres import gres_problem, parse_gres, partition_gpus
from ogrpo.launch.slurm.sbatch import SlurmOptions, directives, gres_type_for

SINFO = "debug* gpu:a40:3(S:0-1)\ntwo gpu:a40:3(S:0-1)\ntwo gpu:v100:2\nv100 gpu:v100:2\ncpu (null)\n"


def test_the_catalog_names_each_gpu_familys_gres_type():
    assert parse_gpus("3xA40").gpu.gres_type == "a40"
    assert parse_gpus("4xV100-16G").gpu.gres_type == parse_gpus("4xV100").gpu.gres_type == "v100"
    assert parse_gpus("2x8xA100-80G").gpu.gres_type == "a100" and parse_gpus("2xcpu").gpu.gres_type is None
    assert parse_gpus("1xH100").gpu.to_dict()["gres_type"] == "h100"


def test_the_gres_line_carries_the_type_unless_overridden():
    def gres(opts):
        return dict(directives(type("S", (), {"steps": [], "job_dir": "/j"})(), opts)).get("gres")

    assert gres(SlurmOptions(gpus_per_node=3, gres_type="a40")) == "gpu:a40:3"
    assert gres(SlurmOptions(gpus_per_node=3)) == "gpu:3"
    assert gres(SlurmOptions(gpus_per_node=0, gres_type="a40")) is None
    v100 = parse_gpus("2xV100").gpu
    assert gres_type_for(v100, None) == "v100" and gres_type_for(v100, "tesla_v100") == "tesla_v100"
    assert gres_type_for(v100, "any") is None and gres_type_for(v100, "NONE") is None
    with pytest.raises(OgrpoError, match="a GRES type is a name like a40"):
        gres_type_for(v100, "v100:2")


def test_sinfo_gres_is_read_per_partition():
    assert parse_gres("gpu:a40:3(S:0-1),gpu:v100:2") == {"a40": 3, "v100": 2}
    assert parse_gres("gpu:4") == {None: 4} and parse_gres("(null)") == {}
    parts, default = partition_gpus(SINFO)
    assert default == "debug" and parts["two"] == {"a40": 3, "v100": 2} and parts["cpu"] == {}


@pytest.mark.parametrize("partition,gtype,count,says", [
    (None, "v100", 2, "partition debug has no v100 GPUs (its GPUs: a40 x3); partitions with 2 per node: two, v100"),
    ("v100", "a40", 1, "partition v100 has no a40 GPUs (its GPUs: v100 x2); partitions with 1 per node: debug, two"),
    ("cpu", "a40", 1, "partition cpu has no a40 GPUs (its GPUs: none)"),
    ("two", "v100", 3, "nodes of partition two have at most 2 v100 GPUs, not 3; no partition has 3 v100 GPUs per node"),
    ("v100", "V100", 2, "partition v100 names these GPUs 'v100', not 'V100': submit with --gres-type v100"),
    ("debug", "h100", 1, "no partition has 1 h100 GPUs per node"),
])
def test_a_partition_without_the_type_is_refused_naming_those_with_it(partition, gtype, count, says):
    parts, default = partition_gpus(SINFO)
    problem = gres_problem(parts, default, partition, gtype, count)
    assert problem is not None and says in problem


def test_a_partition_with_the_type_passes():
    parts, default = partition_gpus(SINFO)
    assert gres_problem(parts, default, None, "a40", 3) is None
    assert gres_problem(parts, default, "two", "v100", 2) is None
    assert gres_problem(parts, default, "nope", "a40", 1) is None  # an unknown partition is preflight's to name
    # more GPUs per node than any node has: the existing count check names that, not this one
    assert gres_problem(parts, default, "v100", "v100", 4) is None


A40 = {"name": "A40", "family": "A40", "memory_gib": 45.0, "is_cpu": False}
V100_32 = {"name": "V100-32G", "family": "V100", "memory_gib": 32.0, "is_cpu": False}


def _row(name, catalog, mem, index=0):
    return {"index": index, "name": name, "catalog": catalog, "memory_gib": mem}


def test_the_device_check_refuses_no_cuda_another_model_and_less_memory():
    from ogrpo.hardware import parse_gpus
    from ogrpo.planner.types import Plan

    def plan(spec):
        return Plan.from_dict({"cluster": parse_gpus(spec).to_dict()})

    assert planned_gpu(plan("cpu")) is None and planned_gpu(None) is None
    assert planned_gpu(plan("3xA40"))["name"] == "A40"
    assert "sees no CUDA device" in device_problem(A40, [], "3xA40", "trainer")
    wrong = device_problem(A40, [_row("Tesla V100-SXM2-32GB", "V100-32G", 31.7)], "3xA40", "server")
    assert wrong.startswith("server: the plan is for 3xA40 but CUDA device 0 is Tesla V100-SXM2-32GB")
    small = device_problem(V100_32, [_row("Tesla V100-SXM2-16GB", "V100-16G", 15.8)], "4xV100-32G", "trainer")
    assert "has 15.8 GiB" in small and "V100-16G" in small
    unknown = device_problem(A40, [_row("NVIDIA Mystery", None, 80.0)], "3xA40", "trainer")
    assert "NVIDIA Mystery" in unknown
    assert device_problem(A40, [_row("NVIDIA A40", "A40", 45.0), _row("NVIDIA A40", "A40", 45.0, 1)],
                          "3xA40", "trainer") is None
    assert device_problem(V100_32, [_row("Tesla V100-SXM2-32GB", "V100-32G", 31.7)], "2xV100-32G", "x") is None


@pytest.mark.slow
def test_server_and_trainer_refuse_a_gpu_plan_here_in_seconds(tmp_path):
    """Without CUDA (this machine), a rendered GPU job's steps exit 2 with one line before any model work."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: ogrpo:tiny\ndataset_name: ogrpo:tiny\nreward_funcs: [tiny_letter]\n"
                      "max_completion_length: 12\nogrpo:\n  max_prompt_length: 64\n")
    job = tmp_path / "job"
    subprocess.run([sys.executable, "-m", "ogrpo", "render", "--gpus", "2xV100", "--config", str(recipe),
                    "-o", str(job)], check=True, capture_output=True, text=True)
    env = {"OGRPO_JOB_KEY": "k" * 32, "PATH": "/usr/bin:/bin"}
    for role, argv in (("server", ["serve", "--config", str(job / "run.yaml"), "--port", "18777"]),
                       ("trainer", ["train", "--config", str(job / "run.yaml"), "--output-dir", str(tmp_path / "r")])):
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "ogrpo", *argv], capture_output=True, text=True, timeout=300,
                             env=env)
        lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
        assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
        assert lines[0].startswith(f"error: {role}: the plan is for 2xV100") and "no CUDA device" in lines[0]
        assert "Traceback" not in out.stderr and not (tmp_path / "r").exists()
        print(f"{role} refused in {time.monotonic() - start:.1f} s")
