#!/usr/bin/env bash
# Builder stage: compile every arch-specific wheel of one GPU family's image into OUTDIR.
#
#   build-wheels.sh [--check] [--part deps|project|all] FAMILY LOCK OUTDIR
#
# --part deps builds the third-party wheels (one Docker layer that only the lock invalidates: flash-attn takes
# an hour), --part project the ogrpo wheel and build-info.json (invalidated by any source change); all = both.
#
# 1. checks that the build environment (TORCH_CUDA_ARCH_LIST, FLASH_ATTN_CUDA_ARCHS, set by the Dockerfile)
#    is exactly the family's (docker/tags.py env FAMILY) — one arch per image, never V100 and A40 together,
#    because DeepSpeed drops BF16 from every op when the list holds an arch with major <= 7;
# 2. installs the lock's binary packages (torch and friends) so the extensions compile against the exact torch
#    the runtime stage will have (flash-attn "undefined symbol" errors come from building against another);
# 3. builds flash-attn (A40 only, FLASH_ATTN_CUDA_ARCHS=80), DeepSpeed with its CUDA ops prebuilt for the
#    family, the (pure) ogrpo wheel, and our kernels' extensions (ogrpo/kernels/*/csrc/) for the family's arch
#    into OUTDIR/kernels (OGRPO_BUILD_EXTENSIONS=0 skips them); build-info.json lists the built modules, which
#    the self-check reads;
# 4. writes OUTDIR/build-info.json.
#
# Test mode (--check or OGRPO_BUILD_DRYRUN=1): validates the inputs and resolves everything above, printing
# each command instead of running it; needs no nvcc, no network and no GPU.
set -euo pipefail

DRYRUN="${OGRPO_BUILD_DRYRUN:-0}"
PART=all
while [[ "${1:-}" == --* ]]; do
  case "$1" in
    --check) DRYRUN=1 ;;
    --part)
      PART="${2:-}"
      shift
      ;;
    *)
      echo "build-wheels: unknown option $1" >&2
      exit 2
      ;;
  esac
  shift
