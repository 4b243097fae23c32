"""Recipe values typed the way `trl grpo --config` types them, and the ranges a run needs.

TRL's TrlParser turns each YAML value into an argparse default; argparse converts a *string* default with the
field's type (`int("8")`, `float("1e-6")`, transformers' `string_to_bool("yes")`) and passes every other value
unconverted. O-GRPO's trainer builds GRPOConfig from the loaded dict, so the loader applies the same conversion:
a quoted number plans and trains as the number TRL would have made of it, and what the plan accepts constructs in
the job. Ranges are the values TRL, transformers or vLLM refuse (or silently misuse) later, at job start or at the
first step. Pure functions, no TRL import.
"""

from __future__ import annotations

import json
import math
import re
from functools import lru_cache
from pathlib import Path

# transformers.hf_argparser.string_to_bool
_TRUE = ("yes", "true", "t", "y", "1")
_FALSE = ("no", "false", "f", "n", "0")

# key -> (low, low inclusive, high, high inclusive); None: unbounded on that side.
RANGES: dict[str, tuple] = {
    "learning_rate": (0, False, None, False),
    "vllm_gpu_memory_utilization": (0, False, 1, True),
    "temperature": (0, False, None, False),
    "top_p": (0, False, 1, True),
    # 0 disables top-k in TRL (vLLM and transformers alike); vLLM's -1 breaks transformers' generation
    "top_k": (0, True, None, False),
    "min_p": (0, True, 1, True),
    "repetition_penalty": (0, False, None, False),
    "per_device_train_batch_size": (1, True, None, False),
    "per_device_eval_batch_size": (1, True, None, False),
    "gradient_accumulation_steps": (1, True, None, False),
    "max_completion_length": (1, True, None, False),
    "max_prompt_length": (1, True, None, False),
    "generation_batch_size": (1, True, None, False),
    "steps_per_generation": (1, True, None, False),
    "num_iterations": (1, True, None, False),
    "vllm_tensor_parallel_size": (1, True, None, False),
    "vllm_data_parallel_size": (1, True, None, False),
    "num_processes": (1, True, None, False),
    "beta": (0, True, None, False),
    "epsilon": (0, True, None, False),
    "epsilon_high": (0, True, None, False),
    "max_grad_norm": (0, True, None, False),
    "weight_decay": (0, True, None, False),
    "adam_epsilon": (0, False, None, False),
    "adam_beta1": (0, True, 1, False),
    "adam_beta2": (0, True, 1, False),
    "warmup_ratio": (0, True, 1, True),
    "warmup_steps": (0, True, None, False),
    "num_train_epochs": (0, False, None, False),
    "max_steps": (-1, True, None, False),
    "logging_steps": (0, False, None, False),
    "save_steps": (0, False, None, False),
    "eval_steps": (0, False, None, False),
    "save_total_limit": (0, True, None, False),
    # numpy's seed range (transformers' set_seed seeds numpy)
    "seed": (0, True, 2**32 - 1, True),
    "data_seed": (0, True, 2**32 - 1, True),
    "dataloader_num_workers": (0, True, None, False),
    "num_completions_to_print": (0, True, None, False),
    "vllm_server_timeout": (0, False, None, False),
    "lora_r": (1, True, None, False),
    "lora_alpha": (0, False, None, False),
    "lora_dropout": (0, True, 1, False),
}


def _is_control(c: str) -> bool:
    return ord(c) < 32 or ord(c) == 127


def control_character(text: str) -> str | None:
    """The first control character (a line break, tab, NUL, ...) in text, else None: what a one-line value of
    job.sbatch (an `#SBATCH` option, a header comment, an environment value) must not hold."""
    return next((c for c in str(text) if _is_control(c)), None)


def escaped(text: str) -> str:
    """Text with each control character written as its escape (a line break as \\n), for one line."""
    return "".join(repr(c)[1:-1] if _is_control(c) else c for c in str(text))


def kind_of(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, dict):
        return "dict"
    return type(value).__name__


def _want(kinds) -> str:
    return " or ".join(k if k != "none" else "null" for k in kinds) or "nothing"


def coerce(key: str, value, kinds) -> object:
    """The value TRL's parser makes of a YAML value for a field of these kinds; ValueError(problem) when TRL's
    parser or dataclass would refuse it (or pass on a value of the wrong type)."""
    kinds = tuple(kinds)
    k = kind_of(value)
    if "any" in kinds or k in kinds or (k == "int" and "float" in kinds):
        return value
    if k == "str":
        text = value.strip()
        if "bool" in kinds:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
        elif "int" in kinds or "float" in kinds:
            try:
                return int(text) if "int" in kinds else float(text)
            except ValueError:
                if "float" in kinds:
                    try:
                        return float(text)
                    except ValueError:
                        pass
    got = "null" if value is None else f"{k} {value!r:.60}"
    raise ValueError(f"{key}: expected {_want(kinds)}, got {got}")


