#!/usr/bin/env bash
# Runtime stage: install one family's locked stack plus the builder's wheels, and nothing else.
#
#   install-runtime.sh [--check] FAMILY LOCK WHEELDIR INFODIR
#
# - every lock line without the [builder] marker: `pip install --no-deps` from the index (exact pins, so the
#   resolver has nothing to choose and cannot pull a different torch);
# - every [builder] package (DeepSpeed, flash-attn) and the ogrpo wheel: only from WHEELDIR (the builder's
#   output, checked against build-info.json), never from the index, where flash-attn/DeepSpeed are sdists
#   that would need a compiler;
# - `pip check`: the lock is complete and self-consistent for this interpreter;
# - copies the lock and build-info.json to INFODIR for the self-check and for `ogrpo doctor` in the image;
# - copies our kernels' prebuilt extensions (WHEELDIR/kernels, every module build-info.json lists) to
#   INFODIR/kernels, the image's read-only OGRPO_KERNELS_PREBUILT.
#
# Test mode (--check or OGRPO_BUILD_DRYRUN=1): all checks on the inputs, commands printed, nothing installed.
set -euo pipefail

DRYRUN="${OGRPO_BUILD_DRYRUN:-0}"
if [[ "${1:-}" == "--check" ]]; then
  DRYRUN=1
  shift
fi
if [[ $# -ne 4 ]]; then
  echo "usage: install-runtime.sh [--check] FAMILY LOCK WHEELDIR INFODIR" >&2
  exit 2
fi
FAMILY="$1"
LOCK="$2"
WHEELDIR="$3"
INFODIR="$4"
PYTHON="${PYTHON:-python3}"
PIP=("$PYTHON" -m pip)

# shellcheck source-path=SCRIPTDIR source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[[ -f "$LOCK" ]] || die "lock file $LOCK not found"
[[ -f "$WHEELDIR/build-info.json" ]] || die "$WHEELDIR/build-info.json not found: copy the builder's wheels dir"
info_family="$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["family"])' "$WHEELDIR/build-info.json")"
[[ "$info_family" == "$FAMILY" ]] || die "the builder's wheels are for family '$info_family', not '$FAMILY'"

# wheel file names use '_' for '-' and may carry a local version (+cu128...)
wheel_for() { # name version -> path of its wheel in WHEELDIR, or nothing
  local stem="${1//-/_}-$2"
  compgen -G "$WHEELDIR/${stem}-*.whl" | head -n1 || true
  compgen -G "$WHEELDIR/${stem}+*.whl" | head -n1 || true
}

WHEELS=()
while read -r pin; do
  name="${pin%%==*}"
  version="${pin#*==}"
  found="$(wheel_for "$name" "$version" | head -n1)"
  [[ -n "$found" ]] || die "$name==$version is a [builder] package but $WHEELDIR has no wheel for it"
  WHEELS+=("$found")
done < <(grep -E '^[A-Za-z0-9._-]+==[^ ]+ +# \[builder\]' "$LOCK" | sed 's/ .*//')
ogrpo_wheel="$(compgen -G "$WHEELDIR/ogrpo-*.whl" | head -n1 || true)"
[[ -n "$ogrpo_wheel" ]] || die "$WHEELDIR has no ogrpo wheel"
WHEELS+=("$ogrpo_wheel")

mapfile -t EXTENSIONS < <("$PYTHON" -c 'import json, sys
print("\n".join(json.load(open(sys.argv[1])).get("extensions") or []))' "$WHEELDIR/build-info.json" | sed '/^$/d')
for ext in "${EXTENSIONS[@]}"; do
  [[ -f "$WHEELDIR/kernels/$ext" ]] || die "build-info.json lists extension $ext but $WHEELDIR/kernels has no such file"
done

REQS="$(mktemp)"
trap 'rm -f "$REQS"' EXIT
grep -Ev '# \[builder\]' "$LOCK" >"$REQS"
echo "install-runtime: family=$FAMILY $(grep -c '==' "$REQS") locked packages + ${#WHEELS[@]} builder wheels: ${WHEELS[*]##*/} + ${#EXTENSIONS[@]} kernel extensions"

run "${PIP[@]}" install --no-deps --no-cache-dir --only-binary=:all: -r "$REQS"
run "${PIP[@]}" install --no-deps --no-cache-dir "${WHEELS[@]}"
run "${PIP[@]}" check
run mkdir -p "$INFODIR"
run cp "$LOCK" "$INFODIR/requirements.lock"
run cp "$WHEELDIR/build-info.json" "$INFODIR/build-info.json"
if [[ ${#EXTENSIONS[@]} -gt 0 ]]; then
  run cp -r "$WHEELDIR/kernels" "$INFODIR/kernels"
  run chmod -R a+rX,go-w "$INFODIR/kernels"
fi
