"""The --gpus grammar and the GPU catalog."""

from __future__ import annotations

import pytest

from error_checks import one_line_error
from ogrpo.hardware import CATALOG, parse_gpus


@pytest.mark.parametrize(
    "spec, nodes, per_node, name",
    [
        ("3xA40", 1, 3, "A40"),
        ("3xa40", 1, 3, "A40"),
        (" 3 x A40 ", 1, 3, "A40"),
        ("4xV100", 1, 4, "V100-32G"),  # bare V100 means the 32 GB part
        ("4xV100-16G", 1, 4, "V100-16G"),
        ("4xV100-32GB", 1, 4, "V100-32G"),
        ("2x8xA100-80G", 2, 8, "A100-80G"),
        ("8xA100-40G", 1, 8, "A100-40G"),
        ("1xH100", 1, 1, "H100"),
        ("2xL40S", 1, 2, "L40S"),
        ("1xA40-48G", 1, 1, "A40"),  # nominal size accepted though nvidia-smi reports 45 GiB
        ("cpu", 1, 1, "cpu"),
        ("2xcpu", 1, 2, "cpu"),
        ("3xCPU", 1, 3, "cpu"),
    ],
)
def test_grammar(spec, nodes, per_node, name):
    c = parse_gpus(spec)
    assert (c.nodes, c.gpus_per_node, c.gpu.name) == (nodes, per_node, name)
    assert c.total_gpus == nodes * per_node
    # The canonical spelling parses back to the same cluster.
    again = parse_gpus(c.spec)
    assert (again.nodes, again.gpus_per_node, again.gpu.name) == (nodes, per_node, name)


def test_cpu_memory_can_be_given():
    c = parse_gpus("2xcpu-16G")
    assert c.is_cpu and c.gpu.memory_gib == 16.0 and c.spec == "2xcpu-16G"
    c = parse_gpus("2x1xCPU")  # two CPU nodes of a Slurm partition
    assert c.is_cpu and (c.nodes, c.gpus_per_node, c.spec) == (2, 1, "2x1xcpu")


def test_interconnect_suffix():
    assert parse_gpus("4xV100-32G").gpu.interconnect == "nvlink"
    assert parse_gpus("4xV100-32G-pcie").gpu.interconnect == "pcie"
    assert parse_gpus("4xA40").gpu.interconnect == "pcie"


@pytest.mark.parametrize(
    "spec, words",
    [
        ("", "empty"),
        ("3xB200", "unknown GPU type B200"),
        ("3xA4O", "did you mean A40"),
        ("0xA40", "at least 1"),
        ("2x0xA40", "at least 1"),
        ("-1xA40", "positive"),
        ("3*A40", "malformed"),
        ("3xA40x", "unknown GPU type A40X"),
        ("x3xA40", "unknown GPU type"),
        ("4xV100-24G", "known variants: V100-16G, V100-32G"),
        ("999999999999xA40", "at most 16 per node"),  # was a MemoryError traceback
        ("17xA40", "at most 16 per node"),
        ("2000x8xA100-80G", "1024 nodes"),
        ("999999999999xcpu", "at most 256 per node"),
    ],
)
def test_bad_specs_name_the_fix(spec, words):
    error = one_line_error(parse_gpus, spec)
    assert words in str(error)
    assert error.exit_code == 2


def test_catalog_facts_follow_compat_md():
    v = CATALOG["V100-32G"]
    assert (v.sm, v.bf16, v.tf32, v.fa2, v.triton_tensor_cores) == (70, False, False, False, False)
    assert CATALOG["V100-16G"].memory_gib == 16.0
    a = CATALOG["A40"]
    assert (a.sm, a.bf16, a.tf32, a.fa2, a.triton_tensor_cores, a.interconnect) == (86, True, True, True, True,
                                                                                      "pcie")
    # A40 and L40S report 46068 MiB = 45.0 GiB (not the nominal 48 GB).
    assert a.memory_gib == pytest.approx(46068 / 1024, abs=0.1)
    assert CATALOG["A100-80G"].memory_gib == 80.0 and CATALOG["A100-40G"].memory_gib == 40.0
    assert CATALOG["H100"].sm == 90 and CATALOG["L40S"].sm == 89
    cpu = parse_gpus("cpu").gpu
    assert cpu.is_cpu and not cpu.bf16 and not cpu.fa2 and cpu.memory_gib > 0


@pytest.mark.parametrize("device, mem, name", [
    ("NVIDIA A100-SXM4-80GB", 79.2, "A100-80G"),
    ("NVIDIA A100-PCIE-40GB", 39.4, "A100-40G"),
    ("Tesla V100-SXM2-32GB", 31.7, "V100-32G"),
    ("Tesla V100-PCIE-16GB", 15.8, "V100-16G"),
    ("NVIDIA A40", 44.4, "A40"),
    ("NVIDIA A10", 22.0, "A10"),
    ("NVIDIA H100 80GB HBM3", 79.1, "H100"),
    ("NVIDIA GeForce RTX 4090", 23.6, None),
])
def test_match_device_names(device, mem, name):
    from ogrpo.hardware import match_device

    got = match_device(device, mem)
    assert (got.name if got else None) == name
