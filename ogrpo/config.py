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
import math
import re
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path

from ogrpo import fields as rules
from ogrpo.errors import ConfigError, OgrpoError
from ogrpo.hardware import parse_gpus
from ogrpo.models import parse_params
from ogrpo.values import (bool_as_choice, choice_problem, choices, coerce, control_character, kind_of,
                          kinds_from_type, range_problem)

DATA_DIR = Path(__file__).with_name("data")
RECIPES_DIR = Path(__file__).with_name("recipes")
FIELDS_FILE = DATA_DIR / "trl_fields.json"
TRL_GROUPS = ("GRPOConfig", "GRPOScriptArguments", "DatasetMixtureConfig", "ModelConfig")

# Keys outside TRL 1.16's dataclasses (open-r1's arguments, older TRL/transformers/accelerate keys, GRPOConfig
# fields only the images' TRL 1.9 has) are accepted with the kinds and rules of ogrpo/fields.py, which says what
# happens to each one.
PROFILES = ("conservative", "balanced", "aggressive")
STRATEGIES = ("ddp", "zero2", "zero3", "zero3_offload")  # the trainer strategies ogrpo/plan.py knows
OVERLAPS = ("off", "lossless", "one-step")  # ogrpo.overlap (ogrpo/overlap/pipeline.py)
OLD_POLICY_PASSES = ("auto", "separate")  # ogrpo.old_policy_pass (ogrpo/trainer/old_policy.py)
PADDING_FREE = ("auto", "rows", "off")  # ogrpo.padding_free (ogrpo/trainer/packing.py)
TRAIN_AHEAD = ("auto", "off")  # ogrpo.train_ahead (ogrpo/overlap/train_ahead.py)
EARLY_BACKWARD = ("auto", "off")  # ogrpo.early_backward (ogrpo/overlap/early_backward.py)
VLLM_COMPILE = ("auto", "on", "off")  # ogrpo.vllm_compile (ogrpo/planner/compile_choice.py)
RANK_BALANCE = ("auto", "off")  # ogrpo.rank_balance (ogrpo/trainer/rank_balance.py)
SANDBOXES = ("auto", "none")  # ogrpo.sandbox (ogrpo/sandbox/policy.py)
# O-GRPO options that take one of a few words (checked in _check_values).
OPTION_CHOICES = {"profile": PROFILES, "strategy": STRATEGIES, "overlap": OVERLAPS, "sandbox": SANDBOXES,
                  "old_policy_pass": OLD_POLICY_PASSES, "padding_free": PADDING_FREE, "train_ahead": TRAIN_AHEAD,
                  "early_backward": EARLY_BACKWARD, "vllm_compile": VLLM_COMPILE, "rank_balance": RANK_BALANCE}


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
    step_time_s: float | None = None  # seconds per optimizer step, for the preemption policy (ogrpo.planner.preemption)
    sandbox: str | None = None  # code rewards: auto (an isolating level or refuse) | none (explicit opt-out)
    overlap: str | None = None  # off | lossless | one-step: server and trainer at work together (None: the plan)
    old_policy_pass: str | None = None  # auto (from the loss forward where exact) | separate (TRL's own pass)
    # auto (packed log-prob passes where exact, a prompt computed once for its rows where cheaper) | rows (packed,
    # each row computing its own prompt: the layout the memory model plans for) | off (TRL's padded passes)
    padding_free: str | None = None
    train_ahead: str | None = None  # auto (lossless: each group's loss while the rest generate) | off
    # auto (each completion's backward as it ends, before its group is whole, where exact and it fits) | off (costly
    # rewards: each completion is scored alone too)
    early_backward: str | None = None
    vllm_compile: str | None = None  # auto (GPU: the profile; CPU: where the run repays compiling) | on | off
    rank_balance: str | None = None  # auto (ranks exchange scored rows to hold even tokens, where exact) | off
    # the SHA-256 of the rows the run must train on (ogrpo/trainer/data_fingerprint.py; `ogrpo reproduce` pins the
    # recorded run's): other data is refused when the trainer starts
    data_sha256: str | None = None
    # Slurm header fields; None leaves them out of job.sbatch.
    partition: str | None = None
    gres_type: str | None = None  # the site's GRES type name for the plan's GPU (default: the catalog's; any: untyped)
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
    "max_prompt_length": ("int",), "use_vllm": ("bool",), "strategy": ("str",), "kernels": ("bool",), "overlap": ("str",), "old_policy_pass": ("str",),
    "padding_free": ("str",), "train_ahead": ("str",), "early_backward": ("str",), "vllm_compile": ("str",),
    "rank_balance": ("str",), "data_sha256": ("str",),
    "step_time_s": ("int", "float"), "sandbox": ("str",), "partition": ("str",), "gres_type": ("str",), "account": ("str",),
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
    index: dict[str, dict] = {}
    data = trl_fields()
    for group in TRL_GROUPS:
        for name, info in data[group].items():
            index.setdefault(name, {**info, "group": group})
    image = json.loads((DATA_DIR / "trl_fields_1.9.json").read_text())["GRPOConfig"]
    for name, info in image.items():
        kinds = kinds_from_type(info["type"])
        if name in index:  # a value either line takes loads; the plan then checks the job's line (fields.py)
            index[name] = {**index[name], "kinds": sorted(set(index[name]["kinds"]) | set(kinds))}
        else:
            index[name] = {"kinds": kinds, "default": info["default"], "group": "GRPOConfig"}
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
    # (ogrpo key, the recipe's value, the override's) where a command-line option replaced what the recipe set
    replaced: list[tuple] = field(default_factory=list)

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


