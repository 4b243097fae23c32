"""Reward functions by name (open-r1's set with its meaning, TRL's names, the tiny task's), or a user function
by import path (`package.module:function`, TRL's dotted `package.module.function`) or file path
(`path/to/file.py:function`).

Two stages, because `ogrpo plan` must stay fast and import nothing heavy:
- `check_rewards` (plan/render/submit time): names against the table below, import paths found with
  `importlib.util.find_spec` and file paths read with `ast` — nothing is executed, no torch/trl/math_verify.
- `resolve_rewards` (trainer): imports the implementation and builds it with the recipe's parameters.
Reward functions follow TRL's signature: `f(completions, prompts=..., **dataset_columns) -> list[float | None]`.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ogrpo.config import _accepts  # the one rule for "does a YAML value fit this kind"
from ogrpo.errors import ConfigError, OgrpoError
from ogrpo.local_paths import local_path


@dataclass(frozen=True)
class Reward:
    """One registry entry: where the implementation lives, how the recipe parameterises it, what it reads."""

    target: str  # "module:attr" of the function, or of the factory when `params` is set
    params: dict[str, str] = field(default_factory=dict)  # factory argument -> recipe key
    columns: tuple[str, ...] = ()  # dataset columns the reward needs (checked against the dataset at plan time)
    fixed: dict = field(default_factory=dict)  # factory arguments that are not recipe keys


_M, _T, _C = "ogrpo.rewards.math", "ogrpo.rewards.text", "ogrpo.rewards.code"
_CODE_PARAMS = {"language": "code_language", "num_parallel": "parallel_code_exec_per_proc",
                "enforce_same_language": "enforce_same_language"}

REWARDS: dict[str, Reward] = {
    "accuracy": Reward(f"{_M}:accuracy_reward", columns=("solution",)),
    "format": Reward(f"{_T}:format_reward"),
    "soft_format": Reward(f"{_T}:soft_format_reward"),
    "tag_count": Reward(f"{_T}:tag_count_reward"),
    "reasoning_steps": Reward(f"{_T}:reasoning_steps_reward"),
    # open-r1's zero-math-code branch (R1-Zero recipes): a lone <think>...</think> block after optional
    # whitespace, and `accuracy` on the text after the last </think>.
    "think_format": Reward(f"{_T}:think_format_reward"),
    "think_accuracy": Reward(f"{_M}:think_accuracy_reward", columns=("solution",)),
    "length": Reward(f"{_M}:len_reward", columns=("solution",)),
    "cosine": Reward(f"{_M}:get_cosine_scaled_reward", columns=("solution",), params={
        "min_value_wrong": "cosine_min_value_wrong", "max_value_wrong": "cosine_max_value_wrong",
        "min_value_correct": "cosine_min_value_correct", "max_value_correct": "cosine_max_value_correct",
        "max_len": "cosine_max_len"}),
    "repetition_penalty": Reward(f"{_T}:get_repetition_penalty_reward", params={
        "ngram_size": "repetition_n_grams", "max_penalty": "repetition_max_penalty"}),
    "soft_overlong_punishment": Reward(f"{_T}:get_soft_overlong_punishment", params={
        "max_completion_len": "max_completion_len", "soft_punish_cache": "soft_punish_cache"}),
    # The code rewards (sandboxed, ogrpo/rewards/code.py) are plain functions; the recipe's values are bound
    # as keywords, only those the function names, as open-r1 binds them with functools.partial. A dataset column of
    # the same name (`language`) still wins: call-time keywords override a partial's.
    "code": Reward(f"{_C}:code_reward", columns=("verification_info",)),
    "binary_code": Reward(f"{_C}:binary_code_reward", columns=("verification_info",)),
    "code_format": Reward(f"{_C}:code_format_reward"),
    "tiny_letter": Reward("ogrpo.tiny:letter_reward"),
    # TRL's `trl grpo` names (trl/scripts/grpo.py), so its recipes run unchanged; the overlong values are that
    # script's fixed ones.
    "accuracy_reward": Reward("trl.rewards:accuracy_reward", columns=("solution",)),
    "reasoning_accuracy_reward": Reward("trl.rewards:reasoning_accuracy_reward", columns=("solution",)),
    "think_format_reward": Reward("trl.rewards:think_format_reward"),
    "get_soft_overlong_punishment": Reward("trl.rewards:get_soft_overlong_punishment",
                                           fixed={"max_completion_len": 1280, "soft_punish_cache": 256}),
}
ALIASES = {"len": "length"}
# The reward modules' paths before they moved out of ogrpo/train/: a recipe naming a function by one
# (`ogrpo.train.math_rewards:accuracy_reward`) still gets it.
MOVED = {"ogrpo.train.rewards": "ogrpo.rewards.registry", "ogrpo.train.text_rewards": "ogrpo.rewards.text",
         "ogrpo.train.math_rewards": "ogrpo.rewards.math", "ogrpo.train.code_rewards": "ogrpo.rewards.code",
         "ogrpo.train.formats": "ogrpo.rewards.formats"}
# What open-r1's grpo.py uses when a recipe sets no reward_funcs (GRPOScriptArguments' default); TRL's script
# has none and fails. Its older recipes (e.g. config_demo.yaml before reward_funcs existed) rely on it.
DEFAULT_REWARDS = ("accuracy", "format", "tag_count")
CODE_REWARDS = ("code", "binary_code", "code_format")

# open-r1's GRPOScriptArguments defaults (src/open_r1/configs.py) with the kind a recipe value must have.
RECIPE_PARAMS: dict[str, tuple[tuple[str, ...], object]] = {
    "cosine_min_value_wrong": (("float",), 0.0),
    "cosine_max_value_wrong": (("float",), -0.5),
    "cosine_min_value_correct": (("float",), 0.5),
    "cosine_max_value_correct": (("float",), 1.0),
    "cosine_max_len": (("int",), 1000),
    "repetition_n_grams": (("int",), 3),
    "repetition_max_penalty": (("float",), -1.0),
    "code_language": (("str",), "python"),
    "parallel_code_exec_per_proc": (("int",), 2),
    "enforce_same_language": (("bool",), False),
    "max_completion_len": (("int",), 16384),
    "soft_punish_cache": (("int",), 4096),
}
RECIPE_KEYS = frozenset(RECIPE_PARAMS)  # open-r1 keys this module gives their meaning (config.py: not "ignored")

# open-r1 names whose only implementations call remote judges (Piston, Morph); a site plugs one in by path.
# Refused on purpose: what open-r1 does with each (src/open_r1/rewards.py and utils/competitive_programming).
REMOTE_ONLY = {
    "ioi_code": "IOI problems: open-r1 compiles each C++ submission and runs it on the subtask's tests (the "
                "row's test_cases, else the open-r1/ioi-test-cases data set) on a Piston or Morph execution "
                "service found through PISTON_ENDPOINTS or MORPH_API_KEY",
    "cf_code": "Codeforces problems: open-r1 runs each submission on the row's official_tests plus the generated "
               "tests in CF_TESTS_FOLDER on a Piston execution service found through PISTON_ENDPOINTS",
}
REMOTE_INSTEAD = ("O-GRPO neither runs nor calls such a service, so the name is refused; instead use `code` or "
                  "`binary_code` (programs run in O-GRPO's local sandbox on test cases in a `verification_info` "
                  "column, {\"test_cases\": [{\"input\": ..., \"output\": ...}]}, as in "
                  "open-r1/verifiable-coding-problems-python), or name your own function that calls your judge "
                  "as `package.module:function`")


def _known() -> str:
    return ", ".join([*REWARDS, *ALIASES])


def _canonical(spec: str) -> str:
    return ALIASES.get(spec, spec)


def is_path_spec(spec: str) -> bool:
    return ":" in spec or "." in spec


def _split(spec: str) -> tuple[str, str]:
    """(module or file, attribute) of an import/file path; a reward module's old path becomes its new one."""
    if ":" in spec:
        target, _, attr = spec.rpartition(":")
    else:
        target, _, attr = spec.rpartition(".")
    return MOVED.get(target, target), attr


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


