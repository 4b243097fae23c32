"""The import graph of ogrpo/, file to file, against the layer order written in docs/architecture.md.

The graph is read with `ast` (nothing is imported): module-level and function-level imports both count,
relative imports are resolved, and `from pkg import module` is an edge to that module. The layers come from the
table under "## Layers" in docs/architecture.md, so the doc and this test cannot drift apart: a module the
table does not place fails here, and so does a table entry that places nothing.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ogrpo"
DOC = REPO / "docs" / "architecture.md"
# Imports that may still run against the layer order (each listed by the test when it fails).
MAX_UPWARD = 2


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file below `package` (a package is its __init__.py)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(module: str, is_package: bool, node: ast.AST, files: dict[str, Path]) -> list[str]:
    """The modules of `files` that one import statement in `module` loads (nearest enclosing module of a name)."""
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        # `from pkg import module` loads that module; `from module import name` loads the module.
        names = [f"{source}.{a.name}" if f"{source}.{a.name}" in files else source for a in node.names]
    out = []
    for name in names:
        while name and name not in files:
            name = name.rpartition(".")[0]
        if name:
            out.append(name)
    return out


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    files = module_files(package)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):  # every depth: imports inside functions count
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(_targets(module, path.name == "__init__.py", node, files))
        edges.discard(module)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def doc_layers(doc: Path = DOC) -> list[tuple[str, list[str]]]:
    """(layer, module names) from the table under "## Layers", bottom layer first. Names are relative to
    ogrpo/ (`planner` is the package and everything in it, `__init__` the package's own file)."""
    text = doc.read_text()
    section = text.split("\n## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # past the header and its rule
    layers = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        layers.append((cells[1], re.findall(r"`([\w.]+)`", cells[2])))
    return layers


def layer_of(module: str, layers: list[tuple[str, list[str]]]) -> int | None:
    """The layer of a dotted module: the longest table name that is it or a package above it."""
    best, depth = None, -1
    for i, (_, names) in enumerate(layers):
        for name in names:
            if name == "__init__":  # the package's own file only: not a layer for every module below it
                if module == "ogrpo":
                    return i
                continue
            full = f"ogrpo.{name}"
            if (module == full or module.startswith(full + ".")) and full.count(".") > depth:
                best, depth = i, full.count(".")
    return best


def package_of(module: str) -> str:
    """ogrpo's package (or top-level module) a module belongs to."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph one level up: each of ogrpo's packages (and top-level modules) a node, an edge where any module of
    one imports any module of another."""
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        out.setdefault(package_of(module), set()).update(package_of(t) for t in targets)
    for node, targets in out.items():
        targets.discard(node)
    return out


def upward_imports(graph, layers) -> list[str]:
    out = []
    for module in sorted(graph):
        for target in sorted(graph[module]):
            if layer_of(target, layers) > layer_of(module, layers):
                out.append(f"{module} ({layers[layer_of(module, layers)][0]}) -> {target} "
                           f"({layers[layer_of(target, layers)][0]})")
    return out


# --- the reader itself, on a package made for the purpose -------------------------------------------------------

def test_the_reader_counts_every_kind_of_import(tmp_path):
    pkg = tmp_path / "ogrpo"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "base.py").write_text("X = 1\n")
    (pkg / "sub" / "__init__.py").write_text("from .leaf import Y\n")
    (pkg / "sub" / "leaf.py").write_text("from ..base import X\nY = X\n")
    (pkg / "sub" / "other.py").write_text("from . import leaf\n")
    (pkg / "top.py").write_text("import ogrpo.sub.leaf as l\n\ndef f():\n    from ogrpo.sub import other\n"
                                "    from ogrpo import base\n    import json\n")
    graph = import_graph(pkg)
    assert graph == {"ogrpo": set(), "ogrpo.base": set(), "ogrpo.sub": {"ogrpo.sub.leaf"},
                     "ogrpo.sub.leaf": {"ogrpo.base"}, "ogrpo.sub.other": {"ogrpo.sub.leaf"},
                     "ogrpo.top": {"ogrpo.sub.leaf", "ogrpo.sub.other", "ogrpo.base"}}
    assert cycles(graph) == []
    graph["ogrpo.base"].add("ogrpo.top")
    assert cycles(graph) == [["ogrpo.base", "ogrpo.sub.leaf", "ogrpo.sub.other", "ogrpo.top"]]
    layers = [("low", ["base", "sub.leaf"]), ("high", ["sub", "top", "__init__"])]
    assert upward_imports(graph, layers) == ["ogrpo.base (low) -> ogrpo.top (high)"]
    graph["ogrpo.base"].discard("ogrpo.top")
    assert package_graph(graph) == {"ogrpo": set(), "ogrpo.base": set(), "ogrpo.sub": {"ogrpo.base"},
                                    "ogrpo.top": {"ogrpo.sub", "ogrpo.base"}}
    graph["ogrpo.base"].add("ogrpo.sub.other")  # a file-level path back up makes a package-level cycle
    assert cycles(package_graph(graph)) == [["ogrpo.base", "ogrpo.sub"]]


# --- the project ------------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def project_graph() -> dict[str, frozenset[str]]:
    return {m: frozenset(t) for m, t in import_graph().items()}


def test_the_documented_layers_place_every_module_and_name_only_modules_that_exist():
    layers = doc_layers()
    assert [name for name, _ in layers][:1] == ["base"] and len(layers) >= 5, layers
    graph = project_graph()
    unplaced = [m for m in sorted(graph) if layer_of(m, layers) is None]
    assert not unplaced, f"modules docs/architecture.md's layer table does not place: {unplaced}"
    stale = [name for _, names in layers for name in names
             if not any(m == ("ogrpo" if name == "__init__" else f"ogrpo.{name}")
                        or m.startswith(f"ogrpo.{name}.") for m in graph)]
    assert not stale, f"layer table entries that name no module: {stale}"
    placed = [name for _, names in layers for name in names]
    assert len(placed) == len(set(placed)), "a name is in two layers"


def test_the_import_graph_has_no_cycles():
    found = cycles(project_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_packages_import_each_other_without_cycles():
    """A package per feature: one feature's package may use another's, never both ways round (through any chain)."""
    graph = project_graph()
    found = cycles(package_graph(graph))
    edges = [f"{m} -> {t}" for component in found for m in sorted(graph) for t in sorted(graph[m])
             if package_of(m) != package_of(t) and {package_of(m), package_of(t)} <= set(component)]
    assert not found, "package cycles: " + "; ".join(" <-> ".join(c) for c in found) + "\n" + "\n".join(edges)


def test_at_most_two_imports_run_against_the_layer_order():
    upward = upward_imports(project_graph(), doc_layers())
    assert len(upward) <= MAX_UPWARD, f"{len(upward)} imports run up the layers:\n" + "\n".join(upward)


# --- imports inside functions ---------------------------------------------------------------------------------
# An ogrpo-to-ogrpo import inside a function is the exception: the module-level import is the default, and one
# left in a function says why in a comment (a heavy library behind it, CLI latency, a test that replaces the name,
# a try that reports its failure). The comment is on the import's line, on the line(s) directly above it, or on
# the first line of its block of consecutive imports (one comment may cover the block).
MAX_FUNCTION_LEVEL = 120


def function_level_imports(package: Path = PACKAGE) -> list[tuple[Path, ast.stmt]]:
    """Every import of an ogrpo module (absolute or relative) inside a function body."""
    out = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    ours = any(a.name.split(".")[0] == package.name for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    ours = bool(node.level) or (node.module or "").split(".")[0] == package.name
                else:
                    continue
                if ours:
                    out.append((path, node))
    return sorted(set(out), key=lambda pn: (str(pn[0]), pn[1].lineno))


def _says_why(lines: list[str], node: ast.stmt, import_lines: dict[int, int]) -> bool:
    """A comment on the import, or above the block of consecutive imports it ends, or on that block's lines."""
    first = node.lineno
    while first - 1 in import_lines:
        first = import_lines[first - 1]
    block = lines[first - 1:node.end_lineno]
    return any("#" in line for line in block) or (first >= 2 and lines[first - 2].lstrip().startswith("#"))


def uncommented_function_level_imports(package: Path = PACKAGE) -> tuple[int, list[str]]:
    found = function_level_imports(package)
    bad = []
    for path in sorted({p for p, _ in found}):
        text = path.read_text()
        lines = text.splitlines()
        # line -> first line of the import statement covering it (every import of the file, ours or not)
        import_lines = {i: n.lineno for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.Import, ast.ImportFrom))
                        for i in range(n.lineno, n.end_lineno + 1)}
        bad += [f"{path.relative_to(package.parent)}:{n.lineno}: {ast.unparse(n)}" for p, n in found
                if p == path and not _says_why(lines, n, import_lines)]
    return len(found), bad


def test_the_reader_of_function_level_imports(tmp_path):
    pkg = tmp_path / "ogrpo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "import json\nfrom ogrpo import b\n\n\ndef f():\n    import os\n    from ogrpo import c  # heavy: torch\n"
        "    from . import d\n\n\ndef g():\n    # CLI latency\n    import sys\n    from ogrpo.x import y\n"
        "    import ogrpo.z\n\n\ndef h():\n    from ogrpo import e\n")
    count, bad = uncommented_function_level_imports(pkg)
    assert count == 5 and bad == ["ogrpo/a.py:19: from ogrpo import e"]
    (pkg / "a.py").write_text("def f():\n    import os\n    from ogrpo import c\n")
    assert uncommented_function_level_imports(pkg) == (1, ["ogrpo/a.py:3: from ogrpo import c"])


def test_function_level_imports_are_few_and_each_says_why():
    count, bad = uncommented_function_level_imports()
    assert count <= MAX_FUNCTION_LEVEL, (
        f"{count} ogrpo imports inside functions (at most {MAX_FUNCTION_LEVEL}): import at the top of the module "
        "unless a heavy library, CLI latency or a test's patch needs it here")
    assert not bad, "ogrpo imports inside functions without a comment saying why:\n" + "\n".join(bad)
