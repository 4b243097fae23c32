#!/usr/bin/env python3
"""The one place image names, tags and per-family build settings are computed (Makefile, workflow, build
scripts and tests all ask this script).

    python3 docker/tags.py tag v100            # ogrpo:0.1.0-v100-cu128-torch2.10.0
    python3 docker/tags.py tag a40 --image ghcr.io/acme/ogrpo
    python3 docker/tags.py env a40             # KEY=VALUE lines: the family's build environment
    python3 docker/tags.py matrix              # JSON list for the CI workflow's build matrix

The tag carries every version that decides whether the image runs on a node: O-GRPO's version, the family,
the CUDA toolkit, torch and (A40) flash-attn, all read from ogrpo/__init__.py, ogrpo/stacks.py and
requirements/<family>.lock. Reads files only (no torch, no Docker), so it runs on any CI runner or login node.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ogrpo.stacks import FAMILIES, family, read_lock  # noqa: E402

DEFAULT_IMAGE = "ogrpo"
# docker: tag = [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}
TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def ogrpo_version(root: Path = ROOT) -> str:
    text = (root / "ogrpo" / "__init__.py").read_text()
    m = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', text, re.M)
    if not m:
        raise SystemExit("ogrpo/__init__.py has no __version__")
    return m.group(1)


def lock_path(name: str, root: Path = ROOT) -> Path:
    return root / "requirements" / f"{family(name).name}.lock"


def tag(name: str, root: Path = ROOT) -> str:
    """The image tag (without the image name) for family NAME."""
    fam = family(name)
    pins = read_lock(lock_path(name, root))
    parts = [ogrpo_version(root), fam.name, fam.cuda_tag, f"torch{pins['torch']}"]
    if fam.flash_attn_cuda_archs:
        parts.append(f"fa{pins['flash-attn']}")
    text = "-".join(parts).replace("+", "_")
    if not TAG_RE.match(text):
        raise SystemExit(f"computed tag {text!r} is not a valid Docker tag")
    return text


def reference(name: str, image: str = DEFAULT_IMAGE, root: Path = ROOT) -> str:
    return f"{image}:{tag(name, root)}"


def build_env(name: str) -> dict[str, str]:
    fam = family(name)
    env = fam.env()
    env["OGRPO_CUDA"] = fam.cuda
    env["OGRPO_PRECISION"] = fam.precision
    return env


def matrix(image: str = DEFAULT_IMAGE, root: Path = ROOT) -> list[dict[str, str]]:
    return [
        {
            "family": name,
            "dockerfile": f"docker/Dockerfile.{name}",
            "tag": tag(name, root),
            "image": reference(name, image, root),
            "sif": f"ogrpo-{tag(name, root)}.sif",
        }
        for name in sorted(FAMILIES)
    ]


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="docker/tags.py")
    parser.add_argument("what", choices=["tag", "ref", "env", "matrix", "lock"])
    parser.add_argument("family", nargs="?")
    parser.add_argument("--image", default=DEFAULT_IMAGE, help="image name (registry/repo), default ogrpo")
    args = parser.parse_args(argv)
    if args.what != "matrix" and not args.family:
        parser.error(f"{args.what} needs a family ({', '.join(sorted(FAMILIES))})")
    try:
        if args.what == "tag":
            print(tag(args.family))
        elif args.what == "ref":
            print(reference(args.family, args.image))
        elif args.what == "lock":
            print(lock_path(args.family).relative_to(ROOT))
        elif args.what == "env":
            for key, value in build_env(args.family).items():
                print(f"{key}={value}")
        else:
            print(json.dumps(matrix(args.image)))
    except ValueError as exc:
        print(f"docker/tags.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