# --- plan time: check without importing ------------------------------------------------------------------------


def _syntax_problem(source: str) -> str | None:
    """`does not parse as Python 3.x (line N: why)`, or None for a source that parses."""
    import ast

    try:
        ast.parse(source)
    except SyntaxError as exc:
        return (f"does not parse as Python {sys.version_info.major}.{sys.version_info.minor} (line {exc.lineno}: "
                f"{exc.msg})")
    except ValueError as exc:  # a NUL byte in the source
        return f"does not parse as Python ({exc})"
    return None


def _defines(source: str, attr: str) -> bool | None:
    """Whether a module's source binds `attr` at top level; None when it cannot tell (star import, __getattr__)."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return None
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    lazy = _lazy_names(tree)
    if lazy is not None:
        return attr.split(".")[0] in names | lazy
    if "__getattr__" in names:
        return None
    return attr.split(".")[0] in names


def _constants(node) -> set[str]:
    import ast

    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _lazy_names(tree) -> set[str] | None:
    """The attributes a lazy module resolves on access (transformers' and TRL's `_LazyModule` over
    `_import_structure`: its submodules, the names listed for each, `extra_objects`, and what `if TYPE_CHECKING:`
    imports); None when the module is not one. Read from the source: the module is not executed."""
    import ast

    if not any(isinstance(n, ast.Name) and n.id == "_LazyModule" for n in ast.walk(tree)):
        return None

    def is_structure(node) -> bool:
        return isinstance(node, ast.Name) and node.id == "_import_structure"

    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(is_structure(t) for t in node.targets):
            names |= _constants(node.value)  # _import_structure = {"submodule": ["name", ...]}
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Subscript) and is_structure(t.value)
                                                  for t in node.targets):
            for t in node.targets:
                names |= _constants(t.slice)
            names |= _constants(node.value)  # _import_structure["submodule"] = ["name", ...]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("append", "extend") and isinstance(node.func.value, ast.Subscript)
              and is_structure(node.func.value.value)):
            names |= _constants(node.func.value.slice) | {c for a in node.args for c in _constants(a)}
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_LazyModule":
            for kw in node.keywords:
                if kw.arg == "extra_objects" and isinstance(kw.value, ast.Dict):
                    names |= {k.value for k in kw.value.keys if isinstance(k, ast.Constant)}
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in ast.walk(ast.Module(body=node.body, type_ignores=[])):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names.update((a.asname or a.name).split(".")[0] for a in sub.names)
    return names


def _find_module(target: str):
    """importlib's spec for a dotted module name without executing any package on the way: the top-level name
    through the import system's finders, each submodule through its parent's __path__ (a package's __init__ may
    import torch; `ogrpo plan` must not). Falls back to importlib.util.find_spec, which imports the parents, for
    packages whose submodules a custom finder provides."""
    from importlib.machinery import PathFinder

    parts = target.split(".")
    if parts[0] in sys.modules or any(not p.isidentifier() for p in parts):
        return importlib.util.find_spec(target)
    spec = importlib.util.find_spec(parts[0])
    for i in range(1, len(parts)):
        if spec is None or not spec.submodule_search_locations:
            break
        spec = PathFinder.find_spec(".".join(parts[:i + 1]), list(spec.submodule_search_locations))
    else:
        if spec is not None:
            return spec
    return importlib.util.find_spec(target)


def _check_path(spec: str, base_dirs: list[Path]) -> tuple[str, str | None]:
    """(spec with a file path made absolute, problem or None)."""
    target, attr = _split(spec)
    if not attr or not target:
        return spec, f"reward {spec!r}: expected `package.module:function` or `path/to/file.py:function`"
    if _is_file(target):
        path = local_path(target, base_dirs, Path.is_file)
        if path is None:
            return spec, f"reward {spec!r}: file {target} does not exist (looked in {', '.join(map(str, base_dirs))})"
        spec = f"{path.resolve()}:{attr}"
        source = path.read_text(errors="replace")
        where = f"file {target}"
    else:
        sys.path.insert(0, os.getcwd())  # TRL's script does the same for dotted paths
        try:
            found = _find_module(target)
        except Exception as exc:  # a parent package failed to import, or the name is malformed
            found, why = None, f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        else:
            why = "not found"
        finally:
            sys.path.pop(0)
        if found is None:
            return spec, (f"reward {spec!r}: cannot import module {target!r} ({why}); check the path and that "
                          "the module is on PYTHONPATH")
        loaded = _loaded_attr(target, attr)
        if loaded is not None:
            return spec, None if loaded == "callable" else _attr_problem(spec, f"module {target!r}", attr, loaded)
        origin = found.origin or ""
        if not origin.endswith(".py"):
            return spec, None  # a compiled or namespace module: checked when the trainer imports it
        source = Path(origin).read_text(errors="replace")
        where = f"module {target!r}"
    unparsable = _syntax_problem(source)
    if unparsable:
        return spec, f"reward {spec!r}: {where} {unparsable}; the trainer could not import it"
    if _defines(source, attr) is False:
        return spec, _attr_problem(spec, where, attr, "missing")
    if _binds_value(source, attr):
        return spec, _attr_problem(spec, where, attr, "not callable")
    return spec, None


def _attr_problem(spec: str, where: str, attr: str, what: str) -> str:
    if what == "missing":
        return f"reward {spec!r}: {where} has no attribute {attr!r}; check the function name after the colon"
    return f"reward {spec!r}: {attr!r} of {where} is not callable ({what}); point at a function"


def _loaded_attr(target: str, attr: str) -> str | None:
    """"callable", "missing" or the type name of a non-callable, for a module this process has imported already
    (os, os.path, the standard library's: their sources re-export with `import *`, which the source reading cannot
    follow); read from the module's own namespace, so nothing runs (no lazy import, no module __getattr__). None
    when the module is not loaded, or when only running its __getattr__ could tell."""
    import types

    module = sys.modules.get(target)
    if module is None or type(module) is not types.ModuleType:  # a lazy module resolves names on access
        return None
    namespace = vars(module)
    head, *rest = attr.split(".")
    if head not in namespace:
        return None if "__getattr__" in namespace else "missing"
    value = namespace[head]
    for part in rest:  # Class.method: plain attribute reads on what the module holds
        try:
            value = getattr(value, part)
        except Exception:  # noqa: BLE001 - a descriptor's own error: the trainer's import reports it
            return "missing"
    return "callable" if callable(value) else type(value).__name__


def _binds_value(source: str, attr: str) -> bool:
    """Whether a module's source binds `attr` only to literal values (a string, a number, a list...), never to a
    function, a class or an import: such a name cannot be a reward function."""
    import ast

    if "." in attr:
        return False
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    literal = (ast.Constant, ast.List, ast.Tuple, ast.Dict, ast.Set, ast.JoinedStr, ast.ListComp, ast.DictComp,
               ast.SetComp)
    literal_targets = set()  # the Name nodes of top-level `attr = <literal>`
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, literal):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            literal_targets |= {id(t) for t in targets if isinstance(t, ast.Name) and t.id == attr}
    if not literal_targets:
        return False
    for node in ast.walk(tree):  # any other binding anywhere (a def, an import, a branch, a global): cannot tell
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == attr:
            return False
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (a.asname or a.name).split(".")[0] == attr or a.name == "*" for a in node.names):
            return False
        if isinstance(node, ast.Name) and node.id == attr and isinstance(node.ctx, ast.Store) \
                and id(node) not in literal_targets:
            return False
        if isinstance(node, ast.Global) and attr in node.names:
            return False
    return True


def _param_problems(names: list[str], trl: dict) -> list[str]:
    problems = []
    keys = {key for n in names for key in REWARDS[n].params.values()}
    if any(n in CODE_REWARDS for n in names):
        keys |= set(_CODE_PARAMS.values())
    for key in sorted(keys):
        kinds, _ = RECIPE_PARAMS[key]
        value = trl.get(key)
        if value is not None and not _accepts(kinds, value):
            problems.append(f"{key}: expected {' or '.join(kinds)}, got {value!r}")
    pen = trl.get("repetition_max_penalty")
    if "repetition_penalty" in names and isinstance(pen, (int, float)) and pen > 0:
        problems.append(f"repetition_max_penalty: {pen} must be 0 or negative (it is a penalty)")
    return problems


def check_rewards(trl: dict, weights=None, base_dirs: list[Path] | None = None) -> list[str]:
    """Check `reward_funcs` (and weights, parameters) without importing any implementation.

    Returns the specs with file paths made absolute (so a job started in another directory finds them), open-r1's
    DEFAULT_REWARDS when none are set; raises ConfigError listing every problem.
    """
    specs = trl.get("reward_funcs")
    if specs is None:
        specs = list(DEFAULT_REWARDS)
    if specs == []:
        raise ConfigError(["no reward functions: set reward_funcs (e.g. [accuracy, format] or my_pkg.rewards:score)"],
                          "reward_funcs")
    if isinstance(specs, str):
        specs = [specs]
    base_dirs = base_dirs or [Path.cwd()]
    problems: list[str] = []
    out: list[str] = []
    names: list[str] = []
    for spec in specs:
        if not isinstance(spec, str) or not spec.strip():
            problems.append(f"{spec!r} is not a reward name; use one of {_known()} or a `package.module:function` "
                            "path")
            continue
        spec = spec.strip()
        if _canonical(spec) in REWARDS:
            names.append(_canonical(spec))
            out.append(spec)
        elif spec in REMOTE_ONLY:
            problems.append(f"reward {spec!r} needs a remote judge ({REMOTE_ONLY[spec]}): {REMOTE_INSTEAD}")
        elif is_path_spec(spec):
            spec, problem = _check_path(spec, base_dirs)
            out.append(spec)
            if problem:
                problems.append(problem)
        else:
            close = difflib.get_close_matches(spec, [*REWARDS, *ALIASES], n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.append(f"unknown reward {spec!r}: {hint}use one of {_known()} or a `package.module:function` "
                            "path")
    if weights is not None and len(weights) != len(specs):
        problems.append(f"reward_weights has {len(weights)} entries for {len(specs)} reward functions; give one "
                        "weight per entry of reward_funcs")
    problems += _param_problems(names, trl)
    if problems:
        raise ConfigError(problems, "reward_funcs")
    return out


def required_columns(specs) -> dict[str, list[str]]:
    """Dataset column -> the reward names that read it (registry rewards only; user functions are opaque)."""
    out: dict[str, list[str]] = {}
    for spec in [specs] if isinstance(specs, str) else (specs or []):
        entry = REWARDS.get(_canonical(str(spec).strip()))
        for col in entry.columns if entry else ():
            out.setdefault(col, []).append(str(spec))
    return out


# --- trainer: import and build ---------------------------------------------------------------------------------


def recipe_params(trl: dict | None) -> dict:
    """The reward parameters a recipe sets, over open-r1's defaults."""
    trl = trl or {}
    return {k: (trl[k] if trl.get(k) is not None else default) for k, (_, default) in RECIPE_PARAMS.items()}


