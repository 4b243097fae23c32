#!/usr/bin/env python3
"""Before/after byte-identity harness for `ogrpo plan` and `ogrpo render` (a script, not a test module).

It runs a matrix of config x `--gpus` (x a few option and cluster variants) cases and stores, per case, everything
the three commands below produce, so that two trees (before and after a refactor) can be compared with `diff -r`:

    ogrpo plan   -c CONFIG --gpus G [OPTS] --json
    ogrpo render -c CONFIG --gpus G [OPTS] --dry-run --json
    ogrpo render -c CONFIG --gpus G [OPTS] -o TMP/CASE/job --job-dir /shared/ogrpo-jobs/CASE
        (job.sbatch, run.yaml, accelerate.yaml, deepspeed.json, manifest.json: whatever it writes)

Cases: every built-in recipe (ogrpo/recipes/*.yaml, by name), every config under tests/data and slurm/examples/
recipes (those whose model is not built in get `--params 7B`, so that they plan), crossed with a spread of `--gpus`
values, fitting or not; configs that fail to load and malformed `--gpus` values (their error output is compared
too); a few option variants (--strategy, --vllm-gpus, --profile, --overlap, --gres-type, --strict, --force); and a
few cluster variants where a fake `scontrol` answers with a fixed KillWait/GraceTime (the preemption policy then
changes save_steps and adds warnings: this exercises the scontrol `Key=Value` and Slurm time-string parsers).

Layout: OUT/CASE-ID/{case.json, plan.{rc,stdout,stderr}, dryrun.{rc,stdout,stderr}, render.{rc,stdout,stderr},
render.tree (the written paths, directories included), files/<each written file>}.

What is kept fixed or stripped so that a run is deterministic and worktree-independent:
- the environment: every OGRPO_*/SLURM_* variable of the caller is dropped; OGRPO_PYTHON is fixed to
  /shared/ogrpo/.venv/bin/python (as slurm/examples/regen.sh), PYTHONPATH is the repository under test, the
  working directory is its root (configs are passed by their relative path), TZ=UTC, LC_ALL=C.UTF-8;
- Slurm: a fake bin directory is put first on PATH (scontrol, sinfo, squeue, sbatch, scancel, srun, sacct).
  "No cluster" cases: SLURM_CONF=/nonexistent and every fake command fails at once (exactly what regen.sh's
  SLURM_CONF=/nonexistent means, without the real scontrol's 2 s probe); "cluster" cases: SLURM_CONF names an
  empty file and `scontrol show config` / `scontrol show partition -o` print the fixed text of CLUSTERS below;
- the job directory: `--job-dir /shared/ogrpo-jobs/CASE-ID` for the real render (the dry run keeps its default);
- in every stored text: the temporary render root -> `<TMP>`, the repository root (as given and resolved) ->
  `<REPO>`. Nothing else is rewritten (no timestamps were found in the outputs: two runs of the same tree are
  identical; `--check-stable` reruns a sample of cases to confirm that).

Run (from anywhere; ~2-4 min with 2 workers on a loaded 2-core machine):

    export PYTHONPATH=/path/to/worktree   # not needed: the script sets it for the commands it runs
    python tests/render_matrix.py OUT_DIR [--repo /path/to/worktree] [--workers 2] [--python PY] [-k SUBSTR]
    python tests/render_matrix.py --compare BASE_DIR NEW_DIR      # or: diff -r BASE_DIR NEW_DIR

`--repo` defaults to the repository holding this script; `--python` to this interpreter (run it with the
project's venv Python). The comparison exits 0 when the trees are identical, 1 with the differing paths (and the
first lines of each diff) otherwise. A baseline of commit 9b2e51b is kept at /work/notes/render-matrix-base/.
"""

from __future__ import annotations

import argparse
import difflib
import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_REPO = HERE.parent

GPUS = ["cpu", "2xcpu", "1xA40", "2xA40", "3xA40", "4xA40", "8xA40", "2x8xA40", "1xV100", "2xV100-16G",
        "4xV100-32G", "2x8xA100-80G"]
# configs that do not load: a couple of --gpus values are enough to keep their error
FEW_GPUS = ["cpu", "3xA40"]
BAD_GPUS = ["", "0xA40", "3xB200", "17xA40", "2xA40-nvlink", "2xcpu-pcie", "4xV100-99G", "-2xA40"]

