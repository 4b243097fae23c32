"""Build-time self-check of a GPU image: the last step of the Dockerfile, so a wrong image never gets a tag.

    python -m ogrpo.checks.image --family a40 --lock /opt/ogrpo/requirements.lock --build-info /opt/ogrpo/build-info.json
    python -m ogrpo.checks.image --family v100 --facts facts.json      # judge recorded facts (tests, debugging)

It fails (exit 1, one line per problem) when:
- torch was not compiled for the family's GPU (`torch.cuda.get_arch_list()`), or is a build for another CUDA
  major than the image's toolkit (the builder compiled flash-attn and DeepSpeed with that toolkit's nvcc);
- `import flash_attn` fails, or flash-attn is present where it cannot run (V100);
- vLLM's own kernels (vllm/_C) have no code for the GPU (compat.md: the last vLLM wheels with sm_70 are
  0.19.x; the 0.19.1 wheel's vllm/_C carries sm_70 and sm_80 cubins, and every build re-checks it here);
- the compiled kernels of DeepSpeed's prebuilt ops, flash-attn or our own extensions (`ogrpo/kernels/*/csrc`,
  built by the builder into $OGRPO_KERNELS_PREBUILT and listed in its build-info.json) carry no code for the
  family's GPU — read from each library's fatbin, so the check needs no GPU and no CUDA toolkit (`docker
  build` has neither);
- one of our ops does not load its prebuilt extension, or, run against its PyTorch reference on a small
  random input, disagrees with it: on the CPU always (its module ships too), on the GPU when one is present
  (`docker build` has none: the check runs again where the image starts on a GPU, e.g. the .sif's %test);
- the A40's DeepSpeed ops were built for an arch with major <= 7 (DeepSpeed then drops BF16 from every op);
- the torch/vLLM/flash-attn versions do not fit the family, or the TRL/vLLM pair is not one `ogrpo doctor`
  supports (ogrpo.stacks, the same data doctor reads);
- an installed version differs from the image's lock file.

`gather()` collects the facts inside the image; `evaluate()` judges them and is pure, which is what the tests
exercise with fake facts.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import struct
import sys
from pathlib import Path

from ogrpo.stacks import (
    Family,
    arch_runs_on,
    check_family_versions,
    family,
    normalize_name,
    parse_version,
    read_lock,
)
from ogrpo.kernels import _build
from ogrpo.kernels.fused_sample import fused_sample, fused_sample_reference
from ogrpo.kernels.linear_logprobs import linear_logprobs, linear_logprobs_reference

FATBIN_MAGIC = 0xBA55ED50
DEFAULT_PREBUILT = "/opt/ogrpo/kernels"  # the image's OGRPO_KERNELS_PREBUILT (install-runtime.sh INFODIR/kernels)
_KIND = {1: "compute", 2: "sm", 0x10: "sm"}  # PTX / ELF cubin / ELF cubin (alternate)


def fatbin_archs(data: bytes) -> set[str]:
    """Arch entries ('sm_80' cubins, 'compute_80' PTX) of every CUDA fatbin container inside DATA (an ELF
    shared library or a bare .fatbin).

    Container: u32 magic 0xBA55ED50, u16 version 1, u16 header size 16, u64 size of the entries that follow.
    Entry: u16 kind (1 PTX, 2 ELF), u16, u32 entry header size, u64 padded payload size, ..., u32 sm at
    offset 28; the next entry starts after header + payload. (Layout as cuobjdump reads it.)
    """
    archs: set[str] = set()
    magic = struct.pack("<I", FATBIN_MAGIC)
    pos = data.find(magic)
    while pos != -1:
        if pos + 16 <= len(data):
            _, version, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
            end = pos + header_size + fat_size
            if version == 1 and header_size == 16 and end <= len(data):
                entry = pos + header_size
                while entry + 32 <= end:
                    kind, _, entry_size, payload = struct.unpack_from("<HHIQ", data, entry)
                    (sm,) = struct.unpack_from("<I", data, entry + 28)
                    if entry_size < 32:
                        break
                    if kind in _KIND and 10 <= sm < 1000:
                        archs.add(f"{_KIND[kind]}_{sm}")
                    entry += entry_size + payload
                pos = max(end, pos + 1)
                pos = data.find(magic, pos)
                continue
        pos = data.find(magic, pos + 4)
    return archs


def file_archs(path: Path) -> set[str]:
    with open(path, "rb") as fh:
        try:
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return fatbin_archs(mm)  # type: ignore[arg-type]
        except ValueError:  # empty file
            return set()


# ---------------------------------------------------------------------------------------------------------
# judging (pure)


def evaluate(fam: Family, facts: dict, lock: dict[str, str] | None = None) -> list[str]:
    """Problems with an image for FAM, from FACTS (see gather()); empty = the image is right."""
    problems: list[str] = []
    target = fam.sm

    arch_list = facts.get("arch_list") or []
    if not any(arch_runs_on(a, target) and a.startswith("sm_") for a in arch_list):
        problems.append(
            f"torch is not compiled for {fam.gpu}: torch.cuda.get_arch_list() = {arch_list or '[]'} "
            f"has no sm_{target // 10}x binary that runs on sm_{target}"
        )
    torch_cuda = facts.get("torch_cuda")
    if torch_cuda and parse_version(torch_cuda)[0] != fam.cuda_major:
        problems.append(
            f"torch is a CUDA {torch_cuda} build but the {fam.name} image is CUDA {fam.cuda}: what its builder "
            f"compiled ({', '.join(fam.builder_wheels)}) needs a CUDA {fam.cuda_major} torch"
        )

    versions = {normalize_name(k): v for k, v in (facts.get("versions") or {}).items()}
    problems += check_family_versions(fam, versions)

    fa_error = facts.get("flash_attn_import")
    if fam.flash_attn_cuda_archs and fa_error:
        problems.append(f"import flash_attn failed: {fa_error}")

    kernels: dict[str, dict[str, list[str]]] = facts.get("kernels") or {}
    groups = {"vllm": "vLLM kernels (vllm/_C)", "deepspeed": "DeepSpeed ops"}
    if fam.flash_attn_cuda_archs:
        groups["flash-attn"] = "flash-attn"
    build_info = facts.get("build_info") or {}
    if build_info.get("extensions"):
        groups["ogrpo"] = "O-GRPO kernels (ogrpo/kernels)"
    for group, label in groups.items():
        files = kernels.get(group) or {}
        cuda_files = {path: archs for path, archs in files.items() if archs}
        if not cuda_files:
            problems.append(f"{label}: no compiled CUDA kernels found (was the builder's wheel installed?)")
            continue
        for path, archs in sorted(cuda_files.items()):
            if not any(arch_runs_on(a, target) for a in archs):
                problems.append(f"{label}: {path} has no code for sm_{target} (has {', '.join(sorted(archs))})")
            if group == "deepspeed" and fam.compute_capability[0] >= 8:
                old = sorted(a for a in archs if a.startswith("sm_") and int(a[3:]) < 80)
                if old:
                    problems.append(
                        f"{label}: {path} also targets {', '.join(old)}: DeepSpeed drops BF16 when the arch "
                        "list holds an arch with major <= 7 (build with TORCH_CUDA_ARCH_LIST=" +
                        f"{fam.torch_cuda_arch_list})"
                    )
    expected_ext = set(build_info.get("extensions") or [])
    found_ext = set((kernels.get("ogrpo") or {}).keys())
    for missing in sorted(expected_ext - found_ext):
        problems.append(f"O-GRPO extension {missing} listed in build-info.json is not installed")
    for op, devices in sorted((facts.get("ops") or {}).items()):
        for device, result in sorted(devices.items()):
            if result.get("status") == "failed":
                problems.append(f"O-GRPO kernel {op} ({device}): {result.get('detail')}")
    if build_info and build_info.get("family") not in (None, fam.name):
        problems.append(f"build-info.json is for family {build_info.get('family')!r}, not {fam.name!r}")

    if lock is not None:
        # a builder-compiled wheel may carry a local version (DeepSpeed appends +<git hash> when built in a
        # checkout); everything else must match exactly, local part included (2.10.0+cu126 is another torch)
        built = {normalize_name(b) for b in fam.builder_wheels}
        for name, pinned in sorted(lock.items()):
            have = versions.get(name)
            if have is not None and name in built:
                have = have.split("+", 1)[0]
            if have is None:
                problems.append(f"{name}=={pinned} is in the lock file but not installed")
            elif have != pinned:
                problems.append(f"{name} {have} is installed but the lock file pins {pinned}")
    return problems


# ---------------------------------------------------------------------------------------------------------
# gathering (inside the image)


def _package_dir(name: str) -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _so_archs(paths) -> dict[str, list[str]]:
    return {str(p): sorted(file_archs(p)) for p in paths}


def gather(build_info: dict | None = None) -> dict:
    """The facts evaluate() judges, read from this environment (imports torch; no GPU needed)."""
    from importlib import metadata

    import torch

    arch_list = list(torch.cuda.get_arch_list())
    if not arch_list and torch.version.cuda:
        # get_arch_list() is [] without a driver (docker build has none); the compiled-in list is still there
        arch_list = torch._C._cuda_getArchFlags().split()
    versions = {normalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    facts: dict = {"arch_list": arch_list, "torch_cuda": torch.version.cuda, "versions": versions, "kernels": {},
                   "build_info": build_info or {}}

    try:
        import flash_attn  # noqa: F401

        facts["flash_attn_import"] = None
    except Exception as exc:  # noqa: BLE001 - any failure to import is the finding
        facts["flash_attn_import"] = f"{type(exc).__name__}: {exc}"

    import importlib.util

    fa_spec = importlib.util.find_spec("flash_attn_2_cuda")
    if fa_spec and fa_spec.origin:
        facts["kernels"]["flash-attn"] = _so_archs([Path(fa_spec.origin)])
    vllm_root = _package_dir("vllm")
    if vllm_root is not None:
        # only the core ops library: vLLM also ships sm_90-only kernels (FA3, FlashMLA) that V100/A40 never load
        facts["kernels"]["vllm"] = _so_archs(sorted(vllm_root.glob("_C.*so")))
    ds_root = _package_dir("deepspeed")
    if ds_root is not None:
        facts["kernels"]["deepspeed"] = _so_archs(sorted(ds_root.rglob("*.so")))
    prebuilt = Path(os.environ.get("OGRPO_KERNELS_PREBUILT") or DEFAULT_PREBUILT)
    if prebuilt.is_dir():
        # named as build-info.json names them: relative to the prebuilt root
        facts["kernels"]["ogrpo"] = {str(p.relative_to(prebuilt)): a
                                     for p, a in _so_archs(sorted(prebuilt.rglob("*.so"))).items()}
    if (build_info or {}).get("extensions"):
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        facts["ops"] = {op: {d: check_op(op, d) for d in devices} for op in build_info.get("kernels") or []}
        for results in facts["ops"].values():
            results.setdefault("cuda", {"status": "skipped", "detail": "no GPU in this environment"})
    return facts


# ---------------------------------------------------------------------------------------------------------
# our ops against their references


def _check_linear_logprobs(device) -> str | None:
    import torch

    gen = torch.Generator().manual_seed(0)
    n, hid, vocab = 37, 40, 1001  # nothing a multiple of 8 or of a chunk
    h = torch.randn(n, hid, generator=gen).to(device).requires_grad_()
    w = (torch.randn(vocab, hid, generator=gen) / hid ** 0.5).to(device).requires_grad_()
    t = torch.randint(0, vocab, (n,), generator=gen).to(device)
    g = torch.randn(n, generator=gen).to(device)
    outs = []
    for fn, kw in ((linear_logprobs, {"impl": "compiled"}), (linear_logprobs_reference, {})):
        logp, ent = fn(h, w, t, 0.7, **kw)
        gh, gw = torch.autograd.grad((logp * g).sum() + ent.sum(), (h, w))
        outs.append((logp, ent, gh, gw))
    for name, a, b in zip(("logprobs", "entropy", "grad hidden", "grad weight"), *outs):
        # --use_fast_math on CUDA: exp/log within a few ulp, summed over 1001 terms
        if not torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-3):
            return f"{name} differs from the reference by {(a.float() - b.float()).abs().max().item():.3g}"
    return None


def _check_fused_sample(device) -> str | None:
    import torch

    # heavy: torch
    from ogrpo.kernels.fused_sample.reference import processed_scores

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 1001, generator=gen) * 3).to(device)
    prev = torch.randint(0, 1001, (5, 9), generator=gen).to(device)
    greedy = fused_sample(logits, 0.0, 0, 1.0, 1.3, prev, None, impl="compiled")
    want = fused_sample_reference(logits, 0.0, 0, 1.0, 1.3, prev, None)
    if not torch.equal(greedy.cpu(), want.cpu()):
        return f"greedy tokens {greedy.tolist()} differ from the reference's {want.tolist()}"
    draw = torch.Generator(device=device).manual_seed(1)
    tokens = fused_sample(logits, 0.8, 20, 0.9, 1.3, prev, draw, impl="compiled")
    allowed = processed_scores(logits, 0.8, 20, 0.9, 1.3, prev).isfinite()
    if tokens.shape != (5,) or not bool(allowed.gather(1, tokens.view(-1, 1)).all()):
        return f"sampled tokens {tokens.tolist()} outside the top-k/top-p support"
    return None


OP_CHECKS = {"linear_logprobs": _check_linear_logprobs, "fused_sample": _check_fused_sample}


def check_op(op: str, device: str) -> dict[str, str]:
    """{"status": "ok" | "failed" | "skipped", "detail"}: OP's prebuilt extension loads on DEVICE and its
    compiled path agrees with the PyTorch reference on a small odd-shaped input."""
    import torch

    try:
        ext = _build.load_extension(op, cuda=device == "cuda")
    except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
        return {"status": "failed", "detail": f"extension does not load: {type(exc).__name__}: {exc}"[:400]}
    check = OP_CHECKS.get(op)
    if check is None:
        return {"status": "skipped", "detail": f"loaded {Path(ext.__file__).name}; no reference check for {op}"}
    try:
        mismatch = check(torch.device(device))
    except Exception as exc:  # noqa: BLE001
        mismatch = f"raised {type(exc).__name__}: {exc}"[:400]
    if mismatch:
        return {"status": "failed", "detail": mismatch}
    return {"status": "ok", "detail": f"{Path(ext.__file__).name} matches the reference"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ogrpo.checks.image", description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", required=True, help="v100 or a40")
    parser.add_argument("--facts", help="judge this JSON (from --dump) instead of the running environment")
    parser.add_argument("--lock", help="the image's lock file: installed versions must equal its pins")
    parser.add_argument("--build-info", help="the builder's build-info.json (which extensions were built)")
    parser.add_argument("--dump", help="also write the gathered facts to this JSON file")
    args = parser.parse_args(argv)
    try:
        fam = family(args.family)
    except ValueError as exc:
        print(f"selfcheck: {exc}", file=sys.stderr)
        return 2
    build_info = json.loads(Path(args.build_info).read_text()) if args.build_info else None
    if args.facts:
        facts = json.loads(Path(args.facts).read_text())
        if build_info is not None:
            facts["build_info"] = build_info
    else:
        facts = gather(build_info)
    if args.dump:
        Path(args.dump).write_text(json.dumps(facts, indent=1, sort_keys=True))
    lock = read_lock(args.lock) if args.lock else None
    problems = evaluate(fam, facts, lock)
    if problems:
        for p in problems:
            print(f"selfcheck {fam.name}: FAIL: {p}", file=sys.stderr)
        return 1
    kernels = facts.get("kernels") or {}
    summary = ", ".join(f"{g}: {sum(1 for a in f.values() if a)} CUDA libs" for g, f in sorted(kernels.items()))
    ops = "; ".join(f"{op}: " + " ".join(f"{d} {r.get('status')}" for d, r in sorted(devs.items()))
                    for op, devs in sorted((facts.get("ops") or {}).items()))
    print(f"selfcheck {fam.name}: OK ({fam.gpu}; torch archs {' '.join(facts.get('arch_list') or [])}; {summary}"
          + (f"; kernels {ops}" if ops else "") + ")")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
