"""The typed plan (ogrpo/planner/types.py): `Plan.from_dict(p.to_dict()) == p` with its changes, settings and fixes as
dataclasses, the JSON form unchanged, a damaged plan as one error; and no code outside the planner reading plan
data as a dict (an `ast` scan of ogrpo/)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from ogrpo.config import load_run_config
from ogrpo.errors import OgrpoError
from ogrpo.plan import plan_from_config
from ogrpo.planner.types import Change, Fix, Plan, Setting

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ogrpo"
RECIPES = sorted((PACKAGE / "recipes").glob("*.yaml"))
GPUS = ("cpu", "2xcpu", "3xA40", "4xV100-32G")
# A 32B recipe on one A40 does not fit: its plan carries fixes (fix_actions) to round-trip.
TOO_BIG = (REPO / "tests" / "data" / "recipes" / "openr1_openr1-zero-32b-math_config_v00.00.yaml", "2xA40")


def _plans():
    cases = [(recipe, gpus) for recipe in RECIPES for gpus in GPUS] + [TOO_BIG]
    for recipe, gpus in cases:
        yield f"{recipe.stem}@{gpus}", plan_from_config(load_run_config(str(recipe)), gpus=gpus)


def test_every_recipe_round_trips_through_its_json_form():
    assert len(RECIPES) >= 3
    seen = {"changes": 0, "settings": 0, "fix_actions": 0}
    for name, p in _plans():
        d = p.to_dict()
        back = Plan.from_dict(json.loads(json.dumps(d)))  # what a manifest or run.yaml hands back
        assert back == p, name
        assert back.to_dict() == d, name
        assert all(type(c) is Change for c in back.changes), name
        assert all(type(s) is Setting for s in back.settings), name
        assert all(type(f) is Fix for f in back.fix_actions), name
        # the JSON keys stay those of the dict form: records written before the types compare with new ones
        assert all(set(c) == {"key", "from", "to", "reason"} for c in d["changes"]), name
        assert all(set(s) == {"name", "value", "reason"} for s in d["settings"]), name
        assert all(set(f) == {"text", "config", "cli"} for f in d["fix_actions"]), name
        assert [f.text for f in back.fix_actions] == back.fixes, name
        for key in seen:
            seen[key] += len(getattr(p, key))
    assert all(seen.values()), seen  # every list was exercised with something in it


def test_the_json_form_names_each_field_as_before():
    c = Change("bf16", True, False, "V100: no bf16")
    assert c.to_dict() == {"key": "bf16", "from": True, "to": False, "reason": "V100: no bf16"}
    assert Change.from_dict(c.to_dict()) == c
    s = Setting("overlap", "one-step", "server on its own GPUs")
    assert s.to_dict() == {"name": "overlap", "value": "one-step", "reason": "server on its own GPUs"}
    f = Fix("4xA40", cli={"gpus": "4xA40"})
    assert Fix.from_dict(f.to_dict()) == f and f.to_dict() == {"text": "4xA40", "config": {}, "cli": {"gpus": "4xA40"}}
    p = plan_from_config(load_run_config(str(RECIPES[0])), gpus="3xA40")
    assert p.setting("overlap") == next(x.value for x in p.settings if x.name == "overlap")
    assert p.setting("no such setting", "dflt") == "dflt"
    assert p.change(p.changes[0].key) is p.changes[0] and p.change("no such key") is None


def test_a_damaged_plan_is_one_error():
    good = plan_from_config(load_run_config(str(RECIPES[0])), gpus="cpu").to_dict()
    for bad in ({}, {"vllm": {"args": {}}}, {**good, "cluster": {"gpu": {"is_cpu": True}}},
                {**good, "changes": [{"from": 1}]}, {**good, "trainer": "zero2"}, ["not", "a", "dict"]):
        with pytest.raises(OgrpoError, match="re-run `ogrpo render`"):
            Plan.from_dict(bad)


def test_a_section_has_no_dict_reads():
    p = plan_from_config(load_run_config(str(RECIPES[0])), gpus="3xA40")
    with pytest.raises(TypeError):
        p.trainer["strategy"]  # noqa: B018
    assert not hasattr(p.vllm, "get")


# ------------------------------------------------------------------------------------------------- the guard

# Names that hold the run's plan, and the plan's typed sections: `.get(` or `[...]` on them reads plan data as a dict.
PLAN_NAMES = {"plan", "splan", "vplan"}
SECTIONS = {"vllm", "trainer", "batch", "cluster", "model"}
# The typed insides: vLLM's arguments (plan.vllm.args), the kernels, the trainer arguments. Read by field.
INNER = {"args", "kernels", "trainer_args"}
ITEMS = {"changes", "settings", "fix_actions"}
# Plan fields that are enums (Strategy, Mode, Precision): compared to members, never to a string literal.
ENUM_FIELDS = {"strategy", "mode", "precision"}
DICT_METHODS = {"get", "pop", "keys", "values", "setdefault"}  # (TrainerArgs.items(): all of them, in order)
# Parsing the dict form is the planner's job (and the JSON-writing side's).
ALLOWED = ("ogrpo/planner/", "ogrpo/plan.py")
# The one function outside the planner that may change a finished plan, and why: `ogrpo bench overlap --broken`
# breaks its own one-step plan on purpose to show its check failing. The planner must never make that plan (it
# turns the correction back on for every one-step recipe), so the bench edits its copy after planning, and lists
# the edit in the plan's settings and changes, so that the run's manifest says what was broken and by whom.
DELIBERATE = {"ogrpo/bench/overlap.py": "broken_plan"}


def _is_plan(node: ast.AST, local_dicts: set[str], aliases: frozenset[str] = frozenset()) -> bool:
    """`plan`, `p.plan`, `(plan or {})`, `plan.trainer`, `plan.vllm.args`, `plan.kernels` ..., or a local bound to
    one of them (`vargs = p.plan.vllm.args`); a local built there as a dict literal is not the plan."""
    if isinstance(node, ast.Name):
        return (node.id in PLAN_NAMES or node.id in aliases) and node.id not in local_dicts
    if isinstance(node, ast.Attribute):
        return node.attr == "plan" or (node.attr in SECTIONS | INNER and _is_plan(node.value, local_dicts, aliases))
    if isinstance(node, ast.BoolOp):
        return _is_plan(node.values[0], local_dicts, aliases)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return _is_plan(node.func.value, local_dicts, aliases)  # plan.get("vllm").get(...)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and node.args:
        return _is_plan(node.args[0], local_dicts, aliases)  # dict(plan.vllm.args)
    return False


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _walk_scope(scope: ast.AST):
    """The nodes of one scope: ast.walk that does not enter nested functions (each is its own scope)."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, _SCOPES):
            todo.extend(ast.iter_child_nodes(node))


