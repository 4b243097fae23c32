"""`use_peft` and `lora_*` (TRL's ModelConfig fields) -> the peft `LoraConfig` that GRPOTrainer gets.

TRL's own scripts build it with `trl.trainer.utils.get_peft_config`; `peft_config()` maps the same fields the
same way (tests/test_lora.py compares the two), so a recipe means here what it means under `trl grpo`. The pure
half the planner reads (`lora_spec`: rank, targets, the base's dtype) is ogrpo/planner/lora.py.
"""

from __future__ import annotations

from ogrpo.errors import OgrpoError
from ogrpo.planner.lora import DEFAULTS, lora_spec


def peft_config(trl: dict):
    """The `peft.LoraConfig` for GRPOTrainer(peft_config=...), or None without `use_peft`."""
    if not trl.get("use_peft"):
        return None
    lora_spec(trl)  # one-line errors for bad values before peft sees them
    try:
        from peft import LoraConfig
    except ImportError:
        raise OgrpoError("use_peft: true needs the peft package: pip install peft==0.21.2") from None
    get = {k: (trl[k] if trl.get(k) is not None else v) for k, v in DEFAULTS.items()}
    extra = {}
    if get["lora_target_parameters"] is not None:  # peft >= 0.17 only, so passed only when asked for (as TRL)
        extra["target_parameters"] = get["lora_target_parameters"]
    try:
        return LoraConfig(task_type=get["lora_task_type"], r=get["lora_r"], target_modules=get["lora_target_modules"],
                          lora_alpha=get["lora_alpha"], lora_dropout=get["lora_dropout"], bias="none",
                          use_rslora=bool(get["use_rslora"]), use_dora=bool(get["use_dora"]),
                          modules_to_save=get["lora_modules_to_save"], **extra)
    except (ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OgrpoError(f"use_peft: peft rejected the LoRA settings: {first}") from None
