"""`python tests/train_report_vllm.py FIRST REPORT ARGS...`: `python -m ogrpo.train ARGS`, after importing vLLM
first when FIRST is "vllm"; writes to REPORT (JSON) whether the process had vLLM loaded at its end. The trainer
entry hides vLLM from TRL's imports where the run uses none of vLLM's modules (ogrpo.trainer.assembly)."""

import json
import runpy
import sys

first, report = sys.argv.pop(1), sys.argv.pop(1)
if first == "vllm":
    import vllm  # noqa: F401
sys.argv[0] = "ogrpo.train"
try:
    runpy.run_module("ogrpo.train", run_name="__main__", alter_sys=True)
finally:
    with open(report, "w") as f:
        f.write(json.dumps("vllm" in sys.modules))
