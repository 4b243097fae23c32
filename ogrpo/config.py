"""Run config: TRL's flat recipe YAML (what `trl grpo --config` and open-r1's recipes read) plus one `ogrpo:` key.

Validation never imports trl: the field names and kinds of TRL 1.16's GRPOConfig (which includes
TrainingArguments), GRPOScriptArguments, DatasetMixtureConfig and ModelConfig are vendored in
`ogrpo/data/trl_fields.json`; tests/test_config.py regenerates them from the installed trl and compares. The
images' TRL 1.9 GRPOConfig fields (`trl_fields_1.9.json`) and the keys of ogrpo/fields.py (open-r1's arguments,
older stacks' keys) are accepted too; fields.py says what the run does with each key.
All problems are collected and raised once as ConfigError.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path

from ogrpo.errors import ConfigError, OgrpoError

DATA_DIR = Path(__file__).with_name("data")
RECIPES_DIR = Path(__file__).with_name("recipes")
FIELDS_FILE = DATA_DIR / "trl_fields.json"
TRL_GROUPS = ("GRPOConfig", "GRPOScriptArguments", "DatasetMixtureConfig", "ModelConfig")

# Keys outside TRL 1.16's dataclasses (open-r1's arguments, older TRL/transformers/accelerate keys, GRPOConfig
# fields only the images' TRL 1.9 has) are accepted with the kinds and rules of ogrpo/fields.py, which says what
# happens to each one.
PROFILES = ("conservative", "balanced", "aggressive")
STRATEGIES = ("ddp", "zero2", "zero3", "zero3_offload")  # the trainer strategies ogrpo/plan.py knows


@dataclass
class OgrpoOptions:
    """O-GRPO's own options (the `ogrpo:` section; the same names on the command line)."""

    gpus: str | None = None  # --gpus spec the config was planned/written for
    profile: str | None = None  # conservative | balanced | aggressive (None: balanced)
    vllm_gpus: int | None = None  # GPUs for the vLLM server (0: colocate/no server)
    params: str | None = None  # parameter count when the model is not known (e.g. "7B")
    model: str | None = None  # planning model when model_name_or_path is not resolvable here
    prompt_column: str | None = None  # dataset column holding the prompt
    system_prompt: str | None = None
    reward_weights: list[float] | None = None
    max_prompt_length: int | None = None  # prompt tokens the plan budgets for (TRL 1.16 does not truncate)
    use_vllm: bool | None = None  # False: generate with HF inside the trainer (no server)
    strategy: str | None = None  # ddp | zero2 | zero3 | zero3_offload (None: the cheapest that fits)
    kernels: bool | None = None  # O-GRPO's own kernels (ogrpo/kernels); None: the plan decides per profile
    step_time_s: float | None = None  # seconds per optimizer step, for the preemption policy (ogrpo.launch.grace)
    # Slurm header fields; None leaves them out of job.sbatch.
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    cpus_per_gpu: int | None = None
    mem_per_gpu: str | None = None
    job_name: str | None = None
    container: str | None = None
    env: dict | None = None  # extra environment for every step
    plan: dict | None = None  # written by `ogrpo render`: the plan the job was made from

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


# Expected kinds for OgrpoOptions fields (validation of user input).
_OGRPO_KINDS = {
    "gpus": ("str",), "profile": ("str",), "vllm_gpus": ("int",), "params": ("str", "int", "float"),
    "model": ("str",), "prompt_column": ("str",), "system_prompt": ("str",), "reward_weights": ("list",),
    "max_prompt_length": ("int",), "use_vllm": ("bool",), "strategy": ("str",), "kernels": ("bool",), "step_time_s": ("int", "float"), "partition": ("str",), "account": ("str",),
    "qos": ("str",), "time": ("str", "int"), "cpus_per_gpu": ("int",), "mem_per_gpu": ("str",),
    "job_name": ("str",), "container": ("str",), "env": ("dict",), "plan": ("dict",),
}


@lru_cache(maxsize=1)
def trl_fields() -> dict:
    """The vendored field table: {group: {name: {"kinds": [...], "default": value}}, "trl_version": ...}."""
    return json.loads(FIELDS_FILE.read_text())