# option variants, each on a few (config, gpus) pairs
VARIANTS: dict[str, list[str]] = {
    "zero3": ["--strategy", "zero3"],
    "zero2": ["--strategy", "zero2"],
    "ddp": ["--strategy", "ddp"],
    "offload": ["--strategy", "zero3_offload"],
    "colocate": ["--vllm-gpus", "0"],
    "vllm2": ["--vllm-gpus", "2"],
    "conservative": ["--profile", "conservative"],
    "aggressive": ["--profile", "aggressive"],
    "lossless": ["--overlap", "lossless"],
    "onestep": ["--overlap", "one-step"],
    "gresany": ["--gres-type", "any"],
    "strict": ["--strict"],
    "force": ["--force"],
    "model7b": ["--model", "Qwen/Qwen2.5-7B-Instruct"],
}
VARIANT_TARGETS = [("tiny", "3xA40"), ("slurm/examples/recipes/qwen2.5-1.5b-math.yaml", "4xA40"),
                   ("tests/data/recipes/trl_qwen2.5-0.5b_grpo.yaml", "2x8xA40")]

# fake clusters: `scontrol show config` and `scontrol show partition -o` text (what preemption timing reads)
CLUSTERS: dict[str, tuple[str, str]] = {
    # plain KillWait in "N sec", no preemption
    "kw5": ("Configuration data as of 2026-01-01T00:00:00\nKillWait                = 5 sec\n"
            "PreemptMode             = OFF\nPreemptType             = preempt/none\n",
            "PartitionName=debug AllowGroups=ALL Default=YES GraceTime=0 MaxTime=UNLIMITED PreemptMode=OFF "
            "State=UP TotalCPUs=4\n"),
    # a long KillWait in HH:MM:SS, a preempting partition whose GraceTime is D-HH:MM:SS
    "preempt": ("KillWait                = 00:00:30\nPreemptMode             = REQUEUE\n"
                "PreemptType             = preempt/partition_prio\n",
                "PartitionName=low AllowGroups=ALL Default=NO GraceTime=00:01:00 PreemptMode=REQUEUE State=UP\n"
                "PartitionName=main AllowGroups=ALL Default=YES GraceTime=0-00:02:00 PreemptMode=CANCEL,GANG "
                "State=UP\n"),
    # generous window: KillWait in plain seconds, GraceTime in seconds
    "long": ("KillWait                = 600\nPreemptMode             = SUSPEND,GANG\n"
             "PreemptType             = preempt/qos\n",
             "PartitionName=batch Default=YES GraceTime=300 PreemptMode=REQUEUE MaxTime=1-00:00:00\n"),
    # scontrol answers without KillWait (another tool's output)
    "nokw": ("Slurm is fine\n", ""),
}
CLUSTER_TARGETS = [("tiny", "cpu"), ("tiny", "3xA40"), ("slurm/examples/recipes/qwen2.5-1.5b-math.yaml", "4xA40"),
                   ("slurm/examples/recipes/qwen2.5-7b-math.yaml", "2x8xA100-80G"),
                   ("tests/data/recipes/openr1_qwen2.5-1.5b-instruct_config_demo.yaml", "8xA40")]

JOB_ROOT = "/shared/ogrpo-jobs"
FIXED_PYTHON = "/shared/ogrpo/.venv/bin/python"


def configs(repo: Path) -> list[tuple[str, list[str]]]:
    """(config argument, extra options) for every config of the matrix, in a fixed order."""
    out: list[tuple[str, list[str]]] = [(p.stem, []) for p in sorted((repo / "ogrpo" / "recipes").glob("*.yaml"))]
    files = sorted((repo / "tests" / "data").rglob("*.yaml")) + sorted((repo / "slurm" / "examples").rglob("*.yaml"))
    for p in files:
        rel = p.relative_to(repo).as_posix()
        if rel.startswith("slurm/examples/") and not rel.startswith("slurm/examples/recipes/"):
            continue  # rendered examples (run.yaml, accelerate.yaml): outputs, not configs
        out.append((rel, []))
    return out


def case_id(*parts: str) -> str:
    text = "__".join(p for p in parts if p is not None)
    text = text.replace("tests/data/recipes/", "data-").replace("slurm/examples/recipes/", "ex-")
    text = re.sub(r"\.ya?ml$", "", text).replace(".yaml__", "__")
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text) or "empty"


def probe(repo: Path, python: str, env: dict, config: str) -> int:
    """Exit code of `ogrpo plan` at 3xA40 (2: the config does not load as it is)."""
    return subprocess.run([python, "-m", "ogrpo", "plan", "-c", config, "--gpus", "3xA40"], cwd=repo, env=env,
                          capture_output=True, text=True).returncode