def _import(target: str, spec: str):
    mod_name, _, attr = target.rpartition(":")
    try:
        if _is_file(mod_name):
            module = _import_file(Path(mod_name).expanduser())
        else:
            sys.path.insert(0, os.getcwd())
            try:
                module = importlib.import_module(mod_name)
            finally:
                sys.path.pop(0)
    except OgrpoError:
        raise
    except Exception as exc:  # ImportError, or the module's own import-time error
        why = (str(exc).strip().splitlines() or [""])[0]
        hint = ""
        if isinstance(exc, ImportError) and getattr(exc, "name", None) in ("math_verify", "latex2sympy2_extended"):
            hint = " (pip install math-verify==0.9.0 latex2sympy2_extended==1.11.0)"
        raise OgrpoError(f"reward {spec!r}: cannot import module {mod_name!r} ({type(exc).__name__}: {why}){hint}; "
                         "check the path and that the module is on PYTHONPATH") from None
    func = module
    for part in attr.split("."):
        func = getattr(func, part, None)
        if func is None:
            raise OgrpoError(f"reward {spec!r}: module {mod_name!r} has no attribute {attr!r}; "
                             "check the function name after the colon")
    if not callable(func):
        raise OgrpoError(f"reward {spec!r}: {attr!r} is not callable; point at a function")
    return func