def _scope_facts(scope: ast.AST) -> tuple[set[str], set[str], frozenset[str]]:
    """(names assigned a dict literal in this scope, names bound to items of a `.changes`, `.settings` or
    `.fix_actions`, whatever holds them: a Plan under any name, a preemption policy's changes; names bound to an
    inner part of a plan: `vargs = p.plan.vllm.args`, `args = dict(vplan.args)`, `t = p.trainer`)."""
    local_dicts, items, aliases = set(), set(), set()
    for node in _walk_scope(scope):
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Dict, ast.DictComp)):
            local_dicts |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in _walk_scope(scope):
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
            it = node.iter
            if isinstance(it, ast.Attribute) and it.attr in ITEMS:  # p.changes, pol.changes, plan.settings ...
                items.add(node.target.id)
    for _ in range(2):  # an alias of an alias
        for node in _walk_scope(scope):
            if isinstance(node, ast.Assign) and not isinstance(node.value, ast.Name) and \
                    _is_plan(node.value, local_dicts, frozenset(aliases)):
                aliases |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return local_dicts, items, frozenset(aliases)


def _enum_field(node: ast.AST, local_dicts: set[str], aliases: frozenset[str]) -> bool:
    """`plan.mode`, `p.precision`, `plan.trainer.strategy`, `t.strategy` (t a plan's trainer) ..."""
    if not (isinstance(node, ast.Attribute) and node.attr in ENUM_FIELDS):
        return False
    owner = node.value
    return _is_plan(owner, local_dicts, aliases) or (isinstance(owner, ast.Name) and owner.id == "p")