# Recipes nest three or four levels; a deeper document is not a recipe, and libyaml's recursive constructor
# overflows the C stack (a segfault, not an exception) on tens of thousands of levels.
MAX_DEPTH = 64
# Values a document may expand to through its aliases (open-r1's longest recipes have a few hundred; a chat
# template or a prompt is one value however long).
MAX_EXPANDED = 100_000


def _loader():
    """A SafeLoader (libyaml's when present) that refuses a key set twice to different values: YAML says keys are
    unique, PyYAML keeps the last one silently, and one of the two lines would not be applied. The same value twice
    (open-r1's recipes repeat `do_eval: false` for months) changes nothing and is only noted in `duplicates`."""
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class Loader(base):  # type: ignore[misc, valid-type]
        duplicates: list[str] = []

    def construct_mapping(loader, node, deep=False):
        seen: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue  # `<<` merges may be overridden by design; unhashable keys fail in the constructor
            key = loader.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                continue
            line = key_node.start_mark.line + 1
            if first is None:
                seen[key] = (line, value_node)
                continue
            same = loader.construct_object(first[1], deep=True) == loader.construct_object(value_node, deep=True)
            if not same:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} with another value (first set at line {first[0]}); keep one "
                                "of the two", key_node.start_mark)
            loader.duplicates.append(f"{key!r} is set twice to the same value (lines {first[0]} and {line})")
        return yaml.constructor.SafeConstructor.construct_mapping(loader, node, deep=deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    Loader.duplicates = []
    return Loader


def _decode(raw: bytes, where: str) -> str:
    """The file's text: UTF-8 (a BOM allowed), as YAML 1.1 files are and PyYAML reads them."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        bad = raw[exc.start:exc.start + 1].hex()
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError([f"not UTF-8 text (byte 0x{bad} at line {line}); save the file as UTF-8"], where) from None


def _walk_events(text: str, loader, where: str) -> None:
    """Refuse, from the parser's events and before anything is constructed, what PyYAML would build but nothing
    downstream survives: nesting deeper than MAX_DEPTH, an alias inside its own anchor (a cyclic value: JSON and
    YAML dumps die on it) and aliases expanding past MAX_EXPANDED values (a "billion laughs" document: PyYAML
    shares the aliased objects, so it loads in milliseconds, then every dump or walk of it expands all of it).
    Each collection's expanded size is summed as it closes; an alias adds its anchor's size."""
    import yaml

    stack: list[list] = []  # per open collection: [anchor, expanded values, is mapping, next scalar is a key]
    sizes: dict[str, int] = {}  # anchor -> expanded values of its node
    top_key = None  # the top-level key whose value is being read (named in the refusal)

    def add(n: int, event) -> None:
        nonlocal top_key
        if not stack:
            return
        frame = stack[-1]
        frame[1] += n
        if len(stack) == 1 and frame[2]:  # the document's top-level mapping: keys and values alternate
            if frame[3] and isinstance(event, yaml.ScalarEvent):
                top_key = event.value
            frame[3] = not frame[3]
        total = sum(f[1] for f in stack)
        if total > MAX_EXPANDED:
            name = f"{top_key}: " if top_key is not None else ""
            raise ConfigError([f"{name}YAML aliases expand to more than {MAX_EXPANDED} values (line "
                               f"{event.start_mark.line + 1}); a recipe value is a few keys, write them out"], where)

    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            if len(stack) >= MAX_DEPTH:
                mark = event.start_mark
                raise ConfigError([f"nested deeper than {MAX_DEPTH} levels at line {mark.line + 1}; a recipe is "
                                   "a mapping of keys, a few levels deep"], where)
            stack.append([event.anchor, 1, isinstance(event, yaml.MappingStartEvent), True])
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            anchor, n, _, _ = stack.pop()
            if anchor is not None:
                sizes[anchor] = n
            add(n, event)
        elif isinstance(event, yaml.ScalarEvent):
            if event.anchor is not None:
                sizes[event.anchor] = 1
            add(1, event)
        elif isinstance(event, yaml.AliasEvent):
            if event.anchor not in sizes and any(f[0] == event.anchor for f in stack):
                name = f"{top_key}: " if top_key is not None else ""
                raise ConfigError([f"{name}the YAML alias *{event.anchor} at line {event.start_mark.line + 1} is "
                                   f"inside its own anchor &{event.anchor} (a value that contains itself); write "
                                   "the value out"], where)
            add(sizes.get(event.anchor, 1), event)  # an undefined alias: the composer's own error follows


def _yaml_load(text: str, where: str, warnings: list[str] | None = None):
    import yaml

    loader = _loader()
    try:
        _walk_events(text, loader, where)
        data = yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader
        if warnings is not None:
            warnings.extend(loader.duplicates)
        return data
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or (str(exc).splitlines() or ["unreadable"])[0]
        problem = " ".join(str(problem).split())
        if problem.startswith("duplicate key"):
            raise ConfigError([f"{problem}{at}"], where) from None
        raise ConfigError([f"malformed YAML{at}: {problem}; fix the YAML syntax"], where) from None
    except (RecursionError, MemoryError, ValueError, OverflowError) as exc:
        # PyYAML's constructors raise plain Python errors on some values (e.g. an out-of-range timestamp)
        raise ConfigError([f"unreadable YAML ({type(exc).__name__}); fix the YAML syntax"], where) from None


def recipe_path(name: str) -> Path | None:
    p = RECIPES_DIR / f"{name}.yaml"
    return p if p.is_file() else None


def builtin_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")) if RECIPES_DIR.is_dir() else []


def _read_source(source, notes: list[str] | None = None) -> tuple[dict, str]:
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
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError([f"cannot read: {exc.strerror}; check the path"], str(path)) from None
    data = _yaml_load(_decode(raw, str(path)), str(path), notes)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"top level must be a mapping of keys (got {type(data).__name__}); "
                           "write `key: value` lines as in TRL's recipes"], str(path))
    return data, str(path)


def _kind_of(value) -> str:
    return kind_of(value)


def _accepts(kinds: list[str] | tuple[str, ...], value) -> bool:
    """Whether TRL's parser takes this YAML value for a field of these kinds (a quoted number for a number field
    included: it converts string values with the field's type, ogrpo/values.py)."""
    try:
        coerce("", value, kinds)
    except ValueError:
        return False
    return True


def _merge_overrides(data: dict, overrides: dict | None) -> list[tuple]:
    """Overrides into the recipe's data; returns (ogrpo key, recipe's value, override's) for each `ogrpo` dict
    value (the command line's options) that replaced another the recipe set."""
    replaced: list[tuple] = []
    if not overrides:
        return replaced
    for key, value in overrides.items():
        if value is None:
            continue
        if key == "ogrpo" and isinstance(value, dict):
            section = data.get("ogrpo")
            if section is None:
                section = {}
            if not isinstance(section, dict):
                continue  # the recipe's own `ogrpo:` is not a mapping: load_run_config reports it
            for k, v in value.items():
                if v is not None:
                    if section.get(k) is not None and section[k] != v:
                        replaced.append((k, section[k], v))
                    section[k] = v
            data["ogrpo"] = section
        elif key.startswith("ogrpo."):
            section = data.get("ogrpo") if data.get("ogrpo") is not None else {}
            if not isinstance(section, dict):
                continue
            section[key[len("ogrpo."):]] = value
            data["ogrpo"] = section
        else:
            data[key] = value
    return replaced


def load_run_config(source, overrides: dict | None = None) -> RunConfig:
    """Load, merge overrides (flat TRL keys; `ogrpo` dict or `ogrpo.KEY` for O-GRPO options), validate."""
    warnings: list[str] = []
    data, where = _read_source(source, warnings)
    replaced = _merge_overrides(data, overrides)
    problems: list[str] = []

    section = data.pop("ogrpo", None)
    if section is None:
        section = {}
    if not isinstance(section, dict):
        problems.append(f"ogrpo: must be a mapping of O-GRPO options (got {_kind_of(section)} {section!r:.40}); "
                        "write `ogrpo:` then indented `key: value` lines")
        section = {}

    def as_word(name: str, value, allowed):
        """An unquoted `off`/`no` read by YAML as a boolean, taken as the word where the setting's values are
        words (noted, so the quoting stays visible)."""
        word = bool_as_choice(value, allowed)
        if word is None:
            if isinstance(value, bool) and allowed:
                spelled = "on, yes or true" if value else "off, no or false"
                quoting[name] = f" (YAML reads an unquoted {spelled} as a boolean: quote the word)"
            return value
        warnings.append(f"{name}: YAML reads an unquoted {word} as {str(value).lower()}; taken as {word!r}")
        return word

    quoting: dict[str, str] = {}  # key -> the hint for a YAML boolean where a word was meant
    index = _field_index()
    for key in list(data):
        value = data[key]
        if not isinstance(key, str):
            problems.append(f"key {key!r} is not a string")
            continue
        info = index.get(key)
        if info is None:
            close = difflib.get_close_matches(key, list(index), n=1, cutoff=0.75)
            hint = f"did you mean {close[0]}?" if close else "remove it or move O-GRPO options under `ogrpo:`"
            problems.append(f"unknown key {key!r}: {hint}")
            continue
        if value is None and key in rules.NULL_MEANS:
            value, why = rules.NULL_MEANS[key]
            data[key] = value
            warnings.append(f"{key}: null mapped to {value!r} ({why})")
        if "bool" not in info["kinds"]:
            value = data[key] = as_word(key, value, choices(key))
        try:
            value = data[key] = coerce(key, value, info["kinds"])
        except ValueError as exc:
            problems.append(str(exc) + quoting.get(key, ""))
            continue
        out_of_range = range_problem(key, value) or choice_problem(key, value)
        if out_of_range:
            problems.append(out_of_range)
            continue
        r = rules.rule(key)
        if info["group"] == "other" and r is not None:
            origin = "open-r1's scripts" if key in rules.open_r1_keys() else "older TRL/transformers/accelerate"
            if r.kind in (rules.MAPPED, rules.PLANNED):
                if not _overridden(key, data, section):  # else _one_home names it
                    warnings.append(f"{key}: a key of {origin}, not of TRL 1.16; mapped to {r.target}")
            elif value is not None and value != r.default:
                warnings.append(f"{key}: a key of {origin}; not applied ({r.reason}); listed in the plan's changes")
    if not problems:
        _parse_json_mappings(data, problems)
        _map_renamed(data, problems)
    _one_home(data, section, warnings)
    _map_open_r1(data, section)

    opt_names = {f.name for f in fields(OgrpoOptions)}
    opts: dict = {}
    for key, value in section.items():
        if key not in opt_names:
            close = difflib.get_close_matches(str(key), sorted(opt_names), n=1, cutoff=0.6)
            hint = f"did you mean ogrpo.{close[0]}?" if close else f"known: {', '.join(sorted(opt_names))}"
            problems.append(f"unknown key ogrpo.{key}: {hint}")
            continue
        if value is not None:
            value = as_word(f"ogrpo.{key}", value, OPTION_CHOICES.get(key, ()))
            try:
                value = coerce(f"ogrpo.{key}", value, _OGRPO_KINDS[key])
            except ValueError as exc:
                problems.append(str(exc) + quoting.get(f"ogrpo.{key}", ""))
                continue
            bad = range_problem(f"ogrpo.{key}", value) if isinstance(value, float) else None
            if bad:
                problems.append(bad)
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
    return RunConfig(trl=data, ogrpo=OgrpoOptions(**opts), source=where, warnings=warnings, replaced=replaced)


# recipe keys that have a home under `ogrpo:` too: the trainer reads the `ogrpo:` one
_OGRPO_HOMES = {"system_prompt": "system_prompt", "dataset_prompt_column": "prompt_column",
                "max_prompt_length": "max_prompt_length", "reward_weights": "reward_weights"}


def _overridden(key: str, data: dict, section: dict) -> bool:
    home = _OGRPO_HOMES.get(key)
    return home is not None and data.get(key) is not None and section.get(home) not in (None, data[key])


def _one_home(data: dict, section: dict, warnings: list[str]) -> None:
    """A key set both at the top and under `ogrpo:` to different values: the `ogrpo:` one is applied, and the
    warning says the other is not."""
    for key, home in _OGRPO_HOMES.items():
        if _overridden(key, data, section):
            warnings.append(f"{key}: {data[key]!r:.40} is not applied: ogrpo.{home} ({section[home]!r:.40}) is, "
                            "where the recipe sets both")


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


# Mapping-valued fields that TRL (GRPOConfig's _VALID_DICT_FIELDS) also takes as a JSON object string, which it
# parses in __post_init__. O-GRPO's planner and trainer read them before that: parsed here, the same way, so that
# a dtype in `model_init_kwargs: '{"dtype": "bfloat16"}'` is planned for and not a traceback at job start.
JSON_MAPPINGS = ("model_init_kwargs", "gradient_checkpointing_kwargs", "lr_scheduler_kwargs", "generation_kwargs",
                 "chat_template_kwargs")


def _parse_json_mappings(data: dict, problems: list[str]) -> None:
    for key in JSON_MAPPINGS:
        value = data.get(key)
        if not isinstance(value, str):
            continue
        try:
            parsed = json.loads(value) if value.startswith("{") else None
        except ValueError as exc:
            problems.append(f"{key}: {value!r:.60} is not valid JSON ({exc.msg}); write it as a YAML mapping")
            continue
        if isinstance(parsed, dict):
            data[key] = parsed
        else:
            problems.append(f"{key}: {value!r:.60} is no mapping; write `key: value` lines under it, or a JSON "
                            "object string")


def _map_renamed(data: dict, problems: list[str]) -> None:
    """Older names (ogrpo/fields.py RENAMED) carried to today's key, so the planner, the checks and the trainer
    read one key."""
    for old, new in rules.RENAMED.items():
        # both set to different values: today's key is applied and the plan lists the older one as changed
        if data.get(old) is not None and data.get(new) is None:
            data[new] = data[old]
    reentrant = data.get("gradient_checkpointing_use_reentrant")
    if reentrant is not None:
        kwargs = data.get("gradient_checkpointing_kwargs")
        if kwargs is None:
            data["gradient_checkpointing_kwargs"] = {"use_reentrant": reentrant}
        elif isinstance(kwargs, dict) and kwargs.get("use_reentrant", reentrant) != reentrant:
            problems.append("gradient_checkpointing_use_reentrant and gradient_checkpointing_kwargs.use_reentrant "
                            "differ; keep gradient_checkpointing_kwargs only")


def _check_values(data: dict, opts: dict, problems: list[str]) -> None:
    """Rules across keys, and the ranges of O-GRPO's own options (each TRL key's range: ogrpo/values.py)."""
    if data.get("bf16") is True and data.get("fp16") is True:
        problems.append("bf16 and fp16 are both true; set only one (the plan picks per GPU when neither is set)")
    for key, low in (("step_time_s", 0.0), ("cpus_per_gpu", 1), ("max_prompt_length", 1)):
        v = opts.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not (v > 0 if low == 0 else v >= low):
            problems.append(f"ogrpo.{key}: must be {'positive' if low == 0 else f'at least {low}'} (got {v})")
    rw = data.get("reward_weights")
    if isinstance(rw, list) and not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                        and math.isfinite(x) for x in rw):
        problems.append(f"reward_weights: must be a list of finite numbers (got {rw!r:.60})")
    for key, words in OPTION_CHOICES.items():
        if key == "sandbox":
            continue  # its own message below: what `none` means
        value = opts.get(key)
        if value is not None and value not in words:
            close = difflib.get_close_matches(str(value), words, n=1)
            problems.append(f"ogrpo.{key}: {value!r} is not one of {', '.join(words)}"
                            + (f" (did you mean {close[0]}?)" if close else ""))
    sandbox = opts.get("sandbox")
    if sandbox is not None and sandbox not in SANDBOXES:
        problems.append(f"ogrpo.sandbox: {sandbox!r} is not one of auto, none (none runs model-written programs "
                        "without isolation)")
    vg = opts.get("vllm_gpus")
    if vg is not None:
        try:
            if int(vg) < 0:
                problems.append(f"ogrpo.vllm_gpus: must be 0 or more (got {vg})")
        except (TypeError, ValueError):
            problems.append(f"ogrpo.vllm_gpus: expected an integer (got {vg!r})")
    rw = opts.get("reward_weights")
    if isinstance(rw, list) and not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                        and math.isfinite(x) for x in rw):
        problems.append("ogrpo.reward_weights: must be a list of finite numbers")
    if "params" in opts and opts["params"] is not None:
        try:
            parse_params(opts["params"])
        except OgrpoError as exc:
            problems.append(f"ogrpo.{exc}".replace("ogrpo.--params", "ogrpo.params"))
    if "gpus" in opts and opts["gpus"] is not None:
        try:
            parse_gpus(str(opts["gpus"]))
        except OgrpoError as exc:
            problems.append(f"ogrpo.gpus: {exc}")
    sha = opts.get("data_sha256")
    if isinstance(sha, str) and not re.fullmatch(r"[0-9a-fA-F]{64}", sha):
        problems.append(f"ogrpo.data_sha256: {sha!r:.80} is not a SHA-256 (64 hex digits: the `data.sha256` of a "
                        "run's manifest)")
    _check_job_text(opts, problems)


