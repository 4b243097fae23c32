"""Write `trl_fields_<line>.json`: the dataclass fields of a TRL release that is not installed here.

The GPU images run TRL 1.9.2 + transformers 5.5.4 while this machine runs the CPU/CI stack, so the GPU line's
GRPOConfig and `trl vllm-serve` arguments are read from the wheels' source with `ast` (nothing is imported):

    pip download --no-deps trl==1.9.2 transformers==5.5.4 -d /tmp/w   # then unzip both wheels
    python ogrpo/data/vendor_trl_fields.py --trl-src /tmp/w/trl --transformers-src /tmp/w/transformers \
        --trl-version 1.9.2 --transformers-version 5.5.4 -o ogrpo/data/trl_fields_1.9.json
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

# (group name in the JSON, file under the trl source, class) — bases are followed through these files.
GROUPS = (
    ("GRPOConfig", "trainer/grpo_config.py", "GRPOConfig"),
    ("vllm_serve.ScriptArguments", "scripts/vllm_serve.py", "ScriptArguments"),
    # The recipe keys `trl grpo` reads besides GRPOConfig (ogrpo/fields.py classifies each; test_field_walk.py).
    ("ModelConfig", "trainer/model_config.py", "ModelConfig"),
    ("GRPOScriptArguments", "scripts/grpo.py", "GRPOScriptArguments"),
    ("DatasetMixtureConfig", "scripts/utils.py", "DatasetMixtureConfig"),
)
# Base classes defined outside the file of their subclass.
BASES = {
    "_BaseConfig": ("trl", "trainer/base_config.py"),
    "TrainingArguments": ("transformers", "training_args.py"),
    "ScriptArguments": ("trl", "scripts/utils.py"),
}


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    tree = ast.parse(path.read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _default(value: ast.expr | None):
    """The field's default when it is a literal (None otherwise, also for factories)."""
    if value is None:
        return None
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        for kw in value.keywords:
            if kw.arg == "default":
                value = kw.value
                break
        else:
            return None
    try:
        return ast.literal_eval(value)
    except ValueError:
        return None


def _init_field(stmt: ast.AnnAssign) -> bool:
    if "ClassVar" in ast.unparse(stmt.annotation):
        return False
    if isinstance(stmt.value, ast.Call) and getattr(stmt.value.func, "id", None) == "field":
        for kw in stmt.value.keywords:
            if kw.arg == "init" and isinstance(kw.value, ast.Constant) and kw.value.value is False:
                return False
    return True


def class_fields(roots: dict[str, Path], path: Path, name: str) -> dict[str, dict]:
    """{field: {"type": annotation, "default": literal default or None}} of a dataclass, base classes first (as
    `dataclasses.fields` orders them); "required" marks a field without a default."""
    cls = _classes(path)[name]
    out: dict[str, object] = {}
    for base in cls.bases:
        base_name = ast.unparse(base).split(".")[-1]
        if base_name in BASES:
            root, rel = BASES[base_name]
            out.update(class_fields(roots, roots[root] / rel, base_name))
        elif base_name in _classes(path):
            out.update(class_fields(roots, path, base_name))
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and _init_field(stmt):
            info = {"type": ast.unparse(stmt.annotation), "default": _default(stmt.value)}
            if stmt.value is None or (isinstance(stmt.value, ast.Call) and not stmt.value.keywords
                                      and getattr(stmt.value.func, "id", None) == "field"):
                info["required"] = True
            elif isinstance(stmt.value, ast.Call) and getattr(stmt.value.func, "id", None) == "field" and not any(
                    kw.arg in ("default", "default_factory") for kw in stmt.value.keywords):
                info["required"] = True
            out[stmt.target.id] = info
    return out


def build(trl_src: Path, transformers_src: Path, trl_version: str, transformers_version: str) -> dict:
    roots = {"trl": trl_src, "transformers": transformers_src}
    data: dict = {"trl_version": trl_version, "transformers_version": transformers_version}
    for group, rel, name in GROUPS:
        data[group] = dict(sorted(class_fields(roots, trl_src / rel, name).items()))
    return data


