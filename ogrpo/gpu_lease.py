"""A GPU lease in one call: what a lent GPU machine lacks, carried as wheels, and everything to measure there.

    python -m ogrpo.gpu_lease build [--out build/gpu-wheelhouse]        # here (make gpu-wheelhouse)
    python -m ogrpo.gpu_lease run --wheelhouse DIR --out DIR            # there (make test-gpu-lease)

The lent machines (/work/.library/device/KINDS.md) have PyTorch, transformers, peft, accelerate and a long list of
common packages, but no TRL, datasets or math-verify, and nothing can be fetched there; what travels with a call
is at most 64 MiB. `build` takes, from this venv where the installed files are the wheel's (pure-Python wheels
repacked from their RECORD) and otherwise from PyPI into build/wheel-cache/ (kept between builds), the closure of
TRL, datasets and math-verify less what the image has, plus O-GRPO as a wheel (its kernels' C++/CUDA sources
inside); it fails when the total passes the limit, and writes manifest.json (what is inside, why, and the big
wheels left out because the image has them).

`run` installs the wheels into a temporary site dir (pip --no-index --no-deps --target: no network), checks every
carried wheel's requirements against that dir plus the image, and then runs the parts below, each a process with
its own time budget (a part that overruns is stopped and reported; the rest still runs), into one report
(ogrpo/gpu_report.py's JSON + table) beside the step CSV/PNG. Without CUDA it runs nothing: it reports "no GPU"
and each part's command, exit 0 (CI runs this dry mode).

With this workplace's device tool, one call (the wheelhouse is under the ignored build/, so it is carried; the
report dir holds a log per part, more files than a call brings back, hence the archive):
    carry ["build/gpu-wheelhouse"], timeout_s 570, command
    PYTHONUNBUFFERED=1 make test-gpu-lease GPU_REPORT=/tmp/lease; tar czf $OUT/lease.tgz -C /tmp/lease .;
    cp /tmp/lease/gpu-report.txt /tmp/lease/step.csv $OUT/
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from ogrpo import gpu_report, layout
from ogrpo.hardware import known_types
from ogrpo.tables import format_table

LIMIT_MIB = 64.0  # what one device call carries (the working tree and the wheels together)
TARGET_PYTHON = "3.12"  # the lent image's python3 (KINDS.md)
ROOTS = ("trl", "datasets", "math-verify")  # what the image lacks for `ogrpo train` / `bench step`
# The lent image's packages (KINDS.md, "Python packages already there", read 2026-11-17): carried only when
# a carried wheel needs something else. pyarrow (~40 MiB), pandas, numpy, aiohttp are among them.
IMAGE_HAS = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs build certifi
charset-normalizer click cloudpickle cmake colorama contourpy cycler cython einops filelock fonttools frozenlist
fsspec h11 h5py hf-xet httpcore httpx huggingface-hub humanize idna iniconfig jinja2 joblib kiwisolver lxml
markdown markdown-it-py markupsafe matplotlib mdurl ml-dtypes mpmath msgpack multidict networkx ninja numpy
nvidia-ml-py packaging pandas pathspec peft pillow pip pluggy portalocker propcache protobuf psutil pyarrow
pybind11 pygments pyparsing pytest python-dateutil pyyaml regex requests rich safetensors scipy
sentencepiece setuptools shellingham six sympy tabulate tokenizers torch tqdm transformers triton typer
typing-extensions urllib3 wheel wrapt xxhash yarl zipp
""".split())
MANIFEST = "manifest.json"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ---------------------------------------------------------------- build (here)

def _requires(dist, python_version: str) -> list[str]:
    """The distribution's unconditional requirements (no extras) for the target Python."""
    from packaging.requirements import Requirement

    env = {"python_version": python_version, "python_full_version": python_version + ".0", "extra": ""}
    out = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(env):
            out.append(norm(req.name))
    return out


def closure(roots=ROOTS, image=IMAGE_HAS, python_version: str = TARGET_PYTHON) -> dict[str, list[str]]:
    """name -> [the carried names that need it], for the roots and what they need that the image lacks
    (read from this venv's installed metadata)."""
    from importlib import metadata

    need: dict[str, list[str]] = {norm(r): ["ogrpo"] for r in roots}
    todo = list(need)
    while todo:
        name = todo.pop()
        for dep in _requires(metadata.distribution(name), python_version):
            if dep in image:
                continue
            if dep not in need:
                need[dep] = []
                todo.append(dep)
            need[dep].append(name)
    return need


