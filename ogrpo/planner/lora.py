"""The LoRA a run asks for, as the planner sizes it: `use_peft` and `lora_*` (TRL's ModelConfig fields) ->
`LoraSpec` (rank, targets, and the dtype the trainer loads the frozen base in, which is what the memory plan
counts). Pure: no peft, no torch. The trainer's peft `LoraConfig` is built from the same fields in
ogrpo/trainer/peft_config.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from ogrpo.dtypes import torch_name
from ogrpo.errors import OgrpoError

# TRL ModelConfig defaults (trl/trainer/model_config.py, TRL 1.16).
DEFAULTS = {"lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "lora_target_modules": None,
            "lora_target_parameters": None, "lora_modules_to_save": None, "lora_task_type": "CAUSAL_LM",
            "use_rslora": False, "use_dora": False}

# What peft targets when lora_target_modules is unset, by model_type (peft 0.21's
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, checked against the installed peft by a test). A type
# missing here makes peft refuse the config, so the plan says so before a job starts.
PEFT_DEFAULT_TARGETS = {t: ("q_proj", "v_proj") for t in (
    "llama", "mistral", "mixtral", "gemma", "gemma2", "gemma3_text", "qwen2", "qwen3")}

BASE_DTYPE_REASON = ("LoRA: the frozen base is never updated, so it needs no fp32 master copy; peft keeps the "
                     "adapters in fp32")


@dataclass(frozen=True)
class LoraSpec:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: tuple[str, ...] | str | None = None  # None: peft's default for the model type
    modules_to_save: tuple[str, ...] = ()
    use_dora: bool = False
    base_dtype: str = "float32"  # what the trainer loads the frozen base weights in

    def targets(self, model_type: str) -> tuple[str, ...] | str:
        """Target module names (or "all-linear") for a model type, as peft will resolve them."""
        if self.target_modules is not None:
            return self.target_modules
        if model_type not in PEFT_DEFAULT_TARGETS:
            raise OgrpoError(f"use_peft: peft has no default LoRA target modules for model type {model_type!r}; "
                             "set lora_target_modules (e.g. [q_proj, k_proj, v_proj, o_proj] or all-linear)")
        return PEFT_DEFAULT_TARGETS[model_type]


def _names(value, key: str) -> tuple[str, ...] | str | None:
    if value is None:
        return None
    if isinstance(value, str):
        # TRL's CLI passes one string; "all-linear" is peft's keyword for every linear layer but the head.
        return value if value == "all-linear" else (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise OgrpoError(f"{key}: give a list of module names (e.g. [q_proj, v_proj]) or all-linear, not {value!r}")


def user_dtype(trl: dict) -> str | None:
    """The base dtype the run config asks for (model_init_kwargs.dtype, dtype or torch_dtype), if any."""
    mik = trl.get("model_init_kwargs") if isinstance(trl.get("model_init_kwargs"), dict) else {}
    for value in (mik.get("dtype"), mik.get("torch_dtype"), trl.get("dtype"), trl.get("torch_dtype")):
        if value not in (None, ""):
            return str(value).replace("torch.", "")
    return None


def lora_spec(trl: dict, precision: str = "fp32") -> LoraSpec | None:
    """The LoRA the run asks for, or None without `use_peft`. `precision` is the plan's (fp32 on CPU).

    The frozen base is loaded in the plan's half precision (bf16, or fp16 where the GPU has no bf16): it is
    never updated, so it needs no fp32 master copy, while peft upcasts the adapters to fp32
    (autocast_adapter_dtype) so their small updates are not rounded away. A run config that asks for a
    float32 base gets it; one that asks for bf16 on a GPU without bf16 gets fp16 (the plan lists the change)."""
    if not trl.get("use_peft"):
        return None
    get = {k: (trl[k] if trl.get(k) is not None else v) for k, v in DEFAULTS.items()}
    problems = []
    for key in ("lora_r", "lora_alpha"):
        if isinstance(get[key], bool) or not isinstance(get[key], int) or get[key] <= 0:
            problems.append(f"{key}: a positive integer, not {get[key]!r}")
    dropout = get["lora_dropout"]
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        problems.append(f"lora_dropout: a number in [0, 1), not {dropout!r}")
    if problems:
        raise OgrpoError("use_peft: " + "; ".join(problems))
    dtype = "float32" if user_dtype(trl) == "float32" else (torch_name(precision) if precision else "float32")
    saved = _names(get["lora_modules_to_save"], "lora_modules_to_save") or ()
    return LoraSpec(r=get["lora_r"], alpha=get["lora_alpha"], dropout=float(dropout),
                    target_modules=_names(get["lora_target_modules"], "lora_target_modules"),
                    modules_to_save=(saved,) if isinstance(saved, str) else saved,
                    use_dora=bool(get["use_dora"]), base_dtype=dtype)