def range_problem(key: str, value) -> str | None:
    """Why a typed value is out of the range its field needs (None when it is fine or not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"{key}: must be a finite number (got {value!r})"
    if key == "num_generations":
        if value < 2:
            return (f"num_generations: GRPO needs at least 2 generations per prompt (got {value}); set "
                    "num_generations: 2 or more")
        return None
    bounds = RANGES.get(key)
    if bounds is None:
        return None
    lo, lo_in, hi, hi_in = bounds
    low_ok = lo is None or (value >= lo if lo_in else value > lo)
    high_ok = hi is None or (value <= hi if hi_in else value < hi)
    if low_ok and high_ok:
        return None
    left = "" if lo is None else ("[" if lo_in else "(") + f"{lo}"
    right = "" if hi is None else f"{hi}" + ("]" if hi_in else ")")
    if hi is None:
        want = f"at least {lo}" if lo_in else ("positive" if lo == 0 else f"greater than {lo}")
    else:
        want = f"in {left}, {right}"
    return f"{key}: must be {want} (got {value!r})"


@lru_cache(maxsize=1)
def _choices() -> dict[str, dict[str, list[str]]]:
    """{TRL line "1.16"/"1.9": {field: accepted values}} (ogrpo/data/vendor_trl_fields.py --choices)."""
    return json.loads((Path(__file__).with_name("data") / "trl_choices.json").read_text())


def choices(key: str) -> list[str]:
    """The values a field with a fixed set of them accepts on any supported TRL line ([] for other keys)."""
    return sorted({c for table in _choices().values() for c in table.get(key, ())})


# The plain scalars YAML 1.1 (PyYAML) reads as booleans.
_YAML11_BOOL_WORDS = {True: ("yes", "on", "true"), False: ("no", "off", "false")}


def bool_as_choice(value, allowed) -> str | None:
    """The allowed value a YAML boolean stands for where a setting's values are words such as `off` or `no`:
    PyYAML reads an unquoted `off` as False (`ogrpo.overlap: off`, `save_strategy: no`), and the one allowed word
    of that truth value is what was written. None when the value is no boolean or no single word matches."""
    if not isinstance(value, bool):
        return None
    words = [c for c in allowed if isinstance(c, str) and c.lower() in _YAML11_BOOL_WORDS[value]]
    return words[0] if len(words) == 1 else None


def choice_problem(key: str, value, line: str | None = None) -> str | None:
    """A field with a fixed set of values (optim, lr_scheduler_type, *_strategy, log_level, loss_type, scale_rewards,
    ...: ogrpo/data/vendor_trl_fields.py) given one the job's TRL line refuses or ignores (any supported line when
    `line` is None). A list (report_to's) is checked item by item."""
    if isinstance(value, list):
        return next((p for p in (choice_problem(key, v, line) for v in value) if p), None)
    if not isinstance(value, str):
        return None
    lines = _choices()
    picked = [lines[".".join(line.split(".")[:2])]] if line else list(lines.values())
    allowed = sorted({c for table in picked for c in table.get(key, ())})
    if not allowed or value in allowed:
        return None
    import difflib

    close = difflib.get_close_matches(value, allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    where = f"TRL {line}" if line else "TRL"
    listed = ", ".join(allowed) if len(allowed) <= 12 else f"{len(allowed)} names ({', '.join(allowed[:6])} ...)"
    return f"{key}: {value!r} is not a value {where} accepts; {hint}one of {listed}"


def kinds_from_type(type_text: str) -> list[str]:
    """Map a dataclass field's annotation to the YAML value kinds it accepts."""
    t = re.sub(r"<class '([\w.]+)'>", r"\1", type_text).replace("typing.", "")
    kinds: set[str] = set()
    tokens = re.split(r"[|\[\],\s]+|Union|Optional|Literal", t)
    for tok in tokens:
        tok = tok.strip().strip("'\"<>").replace("class ", "").strip("'")
        if not tok:
            continue
        base = tok.split(".")[-1]
        if base in ("bool", "False", "True"):
            kinds.add("bool")
        elif base == "int":
            kinds.add("int")
        elif base == "float":
            kinds.add("float")
        elif base == "str" or base.endswith(("Names", "Strategy", "Type", "Option")):
            kinds.add("str")
        elif base in ("list", "List", "tuple"):
            kinds.add("list")
        elif base in ("dict", "Dict"):
            kinds.add("dict")
        elif base in ("None", "NoneType"):
            kinds.add("none")
        elif base == "Any":
            kinds.add("any")
        elif base in ("DatasetConfig",):
            continue
        else:
            kinds.add("any")
    return sorted(kinds)
