"""`ogrpo bench rollout` structure on a tiny shape (never its timings: performance is reported by the
benchmark itself, not asserted)."""

from __future__ import annotations

import csv
import io
import json

import pytest

from ogrpo.bench.harness import CSV_FIELDS
from ogrpo.bench.rollout import RolloutShape, Workload, bench_ratios, kv_cache_budget, run_rollout_bench
from ogrpo.errors import OgrpoError

TINY = RolloutShape(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256, vocab=512)


def test_shapes_match_the_reference_models():
    # these shapes are named by parameter count (tied embeddings, Qwen2 biases on q/k/v)
    assert round(RolloutShape(512, 8, 8, 2, 2048, 4096).params() / 1e6, 1) == 32.5
    assert round(RolloutShape(768, 12, 12, 4, 2048, 4096).params() / 1e6, 1) == 78.7


def test_bad_input_is_one_error(tmp_path):
    with pytest.raises(OgrpoError, match="unknown bench path"):
        run_rollout_bench(TINY, paths=["gpu"], csv_path=tmp_path / "r.csv", workdir=str(tmp_path))
    with pytest.raises(OgrpoError, match="divide"):
        run_rollout_bench(RolloutShape(100, 1, 3, 1, 64, 64), csv_path=tmp_path / "r.csv", workdir=str(tmp_path))
    assert not (tmp_path / "r.csv").exists()


def test_kv_budget_holds_the_whole_rollout_on_both_paths():
    shape = RolloutShape(768, 12, 12, 4, 2048, 4096)
    per_token = 2 * 12 * 4 * 64 * 4  # K and V, every layer, every KV head, fp32
    budget = kv_cache_budget(shape, 4, seqs=64, max_model_len=160)
    assert budget >= 64 * 160 * per_token and budget % per_token == 0
    assert kv_cache_budget(shape, 2, seqs=64, max_model_len=160) == budget // 2
    w = Workload(model_dir="m", dtype="float32", prompts=[[1]], generations=1, new_tokens=1, repeats=1,
                 gpu_memory_utilization=None, enforce_eager=True, workdir=".", kv_cache_bytes=budget)
    assert w.memory_args() == {"kv_cache_memory_bytes": budget}
    w.kv_cache_bytes, w.gpu_memory_utilization = None, 0.3
    assert w.memory_args() == {"gpu_memory_utilization": 0.3}


def _read(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_hf_path_writes_tagged_rows(tmp_path):
    out = io.StringIO()
    run_rollout_bench(TINY, prompts=2, generations=2, new_tokens=4, prompt_tokens=4, repeats=1, paths=["hf"],
                      csv_path=tmp_path / "r.csv", workdir=str(tmp_path), out=out)
    rows = _read(tmp_path / "r.csv")
    assert list(rows[0].keys()) == CSV_FIELDS
    assert [r["path"] for r in rows] == ["hf"] and rows[0]["metric"] == "tokens_per_s"
    assert float(rows[0]["value"]) > 0 and rows[0]["device"] and rows[0]["torch"] and rows[0]["trl"]
    assert json.loads(rows[0]["params"])["hidden"] == 128
    assert "HF generate" in out.getvalue()


def test_ratios_put_the_bar_against_the_faster_raw_mode():
    tps = {"hf": 100.0, "vllm": 200.0, "vllm_inproc": 400.0, "server": 380.0}
    r = dict(bench_ratios(tps))
    assert r["server_vs_raw_best"] == pytest.approx(0.95)
    assert r["server_vs_vllm"] == pytest.approx(1.9) and r["server_vs_vllm_inproc"] == pytest.approx(0.95)
    assert r["vllm_vs_hf"] == pytest.approx(2.0) and r["server_vs_hf"] == pytest.approx(3.8)
    # one raw mode measured: it is the baseline; none: no bar
    assert dict(bench_ratios({"vllm": 200.0, "server": 100.0}))["server_vs_raw_best"] == pytest.approx(0.5)
    assert "server_vs_raw_best" not in dict(bench_ratios({"hf": 1.0, "server": 2.0}))


@pytest.mark.integration
@pytest.mark.slow
def test_all_paths_and_ratios(tmp_path):
    out = io.StringIO()
    run_rollout_bench(TINY, prompts=2, generations=2, new_tokens=8, prompt_tokens=4, repeats=1,
                      csv_path=tmp_path / "r.csv", workdir=str(tmp_path), enforce_eager=True, out=out)
    rows = _read(tmp_path / "r.csv")
    paths = ["hf", "vllm", "vllm_inproc", "server"]
    assert [(r["path"], r["metric"]) for r in rows[:4]] == [(p, "tokens_per_s") for p in paths]
    tps = {r["path"]: float(r["value"]) for r in rows[:4]}
    ratio = {r["path"]: float(r["value"]) for r in rows[4:]}
    assert all(r["metric"] == "ratio" for r in rows[4:])
    assert ratio["server_vs_raw_best"] == pytest.approx(tps["server"] / max(tps["vllm"], tps["vllm_inproc"]),
                                                        rel=1e-4)
    assert "server_vs_raw_best" in out.getvalue() and "bar: >= 0.95" in out.getvalue()
    # both vLLM paths got the explicit KV budget, not a memory share
    assert json.loads(rows[0]["params"])["kv_cache_bytes"] == kv_cache_budget(TINY, 4, 4, 12)
    assert "Explicitly set" in (tmp_path / "run-128-2-512-fp32" / "server.log").read_text()
