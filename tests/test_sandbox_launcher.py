"""The sandbox launcher (ogrpo/sandbox/launcher.py) is the program each run starts as: a fresh interpreter
without site-packages (`python -P -S -s -B -m ogrpo.sandbox.launcher`) that enters the run's namespaces and, under
a root trainer, becomes a slot uid that may not read the trainer's library directory. So it loads only the
standard library and its own standard-library-only siblings; the trainer side (pool.py) is a module of its own.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What `-m ogrpo.sandbox.launcher` loads of the package: the packages on the way, the launcher, its filters.
CLOSURE = {"ogrpo", "ogrpo.sandbox", "ogrpo.sandbox.launcher", "ogrpo.sandbox.landlock", "ogrpo.sandbox.seccomp"}


def _file(module: str) -> Path:
    path = REPO.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _imported(module: str) -> set[str]:
    """The modules one file imports, at any depth (imports inside functions count), with the packages above."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(_file(module).read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}: a relative import"
            names = [f"{node.module}.{a.name}" if _file(f"{node.module}.{a.name}").exists() else node.module
                     for a in node.names] if node.module.split(".")[0] == "ogrpo" else [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out


def test_the_launcher_and_what_it_imports_use_only_the_standard_library():
    seen: set[str] = set()
    todo = ["ogrpo", "ogrpo.sandbox", "ogrpo.sandbox.launcher"]  # `-m` runs the packages' __init__ first
    outside = []
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for name in _imported(module):
            if name.split(".")[0] == "ogrpo":
                todo.append(name)
            elif name.split(".")[0] not in sys.stdlib_module_names:
                outside.append(f"{module} imports {name}")
    assert not outside, outside
    assert seen == CLOSURE, f"the launcher now loads {sorted(seen - CLOSURE)} too; it must stay this small"


LOADS = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from ogrpo.sandbox import launcher
# Its start-up as a run has it, up to the first step that needs the run's work dir: every import it makes.
os.environ["OGRPO_SBX_STATUS_FD"] = str(os.open(os.devnull, os.O_WRONLY))
code = launcher._launcher_main({"isolation": "none", "uid": None, "work": "/nonexistent/ogrpo-sbx"})
print(json.dumps({"code": code, "loaded": sorted(set(sys.modules) - {"__main__"})}))
"""


def test_the_launcher_starts_without_site_packages_and_loads_only_the_standard_library():
    out = subprocess.run([sys.executable, "-I", "-S", "-B", "-c", LOADS, str(REPO)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["code"] == 125  # the setup failed on the missing work dir, after the launcher's imports
    loaded = set(result["loaded"])
    assert {"ogrpo.sandbox.launcher", "ogrpo.sandbox.landlock", "ogrpo.sandbox.seccomp"} <= loaded
    outside = sorted(m for m in loaded if m not in CLOSURE and m.split(".")[0] not in sys.stdlib_module_names)
    assert not outside, f"the launcher loaded modules outside the standard library: {outside}"


def test_each_run_starts_the_launcher_module():
    from ogrpo.sandbox import pool

    argv, env = pool._launcher_cmd()
    if sys.version_info >= (3, 11):
        assert argv[-2:] == ["-m", "ogrpo.sandbox.launcher"] and {"-S", "-s", "-P"} <= set(argv)
        assert Path(env["PYTHONPATH"]) == REPO
    else:
        assert Path(argv[-1]) == REPO / "ogrpo" / "sandbox" / "launcher.py" and "-I" in argv
