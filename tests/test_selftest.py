"""`ogrpo selftest`: the CPU checks end to end (one vLLM server, one weight push), the fp16 overflow probe on a
model made to overflow, `--gpu` without CUDA, and (gpu-marked) the GPU checks on a real GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

OGRPO = str(Path(sys.executable).with_name("ogrpo"))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.slow
def test_gpu_flag_without_cuda_exits_2_with_one_line(tmp_path):
    if _cuda():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run([OGRPO, "selftest", "--gpu", "--out", str(tmp_path / "r.json")], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --gpu: no CUDA device here (torch.cuda.is_available() is False); run `ogrpo selftest` without "
        "--gpu for the CPU checks"]
    assert not (tmp_path / "r.json").exists()


def test_bad_input_is_refused_before_any_check_runs(tmp_path):
    """A GPU spec the catalog does not know, or a report path that cannot be written: one line and exit 2 at once,
    not a failed check (or a lost report) after minutes of checks."""
    bad = [(["--gpus", "3xZZZ"], "error: --gpus '3xZZZ': unknown GPU type ZZZ"),
           (["--out", "/proc/no/such/report.json"], "error: -o /proc/no/such/report.json: cannot write the report")]
    for args, first in bad:
        proc = subprocess.run([OGRPO, "selftest", *args], capture_output=True, text=True, cwd=tmp_path, timeout=60)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(first), proc.stderr
        assert not proc.stdout and not list(tmp_path.iterdir())  # no check ran, no report written


def test_selftest_reads_gpus_with_the_one_parser():
    """`selftest --gpus` goes through hardware.parse_gpus: a CPU spec with a memory suffix is a CPU plan like
    `cpu`, and one GPU of a type, however it is written, is planned as two of it (one for the vLLM server)."""
    from ogrpo.checks.selftest import selftest_plan

    _, sized = selftest_plan("tiny", "cpu-32G", None, 0)
    _, plain = selftest_plan("tiny", "cpu", None, 0)
    assert sized.cluster.is_cpu and (sized.mode, sized.vllm.num_gpus) == (plain.mode, plain.vllm.num_gpus)
    for spec in ("A40", "1xA40", "1x a40"):
        _, p = selftest_plan("tiny", spec, None, 1)
        assert (p.cluster.spec, p.mode, p.vllm.num_gpus, p.trainer.num_gpus) == ("2xA40", "server", 1, 1), spec


@pytest.fixture(scope="module")
def overflowing_model(tmp_path_factory):
    """The tiny model with layer 1's MLP output scaled past fp16's range (what Qwen2.5's largest activations do)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ogrpo import tiny

    src = tiny.ensure_tiny_model()
    out = tmp_path_factory.mktemp("overflow")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(1e5)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return str(src), str(out)


@pytest.mark.slow
def test_overflow_probe_names_the_first_module_past_fp16(overflowing_model):
    from ogrpo.checks.selftest import FP16_MAX, overflow_probe

    clean, scaled = overflowing_model
    ok = overflow_probe(clean, "cpu", "fp16")
    assert ok["status"] == "pass" and 0 < ok["ratio"] < 1 and ok["fp16_first_nonfinite_module"] is None, ok
    assert ok["max_abs_activation"] == pytest.approx(ok["ratio"] * FP16_MAX)

    bad = overflow_probe(scaled, "cpu", "fp16")
    assert bad["status"] == "fail" and bad["ratio"] > 1, bad
    assert bad["first_module_over_fp16"] == "model.layers.1.mlp.down_proj", bad
    assert bad["fp16_first_nonfinite_module"] is not None  # fp16 weights really produce inf/NaN
    assert "overflows fp16 first at model.layers.1.mlp.down_proj" in bad["detail"]
    # the same model where the plan trains bf16 and serves bf16: reported, not failed
    info = overflow_probe(scaled, "cpu", "bf16", server_dtype="bfloat16")
    assert info["status"] == "pass" and "not used" in info["detail"] and info["ratio"] == bad["ratio"]
    # a fp16 server alone is enough to fail it (vLLM serves pure fp16 on a V100)
    assert overflow_probe(scaled, "cpu", "fp32", server_dtype="float16")["status"] == "fail"


@pytest.mark.integration
def test_cpu_selftest_writes_one_report_with_every_check(tmp_path):
    report_path = tmp_path / "report.json"
    proc = subprocess.run([OGRPO, "selftest", "--out", str(report_path), "--ds-ops", "cpu_adam"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1] == str(report_path)
    report = json.loads(report_path.read_text())
    checks = report["checks"]
    assert report["status"] == "pass" and report["mode"] == "cpu" and report["device"] == {"name": "cpu"}
    env = report["environment"]
    assert env["trl"] and env["vllm"] and env["torch"]["version"] and env["deepspeed"]
    assert checks["tf32"]["status"] == "skip" and checks["flash_attn"]["status"] == "skip"

    ops = checks["deepspeed_ops"]
    assert ops["status"] == "pass" and ops["ops"]["cpu_adam"]["compatible"] is True, ops
    assert ops["accelerator"] == "cpu"

    probe = checks["fp16_overflow"]
    assert probe["status"] == "pass" and 0 < probe["ratio"] < 1 and probe["max_module"].startswith("model")
    assert probe["calibration"].startswith("dataset:")  # the tiny recipe's own prompts

    server = checks["vllm_server"]
    argv = server["argv"]
    plan_args = report["plan"]["vllm_args"]
    assert server["status"] == "pass" and server["changed"] is None
    # the plan's flags reach vLLM: its KV budget, dtype and the CPU weight-sync backend
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(plan_args["kv_cache_memory_bytes"])
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert '{"backend": "cpu_shm"}' in argv

    push = checks["weight_push"]
    assert push["status"] == "pass" and push["client"] == "CPUVLLMClient", push
    after, before = push["gap_after_push"]["mean"], push["gap_before_push"]["mean"]
    assert after < 1e-4 and before > 3 * after and push["gap_after_push"]["tokens"] > 0, push
    assert Path(server["log"]).read_text().count('"POST /update_weights HTTP/1.1" 200') == 1


@pytest.mark.gpu
@pytest.mark.integration
def test_gpu_selftest_on_this_node(tmp_path):
    report_path = tmp_path / "report.json"
    proc = subprocess.run([OGRPO, "selftest", "--gpu", "--out", str(report_path)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=1800)
    report = json.loads(report_path.read_text())
    checks = report["checks"]
    assert proc.returncode == 0, json.dumps(checks, indent=1)[-4000:] + proc.stderr[-3000:]
    sm = report["device"]["sm"]
    assert checks["tf32"]["status"] == "pass" and checks["tf32"]["plan_tf32"] == (sm >= 80)
    if sm >= 80:
        fa = checks["flash_attn"]
        assert fa["status"] == "pass" and fa["max_abs_diff"] <= fa["tolerance"], fa
    else:
        assert checks["flash_attn"]["status"] == "skip" and "not applicable" in checks["flash_attn"]["detail"]
    assert checks["deepspeed_ops"]["status"] == "pass" and checks["deepspeed_ops"]["accelerator"] == "cuda"
    assert checks["fp16_overflow"]["status"] == "pass" and checks["vllm_server"]["status"] == "pass"
    push = checks["weight_push"]
    assert push["status"] == "pass", push
    if "gap_after_push" in push:  # two GPUs or more: a real NCCL push
        assert push["gap_after_push"]["mean"] < push["tolerance_mean"]
