#!/usr/bin/env python3
"""Make DeepSpeed's prebuilt CPU ops portable before the builder compiles them.

    portable_cpu_ops.py DEEPSPEED_SOURCE_DIR

DeepSpeed compiles its host-side ops (cpu_adam, cpu_adagrad, cpu_lion: what ZeRO offload runs) with
`OpBuilder.cpu_arch()` = `-march=native` and `simd_width()` = the build host's widest SIMD (`-D__AVX512__`
on an AVX-512 builder). A wheel built that way dies with SIGILL on the cluster's CPUs when they lack what the
build machine had (AVX-512 on AMD EPYC nodes, for one), and there is no environment variable to change it.
This rewrites the two methods in op_builder/builder.py to return x86-64-v3 (AVX2 + FMA: every Haswell/EPYC or
newer host of a V100/A40) and the matching AVX2 code path. It refuses (exit 1) when the methods are not found
exactly once, so a DeepSpeed release that moves them stops the build instead of shipping -march=native.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

MARCH = "-march=x86-64-v3"
SIMD = "-D__AVX256__"  # DeepSpeed's name for its AVX2 (256-bit) code path
MARKER = "# ogrpo: portable CPU ops"


def patch(text: str) -> str:
    for method, value in (("cpu_arch", MARCH), ("simd_width", SIMD)):
        pattern = re.compile(rf"^(?P<indent>[ \t]+)def {method}\(self\):[ \t]*\n", re.M)
        found = pattern.findall(text)
        if len(found) != 1:
            raise SystemExit(f"portable_cpu_ops: expected one `def {method}(self):` in op_builder/builder.py, "
                             f"found {len(found)}: DeepSpeed moved it; update docker/scripts/portable_cpu_ops.py")
        # the original body stays below the early return (dead code), so the diff against upstream is one line
        text = pattern.sub(lambda m: f"{m.group(0)}{m.group('indent') * 2}return {value!r}  {MARKER}\n", text)
    return text


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: portable_cpu_ops.py DEEPSPEED_SOURCE_DIR", file=sys.stderr)
        return 2
    builder = Path(argv[0]) / "op_builder" / "builder.py"
    if not builder.is_file():
        print(f"portable_cpu_ops: {builder} not found (not a DeepSpeed source tree)", file=sys.stderr)
        return 1
    text = builder.read_text()
    if MARKER not in text:
        builder.write_text(patch(text))
    print(f"portable_cpu_ops: {builder}: cpu_arch() -> {MARCH}, simd_width() -> {SIMD}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