done
if [[ $# -ne 3 || ! "$PART" =~ ^(deps|project|all)$ ]]; then
  echo "usage: build-wheels.sh [--check] [--part deps|project|all] FAMILY LOCK OUTDIR" >&2
  exit 2
fi
FAMILY="$1"
LOCK="$2"
OUTDIR="$3"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SRC="${OGRPO_SRC:-$(cd "$HERE/../.." && pwd)}"
PYTHON="${PYTHON:-python3}"
PIP=("$PYTHON" -m pip)

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[[ -f "$LOCK" ]] || die "lock file $LOCK not found"
command -v "$PYTHON" >/dev/null || die "$PYTHON not found"

# --- 1. the family's build environment -------------------------------------------------------------
family_env="$("$PYTHON" "$SRC/docker/tags.py" env "$FAMILY")" || die "unknown family $FAMILY"
want() { sed -n "s/^$1=//p" <<<"$family_env"; }
WANT_ARCH="$(want TORCH_CUDA_ARCH_LIST)"
WANT_FA="$(want FLASH_ATTN_CUDA_ARCHS)"
KERNEL_SM="$(want OGRPO_KERNEL_SM)"

[[ "${TORCH_CUDA_ARCH_LIST:-}" == "$WANT_ARCH" ]] ||
  die "TORCH_CUDA_ARCH_LIST='${TORCH_CUDA_ARCH_LIST:-}' but the $FAMILY image needs exactly '$WANT_ARCH'"
# belt and braces against a hand-edited family table: one arch, and never a <=7.x arch next to an 8.x one
read -r -a archs <<<"${TORCH_CUDA_ARCH_LIST//;/ }"
[[ ${#archs[@]} -eq 1 ]] || die "TORCH_CUDA_ARCH_LIST must hold one arch per image, got '${TORCH_CUDA_ARCH_LIST}'"
[[ "${FLASH_ATTN_CUDA_ARCHS:-}" == "$WANT_FA" ]] ||
  die "FLASH_ATTN_CUDA_ARCHS='${FLASH_ATTN_CUDA_ARCHS:-}' but the $FAMILY image needs '${WANT_FA}'"

# --- 2. what the lock asks for -----------------------------------------------------------------------
pin_of() { # the version pinned for $1 in the lock, or nothing
  sed -n "s/^$1==\([^ #]*\).*/\1/p" "$LOCK"
}
mapfile -t BUILDER_PINS < <(grep -E '^[A-Za-z0-9._-]+==[^ ]+ +# \[builder\]' "$LOCK" | sed 's/ .*//')
[[ ${#BUILDER_PINS[@]} -gt 0 ]] || die "$LOCK marks no [builder] packages (deepspeed at least)"
DS_VERSION="$(pin_of deepspeed)"
FA_VERSION="$(pin_of flash-attn)"
[[ -n "$DS_VERSION" ]] || die "$LOCK does not pin deepspeed"
if [[ -n "$WANT_FA" && -z "$FA_VERSION" ]]; then die "the $FAMILY image needs flash-attn but $LOCK does not pin it"; fi
if [[ -z "$WANT_FA" && -n "$FA_VERSION" ]]; then die "$LOCK pins flash-attn $FA_VERSION, which cannot run on $FAMILY"; fi

run mkdir -p "$OUTDIR"
RUNTIME_REQS="$(mktemp)"
trap 'rm -f "$RUNTIME_REQS"' EXIT
grep -Ev '# \[builder\]' "$LOCK" >"$RUNTIME_REQS"
echo "build-wheels: family=$FAMILY TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST FLASH_ATTN_CUDA_ARCHS=${FLASH_ATTN_CUDA_ARCHS:-none} builder=${BUILDER_PINS[*]}"

# --- 3. compile ----------------------------------------------------------------------------------------
if [[ "$DRYRUN" != "1" ]]; then
  command -v nvcc >/dev/null || die "nvcc not found: the builder stage must be a CUDA devel image"
fi
# nvcc uses ~5 GB RAM per thread on flash-attn's kernels: keep jobs x threads within the builder's memory
export MAX_JOBS="${MAX_JOBS:-4}"
export NVCC_THREADS="${NVCC_THREADS:-2}"

if [[ "$PART" != "project" ]]; then
  run "${PIP[@]}" install --no-deps --no-cache-dir --only-binary=:all: -r "$RUNTIME_REQS"
  run "${PIP[@]}" install --no-deps --no-cache-dir --only-binary=:all: -r "$SRC/requirements/build-tools.lock"

  if [[ -n "$WANT_FA" ]]; then
    # FORCE_BUILD: never take flash-attn's prebuilt wheel (built for 4 archs against another torch)
    run env FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS="$WANT_FA" \
      "${PIP[@]}" wheel --no-build-isolation --no-deps --no-cache-dir --no-binary flash-attn \
      -w "$OUTDIR" "flash-attn==$FA_VERSION"
  fi

  # DeepSpeed ops prebuilt for the family: the CUDA optimizers ZeRO uses and the CPU Adam that
  # offload_optimizer needs; async I/O (NVMe offload) and the inference/sparse kernels stay JIT-only.
  # DS_ACCELERATOR=cuda: `docker build` has no GPU, and DeepSpeed's auto-detection would then build (and
  # record in the wheel) the CPU accelerator instead.
  DS_OPS=(DS_ACCELERATOR=cuda DS_BUILD_OPS=0 DS_BUILD_FUSED_ADAM=1 DS_BUILD_FUSED_LAMB=1 DS_BUILD_CPU_ADAM=1 DS_BUILD_CPU_ADAGRAD=1 DS_BUILD_UTILS=1)
  # The CPU ops must run on every node, not only on a CPU like the builder's: DeepSpeed hard-codes
  # -march=native for them, so its source is patched to x86-64-v3 first (portable_cpu_ops.py).
  DS_SRC="$OUTDIR/.deepspeed-src"
  run "${PIP[@]}" download --no-deps --no-binary :all: --no-cache-dir -d "$DS_SRC" "deepspeed==$DS_VERSION"
  run tar -xzf "$DS_SRC/deepspeed-$DS_VERSION.tar.gz" -C "$DS_SRC"
  run "$PYTHON" "$HERE/portable_cpu_ops.py" "$DS_SRC/deepspeed-$DS_VERSION"
  run env "${DS_OPS[@]}" TORCH_CUDA_ARCH_LIST="$TORCH_CUDA_ARCH_LIST" \
    "${PIP[@]}" wheel --no-build-isolation --no-deps --no-cache-dir -w "$OUTDIR" "$DS_SRC/deepspeed-$DS_VERSION"
  run rm -rf "$DS_SRC"
  # belt and braces: no AVX-512 (zmm) instruction in the prebuilt CPU Adam, whatever the builder's CPU
  if [[ "$DRYRUN" != "1" ]]; then
    ds_wheel="$(compgen -G "$OUTDIR/deepspeed-*.whl" | head -n1)"
    ds_tmp="$(mktemp -d)"
    "$PYTHON" -m zipfile -e "$ds_wheel" "$ds_tmp"
    cpu_adam="$(find "$ds_tmp" -name 'cpu_adam_op*.so' | head -n1)"
    [[ -n "$cpu_adam" ]] || die "the DeepSpeed wheel has no prebuilt cpu_adam op (DS_BUILD_CPU_ADAM=1)"
    if objdump -d "$cpu_adam" | grep -q '%zmm'; then die "$cpu_adam uses AVX-512: not portable"; fi
    rm -rf "$ds_tmp"
  fi
fi
[[ "$PART" == "deps" ]] && exit 0

# The ogrpo wheel is pure Python (the kernels' C++/CUDA sources ride along as package data).
run "${PIP[@]}" wheel --no-build-isolation --no-deps --no-cache-dir -w "$OUTDIR" "$SRC"

# Our own extensions (ogrpo/kernels/<op>/csrc/): compiled here for exactly the family's arch by the same
# builder a job uses (`python -m ogrpo.kernels build`), into OUTDIR/kernels, which the runtime stage installs
# read-only as OGRPO_KERNELS_PREBUILT; the build key (torch, sources, flags, arch list) is the runtime's, so
# the runtime loads these modules and never compiles (it has no nvcc). OGRPO_BUILD_EXTENSIONS=0 skips them
# (a quick image): the ops then run their PyTorch reference, and the self-check accepts that because
# build-info.json lists no extensions.
KERNEL_DIR="$OUTDIR/kernels"
KERNEL_NAMES=()
if [[ -d "$SRC/ogrpo/kernels" ]]; then
  mapfile -t KERNEL_NAMES < <(find "$SRC/ogrpo/kernels" -mindepth 3 -maxdepth 3 -path '*/csrc/*' -type f \
    \( -name '*.cu' -o -name '*.cpp' \) | sed 's|.*/kernels/\([^/]*\)/csrc/.*|\1|' | sort -u)
fi
BUILD_EXTENSIONS="${OGRPO_BUILD_EXTENSIONS:-1}"
[[ "$BUILD_EXTENSIONS" =~ ^[01]$ ]] || die "OGRPO_BUILD_EXTENSIONS must be 0 or 1, got '$BUILD_EXTENSIONS'"
if [[ ${#KERNEL_NAMES[@]} -eq 0 ]]; then
  echo "build-wheels: no project extensions (ogrpo/kernels/*/csrc/ has no .cu/.cpp sources)"
elif [[ "$BUILD_EXTENSIONS" == "0" ]]; then
  echo "build-wheels: OGRPO_BUILD_EXTENSIONS=0: extensions not built (${KERNEL_NAMES[*]} run their PyTorch reference)"
  KERNEL_NAMES=()
else
  echo "build-wheels: extensions ${KERNEL_NAMES[*]}: building for sm_$KERNEL_SM into $KERNEL_DIR"
  run env PYTHONPATH="$SRC" TORCH_CUDA_ARCH_LIST="$TORCH_CUDA_ARCH_LIST" MAX_JOBS="$MAX_JOBS" \
    "$PYTHON" -m ogrpo.kernels build --cuda --out "$KERNEL_DIR"
  # the runtime needs only the modules, not the objects and ninja files beside them
  run find "$KERNEL_DIR" -type f ! -name '*.so' -delete
fi

# --- 4. build-info.json ----------------------------------------------------------------------------------
EXTENSIONS_JSON="[]"
if [[ ${#KERNEL_NAMES[@]} -gt 0 && "$DRYRUN" != "1" ]]; then
  # the runtime finds the modules by a hash of the installed sources: the wheel must ship them
  "$PYTHON" -c 'import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
missing = [k for k in sys.argv[2:] if not any(n.startswith(f"ogrpo/kernels/{k}/csrc/") for n in names)]
sys.exit(f"the ogrpo wheel lacks the sources of {missing}: package-data must include kernels/*/csrc/*" if missing else 0)' \
    "$(compgen -G "$OUTDIR/ogrpo-*.whl" | head -n1)" "${KERNEL_NAMES[@]}"
  EXTENSIONS_JSON="$(cd "$KERNEL_DIR" && find . -name '*.so' | sed 's|^\./||' | sort |
    "$PYTHON" -c 'import json, sys; print(json.dumps([ln.strip() for ln in sys.stdin if ln.strip()]))')"
  [[ "$EXTENSIONS_JSON" != "[]" ]] || die "ogrpo/kernels has sources but $KERNEL_DIR holds no compiled extension"
fi
INFO="$("$PYTHON" -c 'import json, sys
print(json.dumps({"family": sys.argv[1], "torch_cuda_arch_list": sys.argv[2], "flash_attn_cuda_archs": sys.argv[3] or None,
                  "kernel_sm": int(sys.argv[4]), "builder_pins": sys.argv[5].split(), "extensions": json.loads(sys.argv[6]),
                  "kernels": sys.argv[7].split()},
                 indent=1, sort_keys=True))' \
  "$FAMILY" "$TORCH_CUDA_ARCH_LIST" "${WANT_FA}" "$KERNEL_SM" "${BUILDER_PINS[*]}" "$EXTENSIONS_JSON" "${KERNEL_NAMES[*]}")"
if [[ "$DRYRUN" == "1" ]]; then
  echo "build-wheels: would write $OUTDIR/build-info.json:"
  echo "$INFO"
else
  echo "$INFO" >"$OUTDIR/build-info.json"
  ls -l "$OUTDIR"
fi