def _import_file(path: Path):
    if not path.is_file():
        raise OgrpoError(f"reward file {path} does not exist; fix the path in reward_funcs")
    name = f"ogrpo_user_rewards_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # so the file can import its neighbours
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _build(name: str, params: dict) -> Callable:
    import functools
    import inspect

    entry = REWARDS[name]
    target = _import(entry.target, name)
    try:
        if entry.params or entry.fixed:
            return target(**entry.fixed, **{arg: params[key] for arg, key in entry.params.items()})
        if name in CODE_REWARDS:
            accepted = inspect.signature(target).parameters
            bound = {arg: params[key] for arg, key in _CODE_PARAMS.items() if arg in accepted}
            return functools.update_wrapper(functools.partial(target, **bound), target) if bound else target
    except (TypeError, ValueError) as exc:
        raise OgrpoError(f"reward {name!r}: {exc}; fix its parameters in the run config") from None
    return target


def resolve_reward(spec: str, params: dict | None = None) -> Callable:
    """A registry name or an import/file path → the callable (parameterised by the recipe's values)."""
    if not isinstance(spec, str) or not spec.strip():
        raise OgrpoError(f"reward_funcs: {spec!r} is not a reward name; use one of {_known()} "
                         "or a `package.module:function` path")
    spec = spec.strip()
    if _canonical(spec) in REWARDS:
        return _build(_canonical(spec), recipe_params(params))
    if is_path_spec(spec) and spec not in REMOTE_ONLY:
        target, attr = _split(spec)
        return _import(f"{target}:{attr}", spec)
    # The plan-time check gives the one-line message for everything else.
    check_rewards({"reward_funcs": [spec]})
    raise OgrpoError(f"unknown reward {spec!r}")  # not reached: check_rewards raised