def _wheel_tags(dist) -> list[str]:
    text = dist.read_text("WHEEL") or ""
    return [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Tag:")]


def _portable(tags: list[str], python_version: str) -> bool:
    """Pure Python for any Python 3 (py3-none-any) or for the target's (py312-none-any, as multiprocess ships):
    then the installed files are the wheel's."""
    own = "py" + python_version.replace(".", "")
    return bool(tags) and all(re.fullmatch(rf"(py2\.)?(py3|{own})-none-any", t) for t in tags)


def _record_line(arc: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arc},sha256={digest},{len(data)}"


def repack(dist, dest: Path) -> Path:
    """A wheel of an installed pure-Python distribution, rebuilt from its RECORD (bytecode, installer files and
    console scripts left out: pip writes them again)."""
    tags = _wheel_tags(dist)
    info = next(f for f in dist.files if f.parts[0].endswith(".dist-info")).parts[0]
    stem = info[: -len(".dist-info")]
    pys = ".".join(dict.fromkeys(t.split("-")[0] for t in tags))
    path = dest / f"{stem}-{pys}-none-any.whl"
    skip = {"INSTALLER", "REQUESTED", "RECORD", "direct_url.json", "uv_cache.json", "uv_build.json"}
    records = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in sorted(dist.files, key=str):
            arc = f.as_posix()
            if arc.startswith("..") or "__pycache__" in f.parts or arc.endswith(".pyc") or (
                    f.parts[0] == info and f.name in skip):
                continue
            data = Path(dist.locate_file(f)).read_bytes()
            zf.writestr(arc, data)
            records.append(_record_line(arc, data))
        records.append(f"{info}/RECORD,,")
        zf.writestr(f"{info}/RECORD", "\n".join(records) + "\n")
    return path


def download(name: str, version: str, cache: Path, python_version: str) -> Path:
    """The target Python's wheel from PyPI, kept in `cache` (keyed by name, version and Python)."""
    cache.mkdir(parents=True, exist_ok=True)
    stem = norm(name).replace("-", "_")
    found = [p for p in cache.glob("*.whl") if norm(p.name.split("-")[0]) == norm(name)
             and p.name.split("-")[1] == version]
    if not found:
        plats = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any"]
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", python_version, "--implementation", "cp", "-d", str(cache),
               *[a for p in plats for a in ("--platform", p)], f"{name}=={version}"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"gpu_lease build: pip download {name}=={version} for Python {python_version} "
                             f"failed: {(res.stderr.strip().splitlines() or ['?'])[-1]}")
        found = [p for p in cache.glob(f"{stem}-{version}-*.whl")] or [
            p for p in cache.glob("*.whl") if norm(p.name.split("-")[0]) == norm(name)]
    return found[0]