def _is_str(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_is_str(e) for e in node.elts)


def dict_reads(source: str, filename: str = "<src>") -> list[str]:
    """Every `.get(`/`.pop(`/`.items(`..., subscript or `in` test on the plan, a section or inner part of it
    (vLLM's arguments, the kernels, the trainer arguments), or an item of its changes, settings or fixes; every
    setting looked up by a string (`plan.setting("overlap")`); every strategy, mode or precision compared to a
    string literal (`== "server"`, `.startswith("zero3")`), as `file:line: code`."""
    tree = ast.parse(source, filename=filename)
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, _SCOPES)]
    found: dict[tuple[int, int, int], str] = {}
    for scope in scopes:
        local_dicts, items, aliases = _scope_facts(scope)

        def flagged(node: ast.AST) -> bool:
            return _is_plan(node, local_dicts, aliases) or (isinstance(node, ast.Name) and node.id in items)

        for node in _walk_scope(scope):
            target, hit = None, False
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in DICT_METHODS:
                    target = node.func.value
                elif node.func.attr == "setting" and node.args and _is_str(node.args[0]):
                    hit = True  # a setting by name: the plan's typed property (plan.overlap ...) instead
                elif node.func.attr in ("startswith", "endswith"):
                    hit = _enum_field(node.func.value, local_dicts, aliases)
            elif isinstance(node, ast.Subscript):
                target = node.value
            elif isinstance(node, ast.Compare):
                if isinstance(node.ops[0], (ast.In, ast.NotIn)):
                    target = node.comparators[0]
                sides = [node.left, *node.comparators]
                hit = any(_enum_field(a, local_dicts, aliases) for a in sides) and any(_is_str(a) for a in sides)
            if hit or (target is not None and flagged(target)):
                found[(node.lineno, node.col_offset, -node.end_col_offset)] = \
                    f"{filename}:{node.lineno}: {ast.unparse(node)}"
    return [found[k] for k in sorted(found)]


def test_no_code_outside_the_planner_reads_plan_data_as_a_dict():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if not rel.startswith(ALLOWED):
            problems += dict_reads(path.read_text(), rel)
    assert problems == [], "plan data read as a dict (take the Plan, parsed once where it is loaded):\n" + \
        "\n".join(problems)


def test_the_guard_finds_each_way_of_reading_a_plan_dict():
    # the shapes the trainer, server, selftest and reproduce used before they took a Plan
    source = '''
def a(plan, p):
    x = (plan.get("vllm") or {}).get("args")
    y = (plan or {}).get("settings")
    z = p.plan["trainer"]["memory_terms"]
    w = plan.trainer.get("strategy")
    v = "is_cpu" in plan.cluster.gpu and "fits" in plan
    for item in plan.settings:
        item.get("name")
    rows = [[s["name"], s["value"]] for s in p.settings]
    return [c["key"] for c in p.plan.changes]

def fused(processors):
    plan = {"temperature": 1.0}  # a local dict that happens to be called plan
    plan["top_k"] = 0
    return plan.get("top_k")
'''
    lines = [line.split(": ", 1)[1] for line in dict_reads(source)]
    assert lines == ["(plan.get('vllm') or {}).get('args')", "plan.get('vllm')", "(plan or {}).get('settings')",
                     "p.plan['trainer']", "plan.trainer.get('strategy')", "'fits' in plan", "item.get('name')",
                     "s['name']", "s['value']", "c['key']"]  # not `plan.cluster.gpu` (a GPU's facts) nor the local dict in fused()