def build_cases(repo: Path, python: str, env: dict) -> list[dict]:
    cases: list[dict] = []
    for config, extra in configs(repo):
        opts = list(extra)
        gpus = GPUS
        if probe(repo, python, env, config) == 2:
            # an unknown model plans with --params 7B; a config that still does not load keeps its error, twice
            if subprocess.run(
                    [python, "-m", "ogrpo", "plan", "-c", config, "--gpus", "3xA40", "--params", "7B"], cwd=repo,
                    env=env, capture_output=True).returncode != 2:
                opts += ["--params", "7B"]
            else:
                gpus = FEW_GPUS
        for g in gpus:
            cases.append({"id": case_id(config, g, "params7b" if opts else None), "config": config, "gpus": g,
                          "opts": opts, "cluster": None})
    for g in BAD_GPUS:
        cases.append({"id": case_id("tiny", "bad", g or "empty"), "config": "tiny", "gpus": g, "opts": [],
                      "cluster": None})
    cases.append({"id": "no-such-config__3xA40", "config": "no-such-recipe", "gpus": "3xA40", "opts": [],
                  "cluster": None})
    for name, opts in VARIANTS.items():
        for config, g in VARIANT_TARGETS:
            cases.append({"id": case_id(config, g, name), "config": config, "gpus": g, "opts": opts, "cluster": None})
    for name in CLUSTERS:
        for config, g in CLUSTER_TARGETS:
            cases.append({"id": case_id(config, g, "cluster-" + name), "config": config, "gpus": g, "opts": [],
                          "cluster": name})
    ids = [c["id"] for c in cases]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    return cases


FAKE = """#!/bin/sh
# fake Slurm client for tests/render_matrix.py: no cluster unless $RENDER_MATRIX_CLUSTER names a directory
if [ -z "$RENDER_MATRIX_CLUSTER" ]; then echo "$(basename "$0"): error: no cluster (render_matrix fake)" >&2; exit 1; fi
case "$(basename "$0") $1 $2" in
  "scontrol show config") cat "$RENDER_MATRIX_CLUSTER/config.txt" ;;
  "scontrol show partition") cat "$RENDER_MATRIX_CLUSTER/partitions.txt" ;;
  *) echo "$(basename "$0"): error: not faked (render_matrix)" >&2; exit 1 ;;
esac
"""


def make_fakes(root: Path) -> Path:
    bin_dir = root / "fakebin"
    bin_dir.mkdir()
    for tool in ("scontrol", "sinfo", "squeue", "sbatch", "scancel", "srun", "sacct", "salloc"):
        path = bin_dir / tool
        path.write_text(FAKE)
        path.chmod(0o755)
    for name, (config, parts) in CLUSTERS.items():
        d = root / "clusters" / name
        d.mkdir(parents=True)
        (d / "config.txt").write_text(config)
        (d / "partitions.txt").write_text(parts)
        (d / "slurm.conf").write_text("")
    return bin_dir


def base_env(repo: Path, fake_bin: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OGRPO_", "SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "RENDER_MATRIX_"))
           and k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONPATH=str(repo), OGRPO_PYTHON=FIXED_PYTHON, TZ="UTC", LC_ALL="C.UTF-8", PYTHONHASHSEED="0",
               PATH=f"{fake_bin}:{env.get('PATH', '/usr/bin:/bin')}", SLURM_CONF="/nonexistent", COLUMNS="200")
    return env


class Normalizer:
    def __init__(self, repo: Path, tmp: Path):
        pairs = {str(tmp.resolve()): "<TMP>", str(tmp): "<TMP>", str(repo.resolve()): "<REPO>", str(repo): "<REPO>"}
        self.pairs = sorted(pairs.items(), key=lambda kv: -len(kv[0]))

    def __call__(self, text: str) -> str:
        for old, new in self.pairs:
            text = text.replace(old, new)
        return text