@lru_cache(maxsize=1)
def _field_index() -> dict[str, dict]:
    """Every accepted key -> {"kinds", "default", "group"}: TRL 1.16's fields, then TRL 1.9's GRPOConfig fields,
    then the keys ogrpo/fields.py classifies (open-r1, older stacks)."""
    from ogrpo import fields as rules

    index: dict[str, dict] = {}
    data = trl_fields()
    for group in TRL_GROUPS:
        for name, info in data[group].items():
            index.setdefault(name, {**info, "group": group})
    image = json.loads((DATA_DIR / "trl_fields_1.9.json").read_text())["GRPOConfig"]
    for name, info in image.items():
        index.setdefault(name, {"kinds": _kinds_from_type(info["type"]), "default": info["default"],
                                "group": "GRPOConfig"})
    for name, r in rules.RULES.items():
        if name not in index and r.kinds:
            index[name] = {"kinds": list(r.kinds), "default": r.default, "group": "other"}
    for name, kinds in rules.KIND_OVERRIDES.items():
        index[name] = {**index[name], "kinds": sorted(set(index[name]["kinds"]) | set(kinds))}
    return index


def trl_default(name: str):
    info = _field_index().get(name)
    return copy.deepcopy(info["default"]) if info else None


@dataclass
class RunConfig:
    trl: dict
    ogrpo: OgrpoOptions = field(default_factory=OgrpoOptions)
    source: str = "<dict>"
    warnings: list[str] = field(default_factory=list)

    def get(self, key: str, default=None):
        """A TRL key's value: the config's, else the given default, else TRL 1.16's default."""
        if key in self.trl and self.trl[key] is not None:
            return self.trl[key]
        if default is not None:
            return default
        return trl_default(key)

    @property
    def model_name_or_path(self) -> str | None:
        return self.trl.get("model_name_or_path")

    @property
    def plan(self) -> dict | None:
        return self.ogrpo.plan

    def by_group(self) -> dict[str, dict]:
        """TRL keys split by the dataclass that takes them (plus "other": open-r1/renamed keys)."""
        out: dict[str, dict] = {g: {} for g in TRL_GROUPS}
        out["other"] = {}
        for k, v in self.trl.items():
            groups = [g for g in TRL_GROUPS if k in trl_fields()[g]]
            if not groups:
                out["other"][k] = v
            for g in groups:
                out[g][k] = v
        return out

    def to_dict(self) -> dict:
        d = copy.deepcopy(self.trl)
        opts = self.ogrpo.to_dict()
        if opts:
            d["ogrpo"] = copy.deepcopy(opts)
        return d

    def to_yaml(self) -> str:
        return dump_yaml(self.to_dict())


def dump_yaml(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True, width=1000)


def _yaml_load(text: str, where: str):
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        return yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError([f"malformed YAML{at}: {problem}; fix the YAML syntax"], where) from None


def recipe_path(name: str) -> Path | None:
    p = RECIPES_DIR / f"{name}.yaml"
    return p if p.is_file() else None


def builtin_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")) if RECIPES_DIR.is_dir() else []


def _read_source(source) -> tuple[dict, str]:
    if isinstance(source, dict):
        return copy.deepcopy(source), "<dict>"
    text_src = str(source)
    path = Path(text_src).expanduser()
    if not path.is_file():
        looks_like_name = re.fullmatch(r"[A-Za-z0-9_.-]+", text_src) and not text_src.endswith((".yaml", ".yml"))
        rp = recipe_path(text_src) if looks_like_name else None
        if rp is None:
            if path.exists():
                raise ConfigError([f"{text_src} is not a file; pass a YAML file or a recipe name"], text_src)
            known = ", ".join(builtin_recipes()) or "none"
            raise ConfigError([f"no such file or built-in recipe; pass --config FILE.yaml or one of: {known}"],
                              text_src)
        path = rp
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError([f"cannot read: {exc.strerror}; check the path"], str(path)) from None
    data = _yaml_load(text, str(path))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"top level must be a mapping of keys (got {type(data).__name__}); "
                           "write `key: value` lines as in TRL's recipes"], str(path))
    return data, str(path)


def _kind_of(value) -> str:
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


def _accepts(kinds: list[str] | tuple[str, ...], value) -> bool:
    k = _kind_of(value)
    if "any" in kinds or k in kinds:
        return True
    if k == "int" and "float" in kinds:
        return True
    # HfArgumentParser parses strings for numbers/bools from YAML-less CLIs; YAML gives typed values, but a
    # quoted number ("1e-6" is a str in YAML 1.1) is what recipes commonly contain, and TRL accepts it.
    if k == "str" and ("float" in kinds or "int" in kinds):
        try:
            float(value)
            return True
        except ValueError:
            return False
    return False