def test_the_guard_finds_each_way_of_reading_the_typed_insides():
    # the shapes the trainer, server, selftest, render and host-memory code used before the plan was typed inside
    source = '''
def b(p, plan, vplan, t):
    vargs = p.plan.vllm.args
    d = vargs.get("dtype")
    args = dict(vplan.args)
    gmu = args.pop("gpu_memory_utilization", None)
    k = plan.kernels.get("linear_logprobs")
    tf = plan.trainer_args["tf32"]
    o = plan.setting("overlap")
    s = plan.trainer.strategy == "ddp"
    z = plan.trainer.strategy.startswith("zero3")
    m = p.mode == "server"
    q = plan.precision in ("bf16", "fp16")
    return [x for x in plan.kernels.keys()]

def fine(plan, args, cfg):
    ok = plan.vllm.args.dtype, plan.kernels.linear_logprobs, plan.trainer.strategy is Strategy.ZERO3
    other = args.vllm_mode == "server", cfg.get("mode"), plan.overlap
    return plan.setting(name)
'''
    lines = [line.split(": ", 1)[1] for line in dict_reads(source)]
    assert lines == ["vargs.get('dtype')", "args.pop('gpu_memory_utilization', None)",
                     "plan.kernels.get('linear_logprobs')", "plan.trainer_args['tf32']", "plan.setting('overlap')",
                     "plan.trainer.strategy == 'ddp'", "plan.trainer.strategy.startswith('zero3')",
                     "p.mode == 'server'", "plan.precision in ('bf16', 'fp16')", "plan.kernels.keys()"]


def test_the_guard_fails_on_the_code_before_the_plan_was_typed_inside():
    """The same scan over ogrpo/ as of fabed8e (before this change) finds the dict reads and string compares."""
    import subprocess

    listing = subprocess.run(["git", "-C", str(REPO), "ls-tree", "-r", "--name-only", "fabed8e", "ogrpo/"],
                             capture_output=True, text=True)
    if listing.returncode:
        pytest.skip("fabed8e is not in this clone")
    problems = []
    for rel in listing.stdout.split():
        if rel.endswith(".py") and not rel.startswith(ALLOWED):
            text = subprocess.run(["git", "-C", str(REPO), "show", f"fabed8e:{rel}"], capture_output=True,
                                  text=True).stdout
            problems += dict_reads(text, rel)
    joined = "\n".join(problems)
    for shape in ('vargs.get(\'dtype\')', "plan.kernels.get('linear_logprobs')", "plan.setting('overlap')",
                  "plan.trainer.strategy == 'ddp'", "p.mode == 'server'", "plan.trainer_args.get('tf32')"):
        assert shape in joined, shape


# ------------------------------------------------------------------- the planner owns a plan's changes and warnings

# A plan's lists that only the planner adds to (ogrpo/plan.py's make_plan, in its own order): what a check that
# reads files or asks the cluster decides enters the planner as input (plan_from_config's input_changes and
# preemption), never the finished plan. No file outside the planner is excepted.
OWNED = {"changes", "warnings"}
MUTATORS = {"append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse"}  # list methods, in place
# The commit before the planner owned them: load_plan and the sandbox policy added to the finished plan, and so
# did the preemption policy until the commit after BEFORE_PREEMPTION.
BEFORE_OWNED = "b4c8fdc"
BEFORE_PREEMPTION = "40e1406"


def _plan_owner(node: ast.AST, local_dicts: set[str], aliases: frozenset[str]) -> bool:
    """`plan`, `pp.plan`, `p` (the name a plan most often has here) ..., as for the dict-read guard."""
    return _is_plan(node, local_dicts, aliases) or (isinstance(node, ast.Name) and node.id == "p"
                                                    and node.id not in local_dicts)


