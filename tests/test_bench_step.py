"""`ogrpo bench step` on a tiny shape: both paths run the same GRPO steps and the output carries per-stage
seconds, peak memory and ratios (never asserted as timings: performance is what the benchmark reports)."""

from __future__ import annotations

import csv
import io
import math

import pytest

from ogrpo.bench.rollout import RolloutShape
from ogrpo.bench.step import STAGES, ratios, run_step_bench, summarize, token_reward
from ogrpo.errors import OgrpoError

TINY = RolloutShape(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256, vocab=512)


def test_reward_and_summary():
    assert token_reward(["t2 t3 t4 t5", "", "t1"]) == [0.5, 0.0, 0.0]
    rows = [{"generation_s": 9.0, "step_s": 10.0, "peak_mem_gib": 1.0, "tokens_per_s": 1.0},
            {"generation_s": 1.0, "step_s": 2.0, "peak_mem_gib": 2.0, "tokens_per_s": 5.0},
            {"generation_s": 3.0, "step_s": 4.0, "peak_mem_gib": 1.5, "tokens_per_s": 7.0}]
    s = summarize(rows)  # the warm-up step is left out of the medians, not out of the peak
    assert s["generation"] == 2.0 and s["step"] == 3.0 and s["peak_gib"] == 2.0 and s["tokens_per_s"] == 6.0
    r = ratios({**s, "step": 6.0, "peak_gib": 4.0}, s)
    assert r["step_speedup"] == 2.0 and r["memory_ratio"] == 0.5
    # seconds per scoring pass: a path that scores twice a step (the old policy for vLLM's importance sampling,
    # and the reference) is compared per pass as well as per stage
    one = summarize([{"logprobs_s": 0.6, "logprob_passes": 1}] * 2)
    two = summarize([{"logprobs_s": 1.0, "logprob_passes": 2}] * 2)
    assert two["logprobs_per_pass"] == 0.5
    r = ratios(one, two)
    assert r["logprobs_speedup"] == pytest.approx(0.6) and r["logprobs_per_pass_speedup"] == pytest.approx(1.2)


def test_bad_input_is_one_error(tmp_path):
    with pytest.raises(OgrpoError, match="at least 2"):
        run_step_bench(TINY, steps=1, workdir=str(tmp_path))
    with pytest.raises(OgrpoError, match="fp32 or bf16"):
        run_step_bench(TINY, dtype="int8", workdir=str(tmp_path))


@pytest.mark.slow
def test_both_paths_run_and_report(tmp_path):
    out = io.StringIO()
    res = run_step_bench(TINY, steps=2, prompts=2, generations=4, new_tokens=8, csv_path=str(tmp_path / "s.csv"),
                         png_path=str(tmp_path / "s.png"), workdir=str(tmp_path / "w"), out=out)
    for path in ("trl", "ogrpo"):
        assert all(res["results"][path][s] > 0 for s in ("generation", "train", "step")), res
        assert res["results"][path]["peak_gib"] > 0
    assert set(res["ratios"]) >= {"step_speedup", "generation_speedup", "memory_ratio"}
    assert all(math.isfinite(v) and v > 0 for v in res["ratios"].values())
    text = out.getvalue()
    assert "step_speedup:" in text and "peak GiB" in text
    rows = list(csv.DictReader(open(tmp_path / "s.csv")))
    assert {r["path"] for r in rows} == {"trl", "ogrpo", "ratio"}
    assert {r["metric"] for r in rows if r["path"] == "trl"} == {f"{s}_s" for s in STAGES} | {
        "peak_mem", "logprobs_per_pass_s"}
    # beta > 0: both paths score the reference model; O-GRPO's vLLM rollouts score the old policy too
    assert res["results"]["trl"]["logprob_passes"] >= 1
    assert res["results"]["ogrpo"]["logprob_passes"] > res["results"]["trl"]["logprob_passes"]
    assert (tmp_path / "s.png").stat().st_size > 1000