def _merge_overrides(data: dict, overrides: dict | None) -> None:
    if not overrides:
        return
    for key, value in overrides.items():
        if value is None:
            continue
        if key == "ogrpo" and isinstance(value, dict):
            section = data.setdefault("ogrpo", {}) or {}
            if not isinstance(section, dict):
                section = {}
            for k, v in value.items():
                if v is not None:
                    section[k] = v
            data["ogrpo"] = section
        elif key.startswith("ogrpo."):
            section = data.get("ogrpo") if isinstance(data.get("ogrpo"), dict) else {}
            section[key[len("ogrpo."):]] = value
            data["ogrpo"] = section
        else:
            data[key] = value


def load_run_config(source, overrides: dict | None = None) -> RunConfig:
    """Load, merge overrides (flat TRL keys; `ogrpo` dict or `ogrpo.KEY` for O-GRPO options), validate."""
    data, where = _read_source(source)
    _merge_overrides(data, overrides)
    problems: list[str] = []
    warnings: list[str] = []

    section = data.pop("ogrpo", None)
    if section is None:
        section = {}
    if not isinstance(section, dict):
        problems.append(f"ogrpo: must be a mapping of O-GRPO options (got {_kind_of(section)})")
        section = {}

    from ogrpo import fields as rules

    index = _field_index()
    for key, value in data.items():
        if not isinstance(key, str):
            problems.append(f"key {key!r} is not a string")
            continue
        info = index.get(key)
        if info is None:
            close = difflib.get_close_matches(key, list(index), n=1, cutoff=0.75)
            hint = f"did you mean {close[0]}?" if close else "remove it or move O-GRPO options under `ogrpo:`"
            problems.append(f"unknown key {key!r}: {hint}")
            continue
        if not _accepts(info["kinds"], value):
            want = " or ".join(k for k in info["kinds"] if k != "none")
            problems.append(f"{key}: expected {want}, got {_kind_of(value)} {value!r}")
            continue
        r = rules.rule(key)
        if info["group"] == "other" and r is not None:
            origin = "open-r1's scripts" if key in rules.open_r1_keys() else "older TRL/transformers/accelerate"
            if r.kind in (rules.MAPPED, rules.PLANNED):
                warnings.append(f"{key}: a key of {origin}, not of TRL 1.16; mapped to {r.target}")
            elif value is not None and value != r.default:
                warnings.append(f"{key}: a key of {origin}; not applied ({r.reason}); listed in the plan's changes")
    _map_open_r1(data, section)

    opt_names = {f.name for f in fields(OgrpoOptions)}
    opts: dict = {}
    for key, value in section.items():
        if key not in opt_names:
            close = difflib.get_close_matches(str(key), sorted(opt_names), n=1, cutoff=0.6)
            hint = f"did you mean ogrpo.{close[0]}?" if close else f"known: {', '.join(sorted(opt_names))}"
            problems.append(f"unknown key ogrpo.{key}: {hint}")
            continue
        if value is not None and not _accepts(_OGRPO_KINDS[key], value):
            problems.append(f"ogrpo.{key}: expected {' or '.join(_OGRPO_KINDS[key])}, got {_kind_of(value)} "
                            f"{value!r}")
            continue
        opts[key] = value

    _check_values(data, opts, problems)
    if problems:
        raise ConfigError(problems, where)
    if "params" in opts and opts["params"] is not None:
        opts["params"] = str(opts["params"])
    for num in ("vllm_gpus", "cpus_per_gpu", "max_prompt_length"):
        if isinstance(opts.get(num), str):
            opts[num] = int(opts[num])
    if isinstance(opts.get("time"), int):
        opts["time"] = str(opts["time"])
    return RunConfig(trl=data, ogrpo=OgrpoOptions(**opts), source=where, warnings=warnings)


def _map_open_r1(data: dict, section: dict) -> None:
    """open-r1 keys with an O-GRPO home (ogrpo/fields.py `mapped`): copied there unless set there already, so
    the trainer reads them where it reads its own options. The original keys stay (the config round-trips)."""
    if isinstance(data.get("dataset_prompt_column"), str) and section.get("prompt_column") is None:
        section["prompt_column"] = data["dataset_prompt_column"]
    if isinstance(data.get("system_prompt"), str) and section.get("system_prompt") is None:
        section["system_prompt"] = data["system_prompt"]
    configs = data.get("dataset_configs")
    if data.get("dataset_config") is None and configs:
        data["dataset_config"] = configs[0] if isinstance(configs, list) else configs