def main() -> None:
    import sys

    if sys.argv[1:2] == ["--choices"]:  # python ogrpo/data/vendor_trl_fields.py --choices ogrpo/data/trl_choices.json
        write_choices(Path(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trl-src", type=Path, required=True, help="the unpacked wheel's trl/ directory")
    ap.add_argument("--transformers-src", type=Path, required=True, help="the unpacked wheel's transformers/")
    ap.add_argument("--trl-version", required=True)
    ap.add_argument("--transformers-version", required=True)
    ap.add_argument("-o", "--output", type=Path, required=True)
    a = ap.parse_args()
    data = build(a.trl_src, a.transformers_src, a.trl_version, a.transformers_version)
    a.output.write_text(json.dumps(data, indent=1, sort_keys=False, default=str) + "\n")



# ---- the values a GRPOConfig string field may take on the installed TRL line --------------------------------
# Three sources, all read from the installed packages (run once per environment: the CPU stack's .venv and the
# images' line in .venv-trl19), so that `ogrpo plan` refuses at once what the job would refuse, or misuse, only
# after it queued and loaded its model:
# 1. enum-typed TrainingArguments fields: TrainingArguments converts each with `Enum(value)` at the job's first line;
CHOICE_ENUMS = (
    ("optim", "transformers.training_args", "OptimizerNames"),
    ("lr_scheduler_type", "transformers.trainer_utils", "SchedulerType"),
    ("eval_strategy", "transformers.trainer_utils", "IntervalStrategy"),
    ("logging_strategy", "transformers.trainer_utils", "IntervalStrategy"),
    ("save_strategy", "transformers.trainer_utils", "SaveStrategy"),
    ("hub_strategy", "transformers.trainer_utils", "HubStrategy"),
)
# 2. fields whose dataclass metadata lists `choices` (HfArgumentParser enforces them on a command line, nothing
#    does for a config file: log_level, ddp_backend, ...);
# 3. TRL's own string options, which its trainer only compares: a value none of its branches names fails at the
#    first loss or reward (loss_type, scale_rewards, importance_sampling_level, multi_objective_aggregation) or
#    silently does nothing (vllm_importance_sampling_mode: no truncation, no mask). Their values are the strings
#    TRL's GRPO sources compare the field with, and the field's default.
#    (vllm_mode is not one: TRL's VLLMGeneration refuses an unknown mode itself, and the plan sets it by placement.)
COMPARED = ("loss_type", "scale_rewards", "importance_sampling_level", "vllm_importance_sampling_mode",
            "multi_objective_aggregation")
COMPARED_IN = ("trainer/grpo_trainer.py", "trainer/grpo_config.py", "generation/*.py")


def _strings(node: ast.expr) -> list[str] | None:
    """The string constants a comparison's other side names (a constant, or a list/tuple/set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        parts = [_strings(e) for e in node.elts]
        return None if any(p is None for p in parts) else [s for p in parts for s in p]
    return None


def compared_values(sources: list[Path], names: tuple[str, ...] = COMPARED) -> dict[str, set[str]]:
    """{field: the strings `<anything>.<field>` is compared with (==, !=, in, not in) in these sources}."""
    found: dict[str, set[str]] = {name: set() for name in names}
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare) or len(node.ops) != 1:
                continue
            for a, b in ((node.left, node.comparators[0]), (node.comparators[0], node.left)):
                if isinstance(a, ast.Attribute) and a.attr in found:
                    found[a.attr].update(_strings(b) or ())
    return found


def installed_choices() -> dict[str, list[str]]:
    """{field: sorted accepted values} from the TRL and transformers installed in this interpreter (imports them)."""
    import dataclasses
    import importlib

    import trl
    from trl import GRPOConfig

    out = {name: sorted(m.value for m in getattr(importlib.import_module(mod), cls))
           for name, mod, cls in CHOICE_ENUMS}
    defaults = {}
    for f in dataclasses.fields(GRPOConfig):
        if f.metadata.get("choices") and f.name not in out:
            out[f.name] = sorted(str(c) for c in f.metadata["choices"])
        defaults[f.name] = f.default
    # 4. report_to: the integrations transformers has a callback for, "all" and "none" (a name it lacks fails
    #    when the trainer builds its callbacks, after the job queued and loaded its model)
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    out["report_to"] = sorted([*INTEGRATION_TO_CALLBACK, "all", "none"])
    root = Path(trl.__file__).parent
    sources = sorted({p for pattern in COMPARED_IN for p in root.glob(pattern)})
    for name, values in compared_values(sources).items():
        if name in defaults:
            out[name] = sorted(values | ({defaults[name]} if isinstance(defaults[name], str) else set()))
    return dict(sorted(out.items()))


def write_choices(path: Path) -> None:
    """Add this interpreter's TRL line to the choices file."""
    from importlib import metadata

    line = ".".join(metadata.version("trl").split(".")[:2])
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[line] = installed_choices()
    path.write_text(json.dumps(dict(sorted(data.items())), indent=1) + "\n")


if __name__ == "__main__":
    main()