def named(func: Callable, name: str) -> Callable:
    """A wrapper carrying `name` as __name__, which TRL uses for the `rewards/<name>/mean` metric."""
    import inspect

    if inspect.iscoroutinefunction(func):  # TRL runs async reward functions concurrently; keep them async
        async def reward(*args, **kwargs):
            return await func(*args, **kwargs)
    else:
        def reward(*args, **kwargs):
            return func(*args, **kwargs)

    reward.__name__ = reward.__qualname__ = re.sub(r"[^A-Za-z0-9_]", "_", name.split(":")[-1].split("/")[-1])
    reward.__doc__ = func.__doc__
    return reward


def resolve_rewards(specs, weights=None, params: dict | None = None) -> tuple[list[Callable], list[float] | None]:
    """(callables, weights) for TRL; `params` is the run config's flat keys (cosine_*, repetition_*, ...)."""
    if specs is None:
        specs = list(DEFAULT_REWARDS)
    if specs == []:
        raise OgrpoError("no reward functions: set reward_funcs in the run config (e.g. [accuracy, format] "
                         "or my_pkg.rewards:score)")
    if isinstance(specs, str):
        specs = [specs]
    funcs = [named(resolve_reward(s, params), s) for s in specs]
    if weights is not None:
        if len(weights) != len(funcs):
            raise OgrpoError(f"reward_weights has {len(weights)} entries for {len(funcs)} reward functions; "
                             "give one weight per entry of reward_funcs")
        weights = [float(w) for w in weights]
    return funcs, weights
