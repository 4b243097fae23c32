"""`ogrpo bench overlap`: reward of off vs one-step at fixed steps and wall-clock times, mean ± std over seeds,
the 2-std verdict, and the CSV/PNG it writes (the run itself at the smallest size: one seed each, two steps)."""

from __future__ import annotations

import csv
import io
import math

import pytest

from ogrpo.bench.overlap import at_step, at_time, run_overlap_bench, summarize
from ogrpo.errors import OgrpoError
from ogrpo.launch.procs import mentioning


def test_summary_from_the_curves():
    # (step, seconds of training at its end, reward)
    off = [[(1, 1.0, 0.2), (2, 2.0, 0.4)], [(1, 1.5, 0.4), (2, 3.0, 0.6)]]
    one = [[(1, 0.5, 0.3), (2, 1.0, 0.5)], [(1, 0.6, 0.9), (2, 1.2, 1.5)]]
    assert at_step(off[0], 2) == 0.4 and at_step(off[0], 3) is None
    assert at_time(off[1], 1.4) is None and at_time(off[1], 1.5) == 0.4 and at_time(off[1], 9) == 0.6
    s = summarize({"off": off, "one-step": one}, [1, 2], [1.5])
    (m, sd), _ = s["steps"]["off"]
    assert m == pytest.approx(0.3) and sd == pytest.approx(math.sqrt(0.02))
    # step 1: |0.6 - 0.3| = 0.3 > 2 x 0.141; step 2: |1.0 - 0.5| = 0.5 > 0.283: not within
    assert s["within"] == [False, False]
    close = summarize({"off": off, "one-step": [[(1, 0.5, 0.3), (2, 1.0, 0.5)]] * 2}, [1, 2], [1.5])
    assert close["within"] == [True, True]
    # at 1.5 s: off's runs have rewards 0.2 and 0.4, one-step's the last step each finished (0.5, 1.5)
    assert s["times"]["off"][0][0] == pytest.approx(0.3) and s["times"]["one-step"][0][0] == pytest.approx(1.0)
    single = summarize({"off": off[:1], "one-step": one[:1]}, [1], [1.0])
    assert single["within"] == [None] and math.isnan(single["steps"]["off"][0][1])


def test_bad_sizes_are_one_error(tmp_path):
    with pytest.raises(OgrpoError, match="--seeds"):
        run_overlap_bench(seeds=0, workdir=str(tmp_path))
    with pytest.raises(OgrpoError, match="--steps"):
        run_overlap_bench(steps=1, workdir=str(tmp_path))


@pytest.mark.slow
def test_runs_both_modes_and_writes_table_csv_png(tmp_path):
    out = io.StringIO()
    res = run_overlap_bench(seeds=1, steps=2, workdir=str(tmp_path / "w"), csv_path=str(tmp_path / "o.csv"),
                            png_path=str(tmp_path / "o.png"), out=out)
    text = out.getvalue()
    assert "at step" in text and "at time s" in text and "n/a (needs 2+ seeds)" in text
    rows = list(csv.DictReader(open(tmp_path / "o.csv")))
    assert {(r["mode"], r["step"]) for r in rows} == {(m, s) for m in ("off", "one-step") for s in ("1", "2")}
    assert all(-1 <= float(r["reward"]) <= 3 and float(r["time_s"]) > 0 for r in rows)
    # the table's numbers are the curves' (one seed: the value itself)
    for mode in ("off", "one-step"):
        last = next(float(r["reward"]) for r in rows if r["mode"] == mode and r["step"] == "2")
        assert res["steps"][mode][-1][0] == pytest.approx(last)
        assert f"{last:.3f}" in text
    assert res["at_steps"] == [1, 2] and res["within"] == [None, None]
    assert (tmp_path / "o.png").stat().st_size > 1000
    assert mentioning(str(tmp_path / "w")) == []  # no server or trainer outlives its run
