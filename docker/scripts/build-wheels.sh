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
#    family, and the ogrpo wheel with its C++/CUDA extensions when ogrpo/csrc/ has sources (none yet: then a
#    pure wheel and build-info.json says so, which the self-check reads);
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
  run env "${DS_OPS[@]}" TORCH_CUDA_ARCH_LIST="$TORCH_CUDA_ARCH_LIST" \
    "${PIP[@]}" wheel --no-build-isolation --no-deps --no-cache-dir --no-binary deepspeed \
    -w "$OUTDIR" "deepspeed==$DS_VERSION"
fi
[[ "$PART" == "deps" ]] && exit 0

# Our own extensions: built when ogrpo/csrc/ holds sources, for exactly the family's arch.
EXT_SOURCES=()
if [[ -d "$SRC/ogrpo/csrc" ]]; then
  mapfile -t EXT_SOURCES < <(find "$SRC/ogrpo/csrc" -type f \( -name '*.cu' -o -name '*.cpp' -o -name '*.cc' \) | sort)
fi
if [[ ${#EXT_SOURCES[@]} -eq 0 ]]; then
  echo "build-wheels: no project extensions (ogrpo/csrc/ has no .cu/.cpp sources): pure ogrpo wheel"
  run env OGRPO_BUILD_EXTENSIONS=0 "${PIP[@]}" wheel --no-build-isolation --no-deps --no-cache-dir -w "$OUTDIR" "$SRC"
else
  echo "build-wheels: ${#EXT_SOURCES[@]} extension sources in ogrpo/csrc/: building for sm_$KERNEL_SM"
  run env OGRPO_BUILD_EXTENSIONS=1 TORCH_CUDA_ARCH_LIST="$TORCH_CUDA_ARCH_LIST" \
    "${PIP[@]}" wheel --no-build-isolation --no-deps --no-cache-dir -w "$OUTDIR" "$SRC"
fi

# --- 4. build-info.json ----------------------------------------------------------------------------------
EXTENSIONS_JSON="[]"
if [[ ${#EXT_SOURCES[@]} -gt 0 && "$DRYRUN" != "1" ]]; then
  wheel_file="$(ls "$OUTDIR"/ogrpo-*.whl)"
  EXTENSIONS_JSON="$("$PYTHON" -c 'import json, sys, zipfile
names = [n for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.startswith("ogrpo/") and n.endswith(".so")]
print(json.dumps(sorted(names)))' "$wheel_file")"
  [[ "$EXTENSIONS_JSON" != "[]" ]] || die "ogrpo/csrc has sources but the ogrpo wheel contains no compiled extension"
fi
INFO="$("$PYTHON" -c 'import json, sys
print(json.dumps({"family": sys.argv[1], "torch_cuda_arch_list": sys.argv[2], "flash_attn_cuda_archs": sys.argv[3] or None,
                  "kernel_sm": int(sys.argv[4]), "builder_pins": sys.argv[5].split(), "extensions": json.loads(sys.argv[6])},
                 indent=1, sort_keys=True))' \
  "$FAMILY" "$TORCH_CUDA_ARCH_LIST" "${WANT_FA}" "$KERNEL_SM" "${BUILDER_PINS[*]}" "$EXTENSIONS_JSON")"
if [[ "$DRYRUN" == "1" ]]; then
  echo "build-wheels: would write $OUTDIR/build-info.json:"
  echo "$INFO"
else
  echo "$INFO" >"$OUTDIR/build-info.json"
  ls -l "$OUTDIR"
fi