def _owned_list(node: ast.AST, local_dicts: set[str], aliases: frozenset[str], lists: set[str]) -> bool:
    """`plan.changes`, `p.warnings`, `pp.plan.changes` ..., or a local bound to one (`changes = plan.changes`)."""
    if isinstance(node, ast.Name):
        return node.id in lists
    return isinstance(node, ast.Attribute) and node.attr in OWNED and _plan_owner(node.value, local_dicts, aliases)


def plan_additions(source: str, filename: str = "<src>") -> list[str]:
    """Every statement that changes a plan's `changes` or `warnings`: a list method that changes it in place
    (`.append(`, `.extend(` ...), `+=`, an assignment to the list, an item of it or the attribute, `del` of an
    item, `dataclasses.replace(plan, changes=...)`, `setattr(plan, "warnings", ...)`; as `file:line: code`."""
    tree = ast.parse(source, filename=filename)
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, _SCOPES)]
    found: dict[tuple[int, int], str] = {}
    for scope in scopes:
        local_dicts, _, aliases = _scope_facts(scope)
        lists: set[str] = set()
        for node in _walk_scope(scope):
            if isinstance(node, ast.Assign) and _owned_list(node.value, local_dicts, aliases, set()):
                lists |= {t.id for t in node.targets if isinstance(t, ast.Name)}

        def owned(node: ast.AST) -> bool:
            return _owned_list(node, local_dicts, aliases, lists)

        def written(target: ast.AST) -> bool:  # the list itself (as an attribute of the plan) or an item of it
            return (isinstance(target, ast.Attribute) and owned(target)) or \
                (isinstance(target, ast.Subscript) and owned(target.value))

        for node in _walk_scope(scope):
            hit = False
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                hit = (node.func.attr in MUTATORS and owned(node.func.value)) or (
                    node.func.attr == "replace" and bool(node.args)
                    and _plan_owner(node.args[0], local_dicts, aliases)
                    and any(k.arg in OWNED for k in node.keywords))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                if node.func.id in ("replace", "_replace"):
                    hit = bool(node.args) and _plan_owner(node.args[0], local_dicts, aliases) and \
                        any(k.arg in OWNED for k in node.keywords)
                elif node.func.id == "setattr" and len(node.args) >= 2:
                    name = node.args[1]
                    hit = _plan_owner(node.args[0], local_dicts, aliases) and isinstance(name, ast.Constant) and \
                        name.value in OWNED
            elif isinstance(node, ast.AugAssign):
                hit = owned(node.target) or written(node.target)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                hit = any(written(t) for t in targets)
            elif isinstance(node, ast.Delete):
                hit = any(written(t) for t in node.targets)
            if hit:
                found[(node.lineno, node.col_offset)] = f"{filename}:{node.lineno}: {ast.unparse(node)}"
    return [found[k] for k in sorted(found)]


def _lines_of(text: str, function: str) -> range:
    node = next((n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == function),
                None)
    return range(node.lineno, node.end_lineno + 1) if node else range(0)


def _additions_outside_the_planner(rels_and_texts) -> list[str]:
    out = []
    for rel, text in rels_and_texts:
        if not rel.endswith(".py") or rel.startswith(ALLOWED):
            continue
        exempt = _lines_of(text, DELIBERATE[rel]) if rel in DELIBERATE else range(0)
        out += [line for line in plan_additions(text, rel) if int(line.split(":")[1]) not in exempt]
    return out


def test_the_deliberate_exception_is_still_where_it_says():
    """The exempt function exists and still changes the plan (else the exception is stale and goes)."""
    for rel, function in DELIBERATE.items():
        text = (REPO / rel).read_text()
        lines = _lines_of(text, function)
        assert lines, (rel, function)
        assert any(int(line.split(":")[1]) in lines for line in plan_additions(text, rel)), (rel, function)