def run_case(case: dict, repo: Path, python: str, env: dict, tmp: Path, out: Path, norm: Normalizer) -> int:
    dest = out / case["id"]
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    env = dict(env)
    if case["cluster"]:
        cdir = tmp / "clusters" / case["cluster"]
        env.update(RENDER_MATRIX_CLUSTER=str(cdir), SLURM_CONF=str(cdir / "slurm.conf"))
    common = ["-c", case["config"], "--gpus", case["gpus"], *case["opts"]]
    work = tmp / "jobs" / case["id"]
    job = work / "job"
    runs = {
        "plan": ["plan", *common, "--json"],
        "dryrun": ["render", *common, "--dry-run", "--json"],
        "render": ["render", *common, "-o", str(job), "--job-dir", f"{JOB_ROOT}/{case['id']}"],
    }
    (dest / "case.json").write_text(json.dumps({**case, "argv": {k: ["ogrpo", *v] for k, v in runs.items()}},
                                               indent=1, sort_keys=True).replace(str(tmp), "<TMP>") + "\n")
    for name, args in runs.items():
        work.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([python, "-m", "ogrpo", *args], cwd=repo, env=env, capture_output=True,
                              text=True, errors="replace")
        (dest / f"{name}.rc").write_text(f"{proc.returncode}\n")
        (dest / f"{name}.stdout").write_text(norm(proc.stdout))
        (dest / f"{name}.stderr").write_text(norm(proc.stderr))
    tree = []
    if job.exists():
        for p in sorted(job.rglob("*")):
            rel = p.relative_to(job).as_posix()
            tree.append(rel + ("/" if p.is_dir() else ""))
            if p.is_file():
                target = dest / "files" / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(norm(p.read_text(errors="replace")))
    (dest / "render.tree").write_text("".join(t + "\n" for t in tree))
    shutil.rmtree(work, ignore_errors=True)
    return 0


def run_matrix(args) -> int:
    repo = Path(args.repo).absolute()
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="render-matrix-") as tmp_name:
        tmp = Path(tmp_name)
        env = base_env(repo, make_fakes(tmp))
        norm = Normalizer(repo, tmp)
        cases = build_cases(repo, args.python, env)
        if args.k:
            cases = [c for c in cases if any(k in c["id"] for k in args.k)]
        with ThreadPoolExecutor(max_workers=args.workers) as pool:
            list(pool.map(lambda c: run_case(c, repo, args.python, env, tmp, out, norm), cases))
        (out / "CASES.txt").write_text("".join(c["id"] + "\n" for c in cases))
        if args.check_stable:
            again = Path(tempfile.mkdtemp(prefix="render-matrix-again-"))
            sample = cases[:: max(1, len(cases) // 20)]
            for c in sample:
                run_case(c, repo, args.python, env, tmp, again, norm)
            diffs = [d for c in sample for d in compare_dirs(out / c["id"], again / c["id"])]
            shutil.rmtree(again)
            print(f"stability: {len(sample)} cases rerun, {len(diffs)} differences", file=sys.stderr)
            for d in diffs:
                print("  " + d, file=sys.stderr)
    print(f"{len(cases)} cases from {repo} into {out} in {time.time() - started:.0f} s", file=sys.stderr)
    return 0


def compare_dirs(a: Path, b: Path) -> list[str]:
    """Paths (relative) that differ between two trees: missing on one side or different bytes."""
    diffs: list[str] = []

    def walk(cmp: filecmp.dircmp, rel: str) -> None:
        for name in sorted(cmp.left_only):
            diffs.append(f"only in {a.name}: {rel}{name}")
        for name in sorted(cmp.right_only):
            diffs.append(f"only in {b.name}: {rel}{name}")
        for name in sorted(cmp.common_files):
            if (Path(cmp.left) / name).read_bytes() != (Path(cmp.right) / name).read_bytes():
                diffs.append(f"differs: {rel}{name}")
        for name, sub in sorted(cmp.subdirs.items()):
            walk(sub, f"{rel}{name}/")

    walk(filecmp.dircmp(a, b, ignore=[]), "")
    return diffs


def compare(a: Path, b: Path) -> int:
    diffs = compare_dirs(a, b)
    for d in diffs:
        print(d)
        if d.startswith("differs: "):
            rel = d[len("differs: "):]
            lines = difflib.unified_diff((a / rel).read_text(errors="replace").splitlines(),
                                         (b / rel).read_text(errors="replace").splitlines(), lineterm="", n=1)
            for line in list(lines)[:20]:
                print("    " + line)
    n = len([p for p in a.iterdir() if p.is_dir()])
    print(f"{n} cases in {a}; {len(diffs)} differences", file=sys.stderr)
    return 1 if diffs else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="directory to write the cases into")
    ap.add_argument("--repo", default=str(DEFAULT_REPO), help="repository (worktree) under test")
    ap.add_argument("--python", default=sys.executable, help="Python that runs `-m ogrpo`")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("-k", action="append", help="only cases whose id contains this (repeatable)")
    ap.add_argument("--check-stable", action="store_true", help="rerun a sample and report any difference")
    ap.add_argument("--compare", nargs=2, metavar=("BASE", "NEW"), help="compare two stored matrices")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(Path(args.compare[0]), Path(args.compare[1]))
    if not args.out:
        ap.error("give an output directory (or --compare BASE NEW)")
    return run_matrix(args)


if __name__ == "__main__":
    sys.exit(main())
