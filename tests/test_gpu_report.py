"""`make test-gpu`'s report (ogrpo/gpu_report.py) on this CPU machine: "no GPU" cleanly, and the runner's
outcomes, summaries and files with stand-in parts (the real parts need CUDA)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from ogrpo import gpu_report

JUNIT = ('<testsuites><testsuite tests="3" failures="0" errors="0" skipped="1"><testcase name="a"/>'
         '<testcase name="b"/><testcase name="c"><skipped/></testcase></testsuite></testsuites>')
CSV = ("timestamp,bench,case,path,metric,value,unit,device\n"
       "t,kernels,1k,ogrpo,time_ratio,0.75,x,NVIDIA A40\nt,kernels,1k,ogrpo,peak_mib,12,MiB,NVIDIA A40\n")


def test_without_cuda_it_reports_no_gpu_and_runs_nothing(tmp_path, capsys):
    if gpu_report.cuda_facts()["cuda"]:
        import pytest

        pytest.skip("this machine has CUDA: `make test-gpu` runs the real parts")
    assert gpu_report.main(["--out", str(tmp_path / "r")]) == 0
    report = json.loads((tmp_path / "r" / "gpu-report.json").read_text())
    assert report["status"] == "no GPU" and report["parts"] == [] and report["cuda"]["cuda"] is False
    assert "is_available() is False" in report["cuda"]["reason"]
    text = (tmp_path / "r" / "gpu-report.txt").read_text()
    assert "no GPU: nothing run" in text and text == capsys.readouterr().out.split("report: ")[0]
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["gpu-report.json", "gpu-report.txt"]


@pytest.mark.slow
def test_each_part_is_run_timed_and_summarised(tmp_path):
    write = "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text(sys.argv[2])"
    parts = (
        ("gpu tests", ["-c", write, "{out}/gpu-tests.xml", JUNIT]),
        ("selftest --gpu", ["-c", "import sys; print('FAIL flash_attn'); sys.exit(1)"]),
        ("bench kernels", ["-c", write, "{out}/kernels.csv", CSV]),
        ("bench step", ["-c", "import os, time; open(os.path.join(r'%s', 'pid'), 'w').write(str(os.getpid())); "
                              "time.sleep(60)" % tmp_path]),
    )
    facts = {"cuda": True, "devices": ["NVIDIA A40"], "torch": "2.10.0"}
    report = gpu_report.build_report(tmp_path / "r", timeout_s=5, parts=parts, facts=facts)
    by = {p["part"]: p for p in report["parts"]}
    assert [p["part"] for p in report["parts"]] == [n for n, _ in parts]
    assert by["gpu tests"]["outcome"] == "pass" and by["gpu tests"]["summary"] == "2 passed, 0 failed, 1 skipped"
    assert by["selftest --gpu"]["outcome"] == "fail" and by["selftest --gpu"]["rc"] == 1
    assert by["selftest --gpu"]["last_line"] == "FAIL flash_attn"
    assert by["bench kernels"]["summary"].startswith("2 rows on NVIDIA A40; 1k/ogrpo time_ratio 0.75")
    assert by["bench step"]["outcome"] == "timeout" and by["bench step"]["rc"] is None
    pid = int((tmp_path / "pid").read_text())
    assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]  # stopped
    assert report["status"] == "fail" and all(p["command"].startswith(sys.executable) for p in report["parts"])
    js, txt = gpu_report.write(report, tmp_path / "r")
    assert json.loads(js.read_text())["status"] == "fail"
    table = txt.read_text()
    assert "CUDA: yes  devices: NVIDIA A40" in table and "overall: fail" in table
    assert [ln.split()[0:2] for ln in table.splitlines()[4:8]] == [["gpu", "tests"], ["selftest", "--gpu"],
                                                                   ["bench", "kernels"], ["bench", "step"]]