def own_wheel(dest: Path) -> Path:
    """O-GRPO as a wheel, built from the checkout this module is imported from (kernels' sources included)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file():
        raise SystemExit(f"gpu_lease build: no pyproject.toml beside {Path(__file__).parent}: build from a checkout")
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                              "-w", tmp, str(root)], capture_output=True, text=True, cwd=tmp)
        if res.returncode != 0:
            raise SystemExit("gpu_lease build: pip wheel of O-GRPO failed: "
                             + (res.stderr.strip().splitlines() or ["?"])[-1])
        built = next(Path(tmp).glob("ogrpo-*.whl"))
        shutil.move(str(built), dest / built.name)
    return dest / built.name


def _installed_mib(dist) -> float:
    return sum((Path(dist.locate_file(f)).stat().st_size for f in dist.files or []
                if Path(dist.locate_file(f)).is_file()), 0) / 2**20


def build(out: Path, cache: Path, python_version: str = TARGET_PYTHON, limit_mib: float = LIMIT_MIB) -> dict:
    from importlib import metadata

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    rows = []
    for name, needed_by in sorted(closure(python_version=python_version).items()):
        dist = metadata.distribution(name)
        if _portable(_wheel_tags(dist), python_version):
            path, source = repack(dist, out), "repacked from this venv"
        else:
            got = download(dist.metadata["Name"], dist.version, cache, python_version)
            path, source = out / got.name, f"PyPI for Python {python_version} (cached in {cache})"
            shutil.copy2(got, path)
        rows.append({"name": name, "version": dist.version, "wheel": path.name, "mib": path.stat().st_size / 2**20,
                     "source": source, "needed_by": sorted(set(needed_by))})
    ours = own_wheel(out)
    kernels = sorted(n for n in zipfile.ZipFile(ours).namelist() if "/csrc/" in n)
    rows.append({"name": "ogrpo", "version": ours.name.split("-")[1], "wheel": ours.name,
                 "mib": ours.stat().st_size / 2**20, "source": "built from this checkout", "needed_by": [],
                 "kernel_sources": kernels})
    # What the closure would have carried without the image: the big ones, to say why they stay home.
    left = {}
    for root in ROOTS:
        for dep in _requires(metadata.distribution(root), python_version):
            if dep in IMAGE_HAS and dep not in left:
                try:
                    left[dep] = round(_installed_mib(metadata.distribution(dep)), 1)
                except metadata.PackageNotFoundError:
                    continue
    total = sum(r["mib"] for r in rows)
    manifest = {"ogrpo_gpu_wheelhouse": 1, "python": python_version, "total_mib": round(total, 2),
                "limit_mib": limit_mib, "wheels": rows,
                "left_out_image_has_mib_installed": dict(sorted(left.items(), key=lambda kv: -kv[1]))}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def manifest_table(m: dict) -> str:
    rows = [(r["name"], r["version"], f"{r['mib']:.2f}", r["source"], ", ".join(r["needed_by"]) or "-")
            for r in m["wheels"]]
    text = format_table(["wheel", "version", "MiB", "from", "needed by"], rows, right=(2,))
    big = ", ".join(f"{k} {v:g}" for k, v in list(m["left_out_image_has_mib_installed"].items())[:6])
    return (f"{text}\ntotal {m['total_mib']:.2f} MiB of {m['limit_mib']:g} MiB (Python {m['python']}); "
            f"left out, the image has them (MiB installed): {big}\n")


# ---------------------------------------------------------------- run (there)

MODEL_05B = {"hidden": 896, "layers": 24, "heads": 14, "kv-heads": 2, "intermediate": 4864, "vocab": 151936}


def card(devices: list[str]) -> str:
    """The catalog name of the first CUDA device ("NVIDIA H100 80GB HBM3" -> H100), for `--gpus 1xNAME`."""
    name = (devices or ["?"])[0].upper()
    hits = [t for t in known_types() if t != "cpu" and re.search(rf"\b{re.escape(t.upper())}\b", name)]
    return max(hits, key=len) if hits else "H100"


def lease_parts(wheelhouse: Path, site: Path, work: Path, gpu: str) -> list[tuple[str, list[str], float]]:
    """(part, argv after the interpreter, seconds budget): 480 s of budgets, the lease's 8 minutes. The figures
    no lease has measured yet (training, the step against plain TRL, the memory model) come first; the gpu
    tests, which an earlier lease ran, take what is left at the end."""
    gpus = f"1x{gpu}"
    step = ["-m", "ogrpo", "bench", "step", "--gpus", gpus, "--dtype", "bf16", "--shape", "default",
            "--csv", "{out}/step.csv", "--png", "{out}/step.png"]
    model05 = [a for k, v in MODEL_05B.items() for a in (f"--{k}", str(v))]
    train = ["-m", "ogrpo", "train", "--config", "tiny-math", "--gpus", gpus, "--output-dir", str(work / "train"),
             "--set", f"ogrpo.gpus={gpus}", "--set", "ogrpo.kernels=true", "--set", "max_steps=20",
             "--set", "save_steps=20"]
    parts = [
        ("install", ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target",
                     str(site), *sorted(str(p) for p in wheelhouse.glob("*.whl"))], 20),
        ("requirements", ["-m", "ogrpo.gpu_lease", "check", "--wheelhouse", str(wheelhouse)], 10),
        ("selftest --gpu", ["-m", "ogrpo", "selftest", "--gpu", "--gpus", gpus, "--no-server", "--ds-ops", "",
                            "--out", "{out}/selftest.json"], 30),
        ("train tiny-math", train, 50),
        ("train check", ["-m", "ogrpo.gpu_lease", "check-run", str(work / "train")], 5),
    ]
    # (case, options, budget per kernels setting): HF generate writes 2048 tokens one at a time, so the long
    # case runs one prompt x 2 completions for 2 steps (the first a warm-up)
    cases = (("default", ["--steps", "3"], 25),
             ("0.5B", [*model05, "--prompts", "2", "--generations", "4", "--tokens", "128", "--steps", "3"], 35),
             ("long", ["--prompts", "1", "--generations", "2", "--tokens", "2048", "--steps", "2"], 80))
    for case, extra, budget in cases:
        for kernels in ("on", "off"):
            parts.append((f"bench step {case} kernels {kernels}",
                          [*step, *extra, "--kernels" if kernels == "on" else "--no-kernels",
                           "--workdir", str(work / f"step-{case}-{kernels}")], budget))
    parts.append(("memory model", ["-m", "ogrpo.gpu_lease", "memory", "--work", str(work),
                                   "--csv", "{out}/memory.csv"], 5))
    parts.append(("gpu tests", ["-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                "--junitxml={out}/gpu-tests.xml", "tests"], 80))
    return parts


def check_requirements(wheelhouse: Path) -> list[str]:
    """Each carried wheel's unconditional requirements that the running environment (the target dir on
    PYTHONPATH, then the image) does not satisfy."""
    from importlib import metadata

    from packaging.requirements import Requirement

    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    env = {"python_version": py, "python_full_version": py + ".0", "extra": ""}
    problems = []
    for whl in sorted(wheelhouse.glob("*.whl")):
        with zipfile.ZipFile(whl) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            lines = zf.read(meta).decode().splitlines()
        for ln in lines:
            if not ln.startswith("Requires-Dist:"):
                continue
            req = Requirement(ln.split(":", 1)[1].strip())
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                problems.append(f"{whl.name}: {req} (absent)")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{whl.name}: {req} (found {have})")
    return problems


def check_run(run: Path) -> list[str]:
    """Why the training run is not a good one: a missing run-directory file, no checkpoint, or a reward that
    did not rise (mean of the last quarter of the steps over the first quarter)."""
    problems = [f"no {name}" for name in (layout.MANIFEST, layout.METRICS, layout.PROFILE)
                if not (run / name).is_file()]
    if not any(run.glob("checkpoint-*")):
        problems.append("no checkpoint-N/")
    if (run / layout.METRICS).is_file():
        rewards = [r["reward"] for r in map(json.loads, (run / layout.METRICS).read_text().splitlines())
                   if r.get("reward") is not None]
        q = max(1, len(rewards) // 4)
        if len(rewards) < 4:
            problems.append(f"{len(rewards)} reward rows")
        elif sum(rewards[-q:]) / q <= sum(rewards[:q]) / q:
            problems.append(f"reward did not rise: first {q} steps {sum(rewards[:q]) / q:.3f}, "
                            f"last {q} {sum(rewards[-q:]) / q:.3f}")
    return problems


def memory_rows(work: Path) -> list[dict]:
    """The memory model's estimate against the measured peak (profile.jsonl's mem_estimate_gib and
    mem_measured_gib, ogrpo/profile/profiler.py) for each O-GRPO run under `work`."""
    rows = []
    for prof in sorted(work.rglob("*profile.jsonl")):
        if prof.name.startswith("trl-"):
            continue  # plain TRL carries no plan, hence no estimate
        steps = [json.loads(ln) for ln in prof.read_text().splitlines() if ln.strip()]
        pairs = [(s["mem_estimate_gib"], s["mem_measured_gib"]) for s in steps
                 if s.get("mem_estimate_gib") and s.get("mem_measured_gib")]
        if pairs:
            est, meas = pairs[-1][0], max(m for _, m in pairs)
            rows.append({"run": str(prof.parent.relative_to(work)) if prof.parent != work else prof.stem,
                         "estimate_gib": round(est, 3), "measured_gib": round(meas, 3),
                         "measured_over_estimate": round(meas / est, 3)})
    return rows


def _selftest_summary(path: Path) -> str:
    text = gpu_report.selftest_summary(path)
    # `--no-server`: vLLM cannot travel to the lease machine (hundreds of MiB), so its checks are absent
    return text.replace("skip: ", "skip (vLLM absent for vllm_server, weight_push): ", 1) if "vllm" in text else text


def _summary(name: str, out: Path, work: Path):
    if name == "gpu tests":
        return lambda: gpu_report.junit_summary(out / "gpu-tests.xml")
    if name == "selftest --gpu":
        return lambda: _selftest_summary(out / "selftest.json")
    if name.startswith("bench step"):
        return lambda: gpu_report.bench_summary(out / "step.csv")
    if name == "memory model":
        return lambda: "; ".join(f"{r['run']} {r['measured_over_estimate']:g}" for r in memory_rows(work)) \
            or "no profile with both numbers"
    return lambda: ""


def run(wheelhouse: Path, out: Path, work: Path | None = None, budget_s: float = 480.0,
        facts: dict | None = None, parts=None) -> dict:
    facts = gpu_report.cuda_facts() if facts is None else facts
    work = work or Path(tempfile.mkdtemp(prefix="ogrpo-lease-"))
    site = work / "site"
    planned = parts if parts is not None else lease_parts(wheelhouse, site, work, card(facts.get("devices", [])))
    report = {"ogrpo_gpu_report": 1, "lease": True, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "host": os.uname().nodename, "cuda": facts, "parts": [], "status": "no GPU", "budget_s": budget_s,
              "would_run": [{"part": n, "budget_s": b, "command": " ".join([sys.executable, *argv])}
                            for n, argv, b in planned]}
    if not facts["cuda"]:
        return report
    out.mkdir(parents=True, exist_ok=True)
    # the parts import the carried packages from the target dir first, then the image's
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(site), str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")) if p)}
    deadline = time.monotonic() + budget_s
    for name, argv, budget in planned:
        left = deadline - time.monotonic()
        if left < 5:
            report["parts"].append({"part": name, "outcome": "cut", "rc": None, "seconds": 0.0,
                                    "summary": "no time left in the lease budget", "command": ""})
            continue
        res = gpu_report.run_part(name, argv, out, min(budget, left), summary=_summary(name, out, work),
                                   env=env)
        report["parts"].append(res)
        if name == "install" and res["outcome"] != "pass":
            break  # nothing else can run without the carried packages
    report["memory"] = memory_rows(work)
    report["status"] = "pass" if all(p["outcome"] == "pass" for p in report["parts"]) else "fail"
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ogrpo.gpu_lease", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="the wheelhouse (here)")
    b.add_argument("--out", default="build/gpu-wheelhouse")
    b.add_argument("--cache", default="build/wheel-cache", help="downloaded wheels, kept between builds")
    b.add_argument("--python-version", default=TARGET_PYTHON)
    b.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    r = sub.add_parser("run", help="install and measure (on the GPU machine)")
    r.add_argument("--wheelhouse", default="build/gpu-wheelhouse")
    r.add_argument("--out", default="gpu-report")
    r.add_argument("--work", default=None, help="run directories and the site dir (default: a temp dir)")
    r.add_argument("--budget", type=float, default=480.0, help="seconds for all parts (default 480)")
    c = sub.add_parser("check", help="carried wheels' requirements against this environment")
    c.add_argument("--wheelhouse", required=True)
    cr = sub.add_parser("check-run", help="a training run directory: complete, reward rose")
    cr.add_argument("run")
    m = sub.add_parser("memory", help="memory model estimate vs measured peak of the runs under --work")
    m.add_argument("--work", required=True)
    m.add_argument("--csv", required=True)
    args = ap.parse_args(argv)

    if args.cmd == "build":
        manifest = build(Path(args.out), Path(args.cache), args.python_version, args.limit_mib)
        sys.stdout.write(manifest_table(manifest))
        if manifest["total_mib"] >= args.limit_mib:
            print(f"gpu_lease build: {manifest['total_mib']:.1f} MiB is over the {args.limit_mib:g} MiB a device "
                  f"call carries", file=sys.stderr)
            return 1
        print(f"wheelhouse: {args.out}")
        return 0
    if args.cmd == "check":
        problems = check_requirements(Path(args.wheelhouse))
        print("\n".join(problems) or "every carried wheel's requirements are met")
        return 1 if problems else 0
    if args.cmd == "check-run":
        problems = check_run(Path(args.run))
        print("\n".join(problems) or f"{args.run}: complete, reward rose")
        return 1 if problems else 0
    if args.cmd == "memory":
        rows = memory_rows(Path(args.work))
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, ["run", "estimate_gib", "measured_gib", "measured_over_estimate"])
            w.writeheader()
            w.writerows(rows)
        for row in rows:
            print(f"{row['run']}: estimate {row['estimate_gib']} GiB, measured {row['measured_gib']} GiB, "
                  f"ratio {row['measured_over_estimate']}")
        return 0 if rows else 1
    wheelhouse = Path(args.wheelhouse)
    facts = gpu_report.cuda_facts()
    if facts["cuda"] and not any(wheelhouse.glob("*.whl")):
        print(f"gpu_lease run: no wheels in {wheelhouse}: build them here first (make gpu-wheelhouse)",
              file=sys.stderr)
        return 2
    report = run(wheelhouse, Path(args.out), Path(args.work) if args.work else None, args.budget, facts=facts)
    js, txt = gpu_report.write(report, Path(args.out))
    sys.stdout.write(txt.read_text())
    print(f"report: {js} (table: {txt})")
    return 1 if report["status"] == "fail" else 0


if __name__ == "__main__":
    raise SystemExit(main())
