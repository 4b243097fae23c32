"""`python -m ogrpo.kernels`: pre-build the extensions, compile-check the CUDA sources.

    python -m ogrpo.kernels build [--cuda] [--kernel NAME ...] [--out DIR]
    python -m ogrpo.kernels check-cuda [--arch sm_70 sm_86] [--json] [--report PATH] [--source X.cuh ...]

`build` compiles through `_build.load_extension` (the same cache and key a job uses, so its first step
loads instead of compiling); `make setup` runs it for the CPU part, an image's builder stage with `--cuda
--out` for its family's arch. `check-cuda` is `cuda_check` (NVRTC, no GPU needed). Exit codes: 0 ok,
1 a kernel fails the check or does not build, 2 bad input / missing tool (one line, no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ogrpo.errors import OgrpoError
from ogrpo.kernels import _build, cuda_check


def build(kernels: list[str] | None, cuda: bool, out: Path | None, verbose: bool = False) -> int:
    if cuda:
        import torch

        if not torch.version.cuda:
            raise OgrpoError(f"--cuda needs a CUDA build of torch; this is torch {torch.__version__}")
    present, with_cu = _build.available(), set(_build.available(cuda=True))
    if kernels:
        unknown = [k for k in kernels if k not in _build.KERNELS]
        if unknown:
            raise OgrpoError(f"unknown kernel {', '.join(unknown)}; known: {', '.join(_build.KERNELS)}")
        missing = [k for k in kernels if k not in present or (cuda and k not in with_cu)]
        if missing:
            raise OgrpoError(f"no {'CUDA ' if cuda else ''}sources for {', '.join(missing)} in "
                             f"{_build.KERNELS_DIR}/<kernel>/csrc/")
    targets = kernels or present
    for k in _build.KERNELS:
        if k not in targets:
            print(f"skip   {k}: no .cpp sources yet")
        elif cuda and k not in with_cu:
            print(f"skip   {k} (cuda): no .cu sources yet")
    failed = 0
    for kernel in targets:
        for variant in ([False, True] if cuda and kernel in with_cu else [False]):
            label = f"{kernel} ({'cuda' if variant else 'cpu'})"
            t0 = time.perf_counter()
            cached = _build.built_module(kernel, variant, out) is not None
            try:
                module = _build.load_extension(kernel, variant, verbose, out)
            except Exception as exc:  # noqa: BLE001 - a compiler error is the finding; report all kernels
                failed += 1
                first = str(exc).strip().splitlines()
                print(f"FAILED {label}: {first[-1] if first else type(exc).__name__}", file=sys.stderr)
                continue
            seconds = time.perf_counter() - t0
            print(f"{'cached' if cached else 'built '} {label} in {seconds:.1f} s -> {module.__file__}")
    return 1 if failed else 0


def check_cuda(archs: list[str], as_json: bool, report_path: Path | None, files: list[Path] | None = None) -> int:
    bad = [a for a in archs if not (a.startswith("sm_") and a[3:].isdigit())]
    if bad:
        raise OgrpoError(f"--arch takes names like sm_70 sm_86, got {' '.join(bad)}")
    missing = [str(f) for f in files or [] if not f.is_file()]
    if missing:
        raise OgrpoError(f"no such source: {', '.join(missing)}")
    report = cuda_check.run_check(archs, files)
    text = json.dumps(report, indent=1)
    if report_path is not None:
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report_path.write_text(text + "\n")
    print(text if as_json else cuda_check.format_report(report))
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ogrpo.kernels", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="pre-build the extensions (CPU; --cuda adds the CUDA variant)")
    b.add_argument("--cuda", action="store_true", help="also build the CUDA variant (TORCH_CUDA_ARCH_LIST)")
    b.add_argument("--kernel", action="append", help="only this kernel (repeatable); default: all present")
    b.add_argument("--out", type=Path, help="build into this directory instead of the cache (an image's "
                                            "OGRPO_KERNELS_PREBUILT)")
    b.add_argument("--verbose", action="store_true", help="show the compiler commands")
    c = sub.add_parser("check-cuda", help="compile *_kernels.cuh with NVRTC, check registers and spills")
    c.add_argument("--arch", nargs="+", default=["sm_70", "sm_86"])
    c.add_argument("--json", action="store_true", help="print the JSON report instead of the table")
    c.add_argument("--report", type=Path, help="also write the JSON report here")
    c.add_argument("--source", type=Path, nargs="+", help="check these .cuh files instead of every kernel's")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            return build(args.kernel, args.cuda, args.out, args.verbose)
        return check_cuda(args.arch, args.json, args.report, args.source)
    except OgrpoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
