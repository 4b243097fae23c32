"""`ogrpo bench kernels` at tiny sizes: every path runs, the table and CSV rows carry finite times, peaks and
ratios, and the three log-prob paths agree on what they computed (their timings are the bench's to report,
never asserted here)."""

from __future__ import annotations

import csv
import io
import json
import math
import subprocess
import sys

import pytest

from ogrpo.bench import kernels as bench
from ogrpo.bench.harness import CSV_FIELDS
from ogrpo.errors import OgrpoError


def test_rounds_are_summarized_by_their_medians():
    runs = [{"path": "ogrpo", "fwd_s": f, "bwd_s": b, "total_s": f + b, "peak_mib": m, "baseline_slack_mib": 0.0,
             "impl": "compiled", "checksum": 1.0} for f, b, m in ((1.0, 2.0, 100), (9.0, 9.0, 101), (1.2, 2.2, 99))]
    got = bench._median_of_rounds(runs)
    assert (got["fwd_s"], got["bwd_s"], got["peak_mib"]) == (1.2, 2.2, 100) and got["total_s"] == pytest.approx(3.4)
    # a round that failed is the path's result: an error is never averaged away
    assert bench._median_of_rounds(runs[:1] + [{"path": "ogrpo", "error": "killed"}])["error"] == "killed"


@pytest.mark.slow
def test_tiny_bench_rows_tables_and_ratios(tmp_path):
    out = io.StringIO()
    csv_path = tmp_path / "kernels.csv"
    # odd sizes: 37 tokens, V=1001 (not a multiple of any chunk), 3 rows of logits
    results = bench.run_kernels_bench(tokens=(37,), hidden=40, vocab=1001, batch=3, history=5, repeats=1,
                                      csv_path=csv_path, out=out)
    text = out.getvalue()
    logprobs = {r["path"]: r for r in results if r["part"] == "logprobs"}
    assert sorted(logprobs) == sorted(bench.LOGPROB_PATHS)
    for path, r in logprobs.items():
        assert "error" not in r, (path, r)
        for key in ("fwd_s", "bwd_s", "total_s", "peak_mib", "work_mib", "time_ratio", "peak_ratio"):
            assert math.isfinite(r[key]) and r[key] >= 0, (path, key, r[key])
        assert bench.PATH_NAMES[path] in text
    assert logprobs["trl_1_9_2"]["time_ratio"] == 1.0 and logprobs["trl_1_9_2"]["peak_ratio"] == 1.0
    # same inputs (same seed) in each child: the summed log-probs + entropies must agree across paths
    ref = logprobs["trl_1_9_2"]["checksum"]
    for r in logprobs.values():
        assert r["checksum"] == pytest.approx(ref, rel=1e-4, abs=1e-2)
    assert "target N=37: peak" in text and "ChunkedLogProbFunction" in text

    samples = [r for r in results if r["part"] == "sample"]
    assert {(r["case"], r["path"]) for r in samples} == {(c.name, p) for c in bench.SAMPLE_CASES
                                                          for p in bench.SAMPLE_PATHS}
    for r in samples:
        assert "error" not in r, r
        assert r["seconds"] > 0 and math.isfinite(r["speedup"]) and r["speedup"] > 0
    assert text.count("x faster: ") == len(bench.SAMPLE_CASES)

    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == CSV_FIELDS
    got = {(r["bench"], r["path"], r["metric"]) for r in rows}
    for path in bench.LOGPROB_PATHS:
        for metric in ("fwd_s", "bwd_s", "total_s", "peak_mib", "time_ratio", "peak_ratio"):
            assert ("kernels.logprobs", path, metric) in got
    for path in bench.SAMPLE_PATHS:
        assert ("kernels.sample", path, "speedup") in got
    for r in rows:
        assert math.isfinite(float(r["value"])) and r["device"] and r["torch"] and r["trl"]
    assert json.loads(rows[0]["params"])["vocab"] == 1001


def test_trl_copies_match_the_installed_trl():
    # the copies stand for TRL 1.9.2's functions; TRL 1.16's own (CPU branch) must compute the same numbers
    import torch
    from trl.trainer import utils as trl_utils

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 9, 301, generator=gen)
    index = torch.randint(0, 301, (2, 9), generator=gen)
    assert torch.allclose(bench.selective_log_softmax(logits, index), trl_utils.selective_log_softmax(logits, index))
    assert torch.allclose(bench.entropy_from_logits(logits), trl_utils.entropy_from_logits(logits))


def test_bad_input_is_one_error(tmp_path):
    with pytest.raises(OgrpoError, match="unknown dtype"):
        bench.run_kernels_bench(dtype="fp8", csv_path=tmp_path / "k.csv")
    with pytest.raises(OgrpoError, match="unknown bench part/path gpu"):
        bench.run_kernels_bench(paths=("gpu",), csv_path=tmp_path / "k.csv")
    assert not (tmp_path / "k.csv").exists()


def test_cli_registers_the_command(run_cli):
    proc = run_cli("bench", "kernels", "--tokens", "1,x", check_rc=2)
    assert "--tokens takes a comma list of integers" in proc.stderr and "Traceback" not in proc.stderr
    assert "Our kernels vs TRL" in run_cli("bench", "--help", check_rc=0).stdout


def test_missing_stack_is_one_line(tmp_path):
    import subprocess
    import sys

    code = ("import sys\n"
            "class _Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in {'torch', 'trl'}:\n"
            "            raise ModuleNotFoundError(name, name=name)\n"
            "sys.meta_path.insert(0, _Block())\n"
            f"sys.argv = ['ogrpo', 'bench', 'kernels', '--csv', {str(tmp_path / 'k.csv')!r}]\n"
            "from ogrpo.cli import main\n"
            "main()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "needs torch, which is not installed here: pip install 'ogrpo[train]'" in proc.stderr
    assert not (tmp_path / "k.csv").exists()


@pytest.mark.slow
def test_cuda_bench_without_cuda_is_one_line_exit_2():
    proc = subprocess.run([sys.executable, "-m", "ogrpo.bench.kernels_cuda", "--tokens", "64"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "error: no CUDA device here (torch.cuda.is_available() is False)"], proc.stderr


@pytest.mark.gpu
def test_cuda_bench_rows_and_ratios(tmp_path):
    out = tmp_path / "k.csv"
    proc = subprocess.run([sys.executable, "-m", "ogrpo.bench.kernels_cuda", "--tokens", "256", "--vocab", "4099",
                           "--hidden", "64", "--repeats", "2", "--csv", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    by = {(r["path"], r["metric"]): float(r["value"]) for r in rows}
    assert by[("trl_1_9_2", "time_ratio")] == 1.0 and by[("ogrpo", "ms")] > 0
    assert by[("ogrpo", "time_ratio")] == pytest.approx(by[("ogrpo", "ms")] / by[("trl_1_9_2", "ms")])
