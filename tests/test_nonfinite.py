"""The trainer stops at the step whose loss becomes inf/NaN, with one line naming the step and the precision.

Both tests run TRL's GRPOTrainer on the tiny model with its final norm returning +inf in the policy forward of a
known step (what an fp16 overflow does to the logits): once through `ogrpo train` (exit code, one line, manifest), once
in process with fp16 weights (the precision the message names). A reward cannot force it: TRL sanitizes NaN/inf
advantages (nan_to_num).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("nonfinite_train_script.py")


def test_cli_exits_1_naming_the_step_when_the_loss_becomes_nan(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "train", "--config", "tiny", "--output-dir", str(out), "--set", "max_steps=4",
         "--set", "save_strategy=no", "--set", "per_device_train_batch_size=8", "--set", "num_generations=4",
         "--set", "max_completion_length=6"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600, env={**os.environ, "OGRPO_TEST_INF_STEP": "2"})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-4000:]
    errors = re.findall(r"error: [^\r\n]*", proc.stderr)  # after tqdm's carriage return, not at a line start
    assert errors and errors[-1].startswith("error: step 2: loss is nan under fp32 (the per-token log-probs were "
                                            "already non-finite"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["error"].startswith("step 2: loss is nan")
    # step 1 ran and was logged with a finite loss; nothing of step 2 reached the metrics
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r.get("step") for r in rows if "loss" in r] == [1], rows


def test_fp16_logits_overflow_names_the_step_precision_and_logits(tmp_path):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from ogrpo import tiny
    from ogrpo.trainer.grpo import OgrpoGRPOTrainer
    from ogrpo.trainer.guard import NonFiniteError

    path = str(tiny.ensure_tiny_model())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)
    tok = AutoTokenizer.from_pretrained(path)
    forwards = []

    def overflow_in_training(module, inputs, output):
        # generation and scoring run without grad; the policy forward of the loss runs with it. The third such
        # forward is step 3's: its logits overflow the way fp16 ones do (+inf), which makes log_softmax NaN.
        if torch.is_grad_enabled():
            forwards.append(1)
            if len(forwards) >= 3:
                output = output.clone()
                output[..., 0] = float("inf")
                return output
        return output

    model.model.norm.register_forward_hook(overflow_in_training)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, max_steps=5,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=4, beta=0.0,
                      report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0)
    data = Dataset.from_dict({"prompt": ["Write the letter a:", "Write the letter b:"] * 8})
    trainer = OgrpoGRPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                               reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions])
    trainer.guard_nonfinite()
    with pytest.raises(NonFiniteError) as err:
        trainer.train()
    msg = str(err.value)
    assert msg.startswith("step 3: loss is nan under fp16 (the per-token log-probs were already non-finite"), msg
    assert "65504" in msg and err.value.exit_code == 1
    assert trainer.state.global_step == 2