# What reaches job.sbatch as an `#SBATCH` value, a header comment or a step's environment is one line: a line break
# there would end the directive or comment and make the rest a command of the batch script.
MULTILINE_OPTIONS = frozenset({"system_prompt"})  # the recipe's text, handed to the trainer as data
_SLURM_NAME = re.compile(r"[A-Za-z0-9_.\-]+(,[A-Za-z0-9_.\-]+)*")  # partition, account, qos (lists: a,b)
_SLURM_MEM = re.compile(r"[0-9]+[KMGTkmgt]?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_job_text(opts: dict, problems: list[str]) -> None:
    """O-GRPO's text options: no control characters (but the system prompt); Slurm's names and memory in its
    syntax; ogrpo.env names that a shell and Slurm take, values of one line."""
    for key, value in opts.items():
        if isinstance(value, str) and key not in MULTILINE_OPTIONS and control_character(value) is not None:
            problems.append(f"ogrpo.{key}: {value!r} holds a control character "
                            f"({control_character(value)!r}); it goes into job.sbatch, one line per option")
            opts[key] = None  # reported: the checks below would only repeat it
    for key in ("partition", "account", "qos"):
        value = opts.get(key)
        if isinstance(value, str) and not _SLURM_NAME.fullmatch(value.strip()):
            problems.append(f"ogrpo.{key}: {value!r} is not a Slurm {key} name (letters, digits, _ . -; a list "
                            "separated by commas)")
    mem = opts.get("mem_per_gpu")
    if isinstance(mem, str) and not _SLURM_MEM.fullmatch(mem.strip()):
        problems.append(f"ogrpo.mem_per_gpu: {mem!r} is not a Slurm memory size: a whole number with an optional "
                        "unit K, M, G or T (e.g. 40G)")
    env = opts.get("env")
    for name, value in (env.items() if isinstance(env, dict) else ()):
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            problems.append(f"ogrpo.env: {name!r} is not an environment variable name (letters, digits and _, "
                            "not starting with a digit)")
        elif isinstance(value, (dict, list)) or value is None:
            problems.append(f"ogrpo.env.{name}: expected a string or number, got {kind_of(value)}")
        elif control_character(str(value)) is not None:
            problems.append(f"ogrpo.env.{name}: {str(value)!r} holds a control character; environment values "
                            "in job.sbatch are one line")


# --- the vendored TRL field table -------------------------------------------------------------------------


def _declared_type(cls, field):
    """A dataclass field's annotation as its class declares it. transformers' HfArgumentParser rewrites
    `Field.type` in place (Optional[X] becomes X), so once any parser of these classes was built in this process
    `dataclasses.fields()` no longer says that a field takes None; the class's own annotations still do."""
    for klass in cls.__mro__:
        annotations = klass.__dict__.get("__annotations__", {})
        if field.name in annotations:
            return annotations[field.name]
    return field.type


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
            declared = _declared_type(cls, f)
            table[f.name] = {"kinds": kinds_from_type(declared if isinstance(declared, str) else str(declared)),
                             "default": default}
        out[name] = table
    return out


if __name__ == "__main__":  # python -m ogrpo.config --regen-fields
    import sys

    if "--regen-fields" in sys.argv:
        FIELDS_FILE.write_text(json.dumps(field_table_from_trl(), indent=1, sort_keys=True) + "\n")
        print(f"wrote {FIELDS_FILE}")