def _positive(data: dict, key: str, problems: list[str], minimum: int = 1) -> None:
    v = data.get(key)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        return
    if v < minimum:
        problems.append(f"{key}: must be at least {minimum} (got {v})")


def _check_values(data: dict, opts: dict, problems: list[str]) -> None:
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "max_completion_length"):
        _positive(data, key, problems)
    if isinstance(data.get("num_generations"), int) and not isinstance(data.get("num_generations"), bool):
        if data["num_generations"] < 2:
            problems.append(f"num_generations: GRPO needs at least 2 generations per prompt (got "
                            f"{data['num_generations']}); set num_generations: 2 or more")
    if data.get("bf16") is True and data.get("fp16") is True:
        problems.append("bf16 and fp16 are both true; set only one (the plan picks per GPU when neither is set)")
    lr = data.get("learning_rate")
    if isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr <= 0:
        problems.append(f"learning_rate: must be positive (got {lr})")
    prof = opts.get("profile")
    if prof is not None and prof not in PROFILES:
        close = difflib.get_close_matches(str(prof), PROFILES, n=1)
        problems.append(f"ogrpo.profile: {prof!r} is not one of {', '.join(PROFILES)}"
                        + (f" (did you mean {close[0]}?)" if close else ""))
    strategy = opts.get("strategy")
    if strategy is not None and strategy not in STRATEGIES:
        close = difflib.get_close_matches(str(strategy), STRATEGIES, n=1)
        problems.append(f"ogrpo.strategy: {strategy!r} is not one of {', '.join(STRATEGIES)}"
                        + (f" (did you mean {close[0]}?)" if close else ""))
    vg = opts.get("vllm_gpus")
    if vg is not None:
        try:
            if int(vg) < 0:
                problems.append(f"ogrpo.vllm_gpus: must be 0 or more (got {vg})")
        except (TypeError, ValueError):
            problems.append(f"ogrpo.vllm_gpus: expected an integer (got {vg!r})")
    mpl = opts.get("max_prompt_length")
    if isinstance(mpl, int) and mpl < 1:
        problems.append(f"ogrpo.max_prompt_length: must be at least 1 (got {mpl})")
    rw = opts.get("reward_weights")
    if isinstance(rw, list) and not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in rw):
        problems.append("ogrpo.reward_weights: must be a list of numbers")
    if "params" in opts and opts["params"] is not None:
        from ogrpo.models import parse_params

        try:
            parse_params(opts["params"])
        except OgrpoError as exc:
            problems.append(f"ogrpo.{exc}".replace("ogrpo.--params", "ogrpo.params"))
    if "gpus" in opts and opts["gpus"] is not None:
        from ogrpo.hardware import parse_gpus

        try:
            parse_gpus(str(opts["gpus"]))
        except OgrpoError as exc:
            problems.append(f"ogrpo.gpus: {exc}")


# --- the vendored TRL field table -------------------------------------------------------------------------


def _kinds_from_type(type_text: str) -> list[str]:
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


def field_table_from_trl() -> dict:
    """Build the field table from the installed trl (imports trl; used by the test and to regenerate)."""
    import dataclasses

    import trl
    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig
    from trl.scripts.grpo import GRPOScriptArguments

    out: dict = {"trl_version": trl.__version__}
    for name, cls in (("GRPOConfig", GRPOConfig), ("GRPOScriptArguments", GRPOScriptArguments),
                      ("DatasetMixtureConfig", DatasetMixtureConfig), ("ModelConfig", ModelConfig)):
        table = {}
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            default = None
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            try:
                json.dumps(default)
            except (TypeError, ValueError):
                default = str(default)
            table[f.name] = {"kinds": _kinds_from_type(f.type if isinstance(f.type, str) else str(f.type)),
                             "default": default}
        out[name] = table
    return out


if __name__ == "__main__":  # python -m ogrpo.config --regen-fields
    import sys

    if "--regen-fields" in sys.argv:
        FIELDS_FILE.write_text(json.dumps(field_table_from_trl(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {FIELDS_FILE}")
