"""Device decisions in one place: code outside the planner asks the device rules (ogrpo/planner/device_rules.py),
not `is_cpu`; and the rules' job-side answers per device kind."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ogrpo import packages
from ogrpo.planner import memory
from ogrpo.hardware import known_types, parse_gpus
from ogrpo.planner.device_rules import CpuRules, GpuRules, rules_of

PACKAGE = Path(__file__).resolve().parents[1] / "ogrpo"
# Where `is_cpu` belongs: the catalog fact (hardware.py) and the planner, whose device_rules is built from it.
OWNERS = ("planner/", "hardware.py")
# Tests of `is_cpu` still allowed elsewhere, each listed when this fails: files whose owners have the DeviceRules
# call that replaces them (render's deepspeed/accelerate/table, the server's device, selftest, train settings,
# `plan`'s preemption check, the calibration bench) and memory.trainer_estimate's older `is_cpu=` keyword.
MAX_IS_CPU_USES = 0


def is_cpu_uses(package: Path = PACKAGE) -> list[str]:
    """`path:line` of every name, attribute, argument, keyword or string key `is_cpu` (and every function named
    after it) outside OWNERS; read with ast, so comments and docstrings do not count."""
    out = set()
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel.startswith(OWNERS):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            name = (node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute)
                    else node.arg if isinstance(node, (ast.arg, ast.keyword))
                    else node.value if isinstance(node, ast.Constant) and isinstance(node.value, str)
                    else node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None)
            if name == "is_cpu" or (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "is_cpu" in name):
                out.add((rel, node.lineno))
    return [f"ogrpo/{rel}:{line}" for rel, line in sorted(out)]


def test_code_outside_the_planner_asks_the_device_rules_not_is_cpu():
    uses = is_cpu_uses()
    assert len(uses) <= MAX_IS_CPU_USES, (
        f"{len(uses)} tests of is_cpu outside ogrpo/planner/ and hardware.py (at most {MAX_IS_CPU_USES}): ask "
        "rules_of(plan) / rules_for(gpu) instead (ogrpo/planner/device_rules.py):\n" + "\n".join(uses))


def test_the_scan_finds_each_spelling(tmp_path):
    pkg = tmp_path / "ogrpo"
    (pkg / "planner").mkdir(parents=True)
    (pkg / "planner" / "x.py").write_text("a = gpu.is_cpu\n")  # the planner's own: not counted
    (pkg / "m.py").write_text('"""is_cpu in a docstring"""\n# is_cpu in a comment\n'
                              'a = p.is_cpu\nb = g["is_cpu"]\ndef f(is_cpu=False):\n    return is_cpu\n'
                              'est(is_cpu=True)\ndef _is_cpu_spec():\n    pass\n')
    assert is_cpu_uses(pkg) == [f"ogrpo/m.py:{n}" for n in (3, 4, 5, 6, 7, 8)]


@pytest.mark.parametrize("name", known_types())
def test_job_side_answers_per_device_kind(name):
    cluster = parse_gpus(name if name == "cpu" else f"2x{name}")
    r = rules_of(cluster)
    cpu = name == "cpu"
    assert isinstance(r, CpuRules if cpu else GpuRules)
    assert r.stack == ("cpu" if cpu else "a40" if cluster.gpu.fa2 else "v100") and r.stack in packages.STACKS
    assert r.memory_terms is (memory.CPU_TERMS if cpu else memory.GPU_TERMS)
    assert r.step_gpus([0, 1]) == ([] if cpu else [0, 1])
    assert r.launcher_flags(2) == (["--multi_gpu"] if cpu else []) and r.launcher_flags(1) == []
    assert (r.torch_device, r.checks_devices, r.runs_locally, r.estimates_host_ram) == (
        ("cpu", False, True, True) if cpu else ("cuda", True, False, False))
    assert r.accelerate_device_fields()["use_cpu"] is cpu and ("gpu_ids" in r.accelerate_device_fields()) is not cpu
    ds = r.deepspeed_precision("fp32" if cpu else "bf16" if cluster.gpu.bf16 else "fp16")
    enabled = {k: v["enabled"] for k, v in ds.items()}
    assert enabled == ({"bf16": "auto", "fp16": "auto"} if cpu else {"bf16": True, "fp16": False}
                       if cluster.gpu.bf16 else {"fp16": True, "bf16": False})
    assert r.deepspeed_offload()[0]["pin_memory"] is not cpu
    assert r.devices_text([0, 1], 2) == ("2 process(es)" if cpu else "GPU 0,1")


def test_the_memory_terms_follow_the_rules():
    """A CPU estimate has the interpreter's runtime, vLLM's 128-token blocks and no CUDA graphs."""
    from ogrpo.models import resolve_model

    m = resolve_model("Qwen/Qwen2.5-1.5B")
    cpu, gpu = rules_of(parse_gpus("2xcpu-64G")), rules_of(parse_gpus("2xA40"))
    args = dict(tensor_parallel_size=1, dtype_bytes=2, memory_gib=45.0, gpu_memory_utilization=0.9,
                max_model_len=1000, max_num_seqs=8, enforce_eager=False)
    on_cpu = memory.server_estimate(m, device=cpu.memory_terms, **args)
    on_gpu = memory.server_estimate(m, device=gpu.memory_terms, **args)
    assert on_cpu.terms["cuda_graphs"] == 0.0 < on_gpu.terms["cuda_graphs"]
    assert on_cpu.terms["runtime"] == memory.CPU_RUNTIME_GIB < on_gpu.terms["runtime"] == memory.RUNTIME_GIB
    for e, block in ((on_cpu, 128), (on_gpu, 16)):  # sequences hold whole KV blocks of the device's size
        assert e.notes["max_concurrent_seqs"] == int(e.notes["kv_cache_tokens"] // block / -(-1000 // block))
    targs = dict(num_processes=2, strategy="zero2", precision="fp32", micro_batch=2, prompt_len=64,
                 completion_len=64, gradient_checkpointing=False, beta=0.0)
    new = memory.trainer_estimate(m, device=cpu.memory_terms, **targs)
    assert "zero2_full_gradients" in new.terms and "zero2_full_gradients" not in memory.trainer_estimate(
        m, device=gpu.memory_terms, **targs).terms
