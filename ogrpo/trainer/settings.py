"""Run config + plan → the `GRPOConfig` the trainer uses.

The plan's `trainer_args` (precision, attention, TF32, fused AdamW, compile, dataloader workers, vLLM mode…)
are applied over the run config's TRL keys: the plan already considered the config when it chose them, and it
is what makes the same recipe right on a V100 (fp16, SDPA, no TF32) and on an A40 (bf16, FA2, TF32).
"""

from __future__ import annotations

import copy

from ogrpo import compat
from ogrpo.dtypes import trainer_flags
from ogrpo.errors import OgrpoError
from ogrpo.planner.device_rules import rules_of
from ogrpo.render import deepspeed_config

# ModelConfig keys that TRL's own script turns into `model_init_kwargs`.
_MODEL_INIT_KEYS = ("attn_implementation", "dtype", "torch_dtype", "trust_remote_code", "model_revision")
# Older names of GRPOConfig fields, applied where this TRL line lacks the old one: transformers 5.x (TRL 1.16)
# folds warmup_ratio into warmup_steps (a float below 1 is a ratio of the training steps).
_RENAMES = {"evaluation_strategy": "eval_strategy", "warmup_ratio": "warmup_steps"}


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cpu_deepspeed(plan, config_source=None) -> str | dict | None:
    """The DeepSpeed config a CPU Plan (or None) with a ZeRO strategy trains with, else None.

    On CPU the job launches the trainer as `accelerate launch --multi_gpu` over gloo (`--cpu` with 2 processes
    starts one), which never reads accelerate.yaml's DeepSpeed section; transformers' own route, GRPOConfig's
    `deepspeed`, turns DeepSpeed on inside each process instead. It gets the job's rendered deepspeed.json
    (next to the run.yaml the job passes), or the same config built from the plan for an unrendered run."""
    from pathlib import Path

    if plan is None or not plan.trainer.strategy.uses_deepspeed:
        return None

    if rules_of(plan).deepspeed_through_accelerate:
        return None  # GPU: accelerate.yaml names deepspeed.json (DEEPSPEED launcher)
    if config_source is not None:
        rendered = Path(str(config_source)).expanduser().with_name("deepspeed.json")
        if Path(str(config_source)).suffix in (".yaml", ".yml") and rendered.is_file():
            return str(rendered.resolve())

    return deepspeed_config(plan)


def grpo_config_kwargs(run_trl: dict, plan, output_dir, vllm_url: str | None = None,
                       fields: frozenset[str] | None = None, config_source=None) -> tuple[dict, list[str]]:
    """(GRPOConfig keyword arguments, notes on keys dropped). Pure apart from reading TRL's field list
    (`fields`: GRPOConfig's field names; default: the installed TRL's) and, for a CPU ZeRO plan, looking for
    the job's deepspeed.json next to `config_source`. `plan`: the Plan the trainer runs, or None."""

    fields = compat.grpo_config_fields() if fields is None else fields
    notes: list[str] = []
    kwargs = {k: copy.deepcopy(v) for k, v in run_trl.items() if k in fields}
    # Same meaning under this TRL line's name (ogrpo/fields.py `mapped`); the plan lists what is not applied.
    for old, new in _RENAMES.items():
        if run_trl.get(old) is not None and old not in fields and new in fields and run_trl.get(new) is None:
            kwargs[new] = copy.deepcopy(run_trl[old])

    init = dict(kwargs.pop("model_init_kwargs", None) or {})
    dtype_key = compat.model_dtype_key()
    for key in _MODEL_INIT_KEYS:
        if run_trl.get(key) is None:
            continue
        if key in ("dtype", "torch_dtype"):
            init[dtype_key] = run_trl[key]
        elif key == "model_revision":
            init["revision"] = run_trl[key]
        else:
            init[key] = run_trl[key]

    for key, value in (plan.trainer_args.items() if plan is not None else ()):
        if key == "model_init_kwargs":
            for k, v in (value or {}).items():
                init[dtype_key if k in ("dtype", "torch_dtype") else k] = v
        elif key in fields:
            kwargs[key] = copy.deepcopy(value)
        else:
            notes.append(f"plan setting {key}={value!r} is not a field of this TRL's GRPOConfig; not applied")
    ds = cpu_deepspeed(plan, config_source)
    if ds is not None:
        kwargs["deepspeed"] = ds
    if plan is not None and plan.attn_implementation and "attn_implementation" not in init:
        init["attn_implementation"] = plan.attn_implementation
    if init:
        kwargs["model_init_kwargs"] = init

    if plan is not None and plan.precision:
        # GRPOConfig turns bf16 on unless told otherwise, and fp16+bf16 is refused: say both explicitly.
        for flag, on in trainer_flags(plan.precision).items():
            kwargs.setdefault(flag, on)

    if vllm_url:
        # An explicit server URL means server mode, whatever the plan chose for a machine without one.
        kwargs["vllm_server_base_url"] = vllm_url
        kwargs["use_vllm"] = True
        kwargs["vllm_mode"] = "server"
    kwargs["output_dir"] = str(output_dir)
    # No experiment tracker unless the config asks for one: a run must not hang on a wandb login prompt.
    kwargs.setdefault("report_to", [])
    return kwargs, notes


def build_grpo_config(run_trl: dict, plan, output_dir, vllm_url: str | None = None,
                      config_source=None):
    """The GRPOConfig for this run. On a machine without CUDA, `use_cpu` is set (the embedded default)."""
    from trl import GRPOConfig

    kwargs, _ = grpo_config_kwargs(run_trl, plan, output_dir, vllm_url, config_source=config_source)
    if "use_cpu" not in kwargs and not cuda_available():
        kwargs["use_cpu"] = True
    try:
        return GRPOConfig(**kwargs)
    except (ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OgrpoError(f"GRPOConfig rejected the settings: {first}; fix the run config (or plan for this "
                         "machine's hardware)") from None