def _files_at(commit: str) -> list[tuple[str, str]]:
    """(path, text) of every file under ogrpo/ as of `commit` (skips the test where the clone lacks it)."""
    import subprocess

    listing = subprocess.run(["git", "-C", str(REPO), "ls-tree", "-r", "--name-only", commit, "ogrpo/"],
                             capture_output=True, text=True)
    if listing.returncode:
        pytest.skip(f"{commit} is not in this clone")
    return [(rel, subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:{rel}"], capture_output=True,
                                 text=True).stdout) for rel in listing.stdout.split() if rel.endswith(".py")]


def test_only_the_planner_adds_to_a_plans_changes_and_warnings():
    problems = _additions_outside_the_planner(
        (path.relative_to(REPO).as_posix(), path.read_text()) for path in sorted(PACKAGE.rglob("*.py")))
    assert problems == [], ("a plan's changes or warnings changed outside the planner (hand the decision to the "
                            "planner as input: plan_from_config's input_changes or preemption, a step in "
                            "ogrpo/planner/):\n" + "\n".join(problems))


def test_the_additions_guard_finds_each_way_of_changing_a_plans_lists():
    source = '''
def a(plan, p, pp, rc, pol, d, input_changes, c):
    plan.changes.extend(input_changes)
    plan.changes.append(Change("ogrpo.sandbox", "auto", "none", "opt-out"))
    plan.warnings.append("no isolation")
    p.warnings += ["w"]
    pp.plan.changes.insert(0, c)
    changes = plan.changes
    changes.append(c)
    plan.warnings = []
    p.changes[0] = c
    del plan.changes[0]
    q = dataclasses.replace(plan, warnings=[])
    setattr(p, "changes", [])

def fine(plan, rc, pol, d, c, self):
    rc.warnings.extend(["a config warning"])   # the run config's: the planner reads them as input
    pol.changes.append(c)                     # a preemption policy's own list
    d.changes.add("key", 1, 2, "why")         # the planner's draft
    self.warnings = 0
    out = plan.changes + [c]                  # a new list
    vllm = dataclasses.replace(plan, vllm=None)

def fused(processors):
    plan = {"warnings": []}                   # a local dict that happens to be called plan
    plan["warnings"].append("x")
'''
    lines = [line.split(": ", 1)[1] for line in plan_additions(source)]
    assert lines == ["plan.changes.extend(input_changes)",
                     "plan.changes.append(Change('ogrpo.sandbox', 'auto', 'none', 'opt-out'))",
                     "plan.warnings.append('no isolation')", "p.warnings += ['w']", "pp.plan.changes.insert(0, c)",
                     "changes.append(c)", "plan.warnings = []", "p.changes[0] = c", "del plan.changes[0]",
                     "dataclasses.replace(plan, warnings=[])", "setattr(p, 'changes', [])"]


def test_the_additions_guard_fails_on_the_code_before_the_planner_owned_them():
    """The same scan over ogrpo/ as of BEFORE_OWNED finds load_plan's, the sandbox policy's and the preemption
    policy's additions; as of BEFORE_PREEMPTION, the preemption policy's alone (grace.py's `apply`)."""
    problems = _additions_outside_the_planner(_files_at(BEFORE_OWNED))
    lines = [line.split(": ", 1)[1] for line in problems]
    assert {line.split(":", 1)[0] for line in problems} == {"ogrpo/load_plan.py", "ogrpo/sandbox/policy.py",
                                                            "ogrpo/launch/slurm/grace.py"}
    for shape in ("plan.changes.extend(input_changes)", "plan.warnings.append("):
        assert any(line.startswith(shape) for line in lines), shape
    problems = _additions_outside_the_planner(_files_at(BEFORE_PREEMPTION))
    assert [line.split(": ", 1)[1] for line in problems if line.startswith("ogrpo/launch/slurm/grace.py:")] == \
        ["plan.warnings.append(w)", "plan.changes.append(c)"] and len(problems) == 2
