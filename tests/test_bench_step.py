"""`ogrpo bench step` on a tiny shape: both paths run the same GRPO steps and the output carries per-stage
seconds, peak memory and ratios (never asserted as timings: performance is what the benchmark reports)."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest

from ogrpo.bench.rollout import RolloutShape
from ogrpo.bench.step import (SPLIT_COLUMNS, SPLIT_PATHS, STAGES, preset, ratios, run_step_bench, split_ratios,
                              split_table, stop_tokens, summarize, token_reward)
from ogrpo.errors import OgrpoError
from ogrpo.launch.procs import mentioning

TINY = RolloutShape(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256, vocab=512)


def test_reward_and_summary():
    assert token_reward(["ab ei", "", "xyz", "A!o"]) == [0.75, 0.0, 0.0, 1.0]
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


def test_rounds_pool_their_steps_each_without_its_warm_up():
    from ogrpo.bench.step import pooled

    runs = [[{"step_s": 50.0, "peak_mem_gib": 3.0}, {"step_s": 1.0}, {"step_s": 2.0}],
            [{"step_s": 40.0, "peak_mem_gib": 1.0}, {"step_s": 9.0}, {"step_s": 10.0}]]
    out = pooled(runs)  # median of 1, 2, 9, 10; the warm-ups count only towards the peak
    assert out["step"] == 5.5 and out["peak_gib"] == 3.0


def test_bad_input_is_one_error(tmp_path):
    with pytest.raises(OgrpoError, match="at least 2"):
        run_step_bench(TINY, steps=1, workdir=str(tmp_path))
    with pytest.raises(OgrpoError, match="fp32 or bf16"):
        run_step_bench(TINY, dtype="int8", workdir=str(tmp_path))
    with pytest.raises(OgrpoError, match="--rounds must be at least 1"):
        run_step_bench(TINY, rounds=0, workdir=str(tmp_path))


@pytest.mark.slow
def test_both_paths_run_and_report(tmp_path):
    out = io.StringIO()
    # the variable shape's end tokens (1 in 3 ids here): HF generate (plain TRL) and vLLM (O-GRPO's rollouts)
    # both stop at them, read from the model's generation config, and TRL cuts each completion there
    # two rounds: each path runs twice, the paths interleaved, each round's jobs in a directory of their own
    res = run_step_bench(TINY, steps=2, prompts=2, generations=4, new_tokens=8, csv_path=str(tmp_path / "s.csv"),
                         png_path=str(tmp_path / "s.png"), workdir=str(tmp_path / "w"), out=out, mean_share=0.35,
                         rounds=2)
    for path in ("trl", "ogrpo"):
        assert all(res["results"][path][s] > 0 for s in ("generation", "train", "step")), res
        rounds = res["results"][path]["round_steps"]
        assert len(rounds) == 2 and min(rounds) <= res["results"][path]["step"] <= max(rounds), res["results"][path]
        for k in (1, 2):
            assert len((tmp_path / "w" / f"round-{k}" / f"{path}-profile.jsonl").read_text().splitlines()) == 2
        assert res["results"][path]["peak_gib"] > 0
        assert 1 <= res["results"][path]["completion_len"] < 6, res["results"][path]  # expected 2.9 of 8
    assert set(res["ratios"]) >= {"step_speedup", "generation_speedup", "memory_ratio"}
    assert all(math.isfinite(v) and v > 0 for v in res["ratios"].values())
    text = out.getvalue()
    assert "step_speedup:" in text and "peak GiB" in text
    assert "running ogrpo (round 2 of 2)" in text and "of 2 rounds, the paths interleaved" in text
    assert "each round's median step s: trl " in text
    assert "(end tokens 1 in 3: expected mean length 3)" in text and "trl: mean completion" in text
    rows = list(csv.DictReader(open(tmp_path / "s.csv")))
    assert {r["path"] for r in rows} == {"trl", "ogrpo", "ratio"}
    assert {r["metric"] for r in rows if r["path"] == "trl"} == {f"{s}_s" for s in STAGES} | {
        "peak_mem", "logprobs_per_pass_s", "completion_len", "pad_share_score", "pad_share_loss"}
    # every path reports the share of each kind of log-prob pass that went to padding
    for kind in ("score", "loss"):
        shares = [res["results"][path][f"pad_share_{kind}"] for path in ("trl", "ogrpo")]
        assert all(0 <= v < 1 for v in shares) and "pad loss" in text, shares
    # beta > 0: both paths score the reference model; O-GRPO's vLLM rollouts take the old policy's log-probs
    # (for the importance-sampling correction) from the loss forward, so no pass more than plain TRL's
    assert res["results"]["trl"]["logprob_passes"] >= 1
    assert res["results"]["ogrpo"]["logprob_passes"] == res["results"]["trl"]["logprob_passes"]
    assert (tmp_path / "s.png").stat().st_size > 1000


# ---- the split placement ---------------------------------------------------------------------------------------

def _split_row(step_s, server_busy, trainer_wait, gen=0.0):
    return {"step_s": step_s, "server_busy_s": server_busy, "trainer_wait_s": trainer_wait, "generation_s": gen,
            "completion_tokens": 30, "completions": 10,
            "idle_share": {"server": round(1 - server_busy / step_s, 4), "trainer": round(trainer_wait / step_s, 4)}}


def test_split_lanes_and_ratios_come_from_the_measured_rows():
    warm = _split_row(50.0, 1.0, 1.0)  # the warm-up step: left out
    off = summarize([warm, _split_row(10.0, 4.0, 4.0, gen=4.5), _split_row(12.0, 5.0, 5.0, gen=5.5),
                     _split_row(11.0, 4.0, 4.0, gen=5.0)])
    # trainer busy = step - wait: 6, 7, 7; ideal = max(server, trainer) per step: 6, 7, 7
    assert (off["server_busy"], off["trainer_busy"], off["ideal_step"]) == (4.0, 7.0, 7.0)
    # idle shares per step: trainer 4/10, 5/12, 4/11 -> median 0.4
    assert off["bottleneck"] == "trainer" and off["bottleneck_idle"] == off["trainer_idle"] == 0.4
    assert off["completion_len"] == 3.0
    one = summarize([warm, _split_row(8.0, 7.5, 0.5), _split_row(8.0, 7.6, 0.4)])
    assert one["bottleneck"] == "server" and one["ideal_step"] == pytest.approx(7.55)
    trl = summarize([warm, _split_row(12.0, 5.0, 5.0)])
    results = {"split-trl": trl, "split-off": off, "split-one-step": one}
    r = split_ratios(results)
    assert r["one-step_step_over_off"] == pytest.approx(8.0 / 11.0)
    assert r["one-step_step_over_trl"] == pytest.approx(8.0 / 12.0) and r["off_step_over_trl"] == pytest.approx(11 / 12)
    assert r["trl_step_over_off"] == pytest.approx(12.0 / 11.0)
    # step over ideal per step, then the median: one-step 8/7.5, 8/7.6; off 10/6, 12/7, 11/7
    assert r["one-step_step_over_ideal"] == pytest.approx((8.0 / 7.5 + 8.0 / 7.6) / 2)
    assert r["off_step_over_ideal"] == pytest.approx(10 / 6)
    # a ratio of the medians would pair one step's time with another's ideal
    assert r["off_step_over_ideal"] != pytest.approx(off["step"] / off["ideal_step"])
    assert r["off_generation_share"] == pytest.approx(5.0 / 11.0)
    table = split_table(results, r, ("split-trl", "split-off", "split-one-step")).splitlines()
    assert all(c in table[0] for c in SPLIT_COLUMNS)
    one_row = next(line for line in table if line.startswith("split-one-step")).split()
    assert one_row[1:5] == ["8.000", "7.550", "7.550", "7.550"] and "0.727" in one_row and "0.667" in one_row


def test_shape_presets():
    shape, batch = preset("generation-heavy")
    assert batch["tokens"] == 256 and shape.params() > 0 and batch["mean_share"] is None
    shape, batch = preset("generation-heavy", tokens=16, hidden=128)
    assert batch["tokens"] == 16 and shape.hidden == 128
    assert preset("default")[1] == {"prompts": 4, "generations": 8, "tokens": 64, "mean_share": None}
    with pytest.raises(OgrpoError, match="generation-heavy"):
        preset("huge")
    assert stop_tokens(512, 4) == list(range(0, 512, 4))


@pytest.mark.slow
def test_split_placement_runs_every_path_and_reports(tmp_path):
    """Plain TRL's server mode and the three overlap modes on 2xcpu, a tiny shape: every row and column is there,
    the ratios are the measured step times' (also as written to the CSV), completions end early (EOS allowed)
    and no server or trainer outlives the bench."""
    out = io.StringIO()
    work = tmp_path / "w"
    res = run_step_bench(TINY, steps=2, prompts=2, generations=2, new_tokens=8, csv_path=str(tmp_path / "s.csv"),
                         png_path=str(tmp_path / "s.png"), workdir=str(work), out=out, placement="split")
    results, r = res["results"], res["ratios"]
    assert set(results) == set(SPLIT_PATHS)
    for path, v in results.items():
        assert v["step"] > 0 and v["trainer_busy"] > 0, (path, v)
        # lossless and one-step send the next request as the optimizer step ends: at this size its generation
        # can finish inside the previous step, so a step of theirs may have had no server work of its own
        assert v["server_busy"] > 0 or path in ("split-lossless", "split-one-step"), (path, v)
        assert v["ideal_step"] == pytest.approx(max(v["server_busy"], v["trainer_busy"]), rel=0.5)
        assert 0 <= v["bottleneck_idle"] <= 1
        assert 1 <= v["completion_len"] < 8, (path, v)  # end tokens 1 in 4: lengths vary under the cap
    for mode in ("lossless", "one-step", "trl"):
        assert r[f"{mode}_step_over_off"] == pytest.approx(results[f"split-{mode}"]["step"]
                                                           / results["split-off"]["step"])
    assert r["one-step_step_over_trl"] == pytest.approx(results["split-one-step"]["step"]
                                                        / results["split-trl"]["step"])
    text = out.getvalue()
    assert all(c in text for c in SPLIT_COLUMNS) and "one-step_step_over_trl:" in text
    rows = list(csv.DictReader(open(tmp_path / "s.csv")))
    step = {row["path"]: float(row["value"]) for row in rows if row["metric"] == "step_s"}
    ratio = {row["metric"]: float(row["value"]) for row in rows if row["path"] == "ratio"}
    assert ratio["lossless_step_over_off"] == pytest.approx(step["split-lossless"] / step["split-off"], rel=1e-4)
    assert {row["metric"] for row in rows if row["path"] == "split-trl"} >= {"server_busy", "trainer_busy",
                                                                             "ideal_step", "bottleneck_idle"}
    # the anchor on the same split as O-GRPO's jobs: its server and its trainer each on their own cores
    cores = json.loads((work / "split-trl-cores.json").read_text())
    assert cores["server"] and cores["trainer"] and not set(cores["server"]) & set(cores["trainer"]), cores
    # O-GRPO's server compiled its model, as the bench's recipe asks (TRL's compiles by default), and each push
    # reached the compiled model: the server's log-probs are the trainer's after every update
    run = work / "split-off-job" / "run"
    plan = json.loads((run / "manifest.json").read_text())["plan"]
    assert plan["vllm"]["args"]["enforce_eager"] is False
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(rows) == 2 and all(r["sampling/sampling_logp_difference/mean"] < 1e-4 for r in rows), rows
    assert mentioning(str(work)) == []


@pytest.mark.slow
def test_ranks_placement_compares_trls_split_with_balanced_ranks(tmp_path):
    """Two trainer processes (DDP) on 2xcpu, TRL's split of each batch against ranks balanced by tokens: the same
    samples and losses (the balanced run is TRL's otherwise), the stage ratios are the measured ones, and the
    spread of the ranks' tokens is reported from the run's manifest."""
    from ogrpo.bench.step import RANK_PATHS

    out = io.StringIO()
    work = tmp_path / "w"
    res = run_step_bench(TINY, steps=2, prompts=2, generations=4, new_tokens=24, mean_share=0.3,
                         csv_path=str(tmp_path / "s.csv"), png_path=None, workdir=str(work), out=out,
                         placement="ranks")
    results, r = res["results"], res["ratios"]
    assert set(results) == set(RANK_PATHS)
    assert r["train_speedup"] == pytest.approx(results["ranks-trl-split"]["train"] / results["ranks-balanced"]["train"])
    assert results["ranks-trl-split"]["completion_len"] == results["ranks-balanced"]["completion_len"] < 24
    balance = json.loads((work / "ranks-balanced-balance.json").read_text())
    assert balance["on"] is True and balance["batches"] == 2, balance
    assert json.loads((work / "ranks-trl-split-balance.json").read_text())["on"] is False
    assert f"TRL's split {balance['spread_before']}, balanced {balance['spread_after']}" in out.getvalue()
    assert mentioning(str(work)) == []


def test_bench_models_read_their_prompts_as_the_tokens_they_were_made_of(tmp_path):
    """The bench's random models: the tokenizer the trainer and the server load (transformers rebuilds a Qwen2
    one from the files) has one id per vocabulary entry, and each prompt reads back as exactly its length."""
    from transformers import AutoTokenizer

    from ogrpo.bench.rollout import build_model, text_prompts

    model = build_model(TINY, "float32", tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(str(model))
    assert len(tok) == TINY.vocab and tok.eos_token_id == 0
    prompts = text_prompts(model, 8, 32, seed=3)
    assert len(set(prompts)) == 8
    assert all(len(tok(p)["input_ids"]) == 32 for p in prompts)
    assert all(tok.decode([i]) for i in range(2, TINY.vocab))  # every sampled id detokenizes
    assert build_model(TINY, "float32", tmp_path / "m") == model  # built once, then reused


def test_variable_shape_ends_completions_at_the_rate_of_its_mean_share(tmp_path):
    """`--shape variable`: end tokens at the rate that makes the mean completion about 0.35 of the cap (a random
    model's next token is near uniform), listed in the model's generation config, where HF generate, vLLM and
    TRL's completion cut (its `eos_token_ids`) all read them."""
    from transformers import GenerationConfig

    from ogrpo.bench.rollout import build_model
    from ogrpo.bench.step import end_rate, expected_length, stop_every_for

    shape, batch = preset("variable")
    assert batch["mean_share"] == 0.35 and batch["tokens"] == 256 and batch["prompts"] * batch["generations"] == 32
    every = stop_every_for(batch["tokens"], shape.vocab, batch["mean_share"])
    rate = end_rate(shape.vocab, every)
    assert expected_length(batch["tokens"], rate) / batch["tokens"] == pytest.approx(0.35, abs=0.02)
    # a few completions of a step reach the cap: those set the padding of every pass
    assert 0.02 < (1 - rate) ** batch["tokens"] < 0.15
    # the formula against draws: mean of min(geometric, cap) over 20,000 completions
    import random

    rng, cap = random.Random(0), batch["tokens"]
    draws = [next((k for k in range(1, cap + 1) if rng.random() < rate), cap) for _ in range(20000)]
    assert sum(draws) / len(draws) == pytest.approx(expected_length(cap, rate), rel=0.03)
    ends = tuple(stop_tokens(TINY.vocab, 7))
    model = build_model(TINY, "float32", tmp_path / "m", end_ids=ends)
    assert GenerationConfig.from_pretrained(str(model)).eos_token_id == list(ends)  # EOS (id 0) first, once
    plain = build_model(TINY, "float32", tmp_path / "p")
    assert GenerationConfig.from_pretrained(str(plain)).eos_token_id == 0
    # a directory built with other end tokens is not taken for this model: it is built again
    assert build_model(TINY, "float32", tmp_path / "p", end_ids=ends) == plain
    assert GenerationConfig.from_pretrained(str(plain)).eos_token_id == list(ends)
    with pytest.raises(OgrpoError, match="between 0 and 1"):
        stop_every_for(256, 1024, 1.5)
