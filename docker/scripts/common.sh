# shellcheck shell=bash
# Shared by build-wheels.sh and install-runtime.sh (sourced, not run): error exit and dry-run-aware command.
# The caller sets DRYRUN; messages carry the calling script's name.

die() {
  echo "$(basename "$0" .sh): $*" >&2
  exit 1
}

# In dry-run mode (--check) print the command, shell-quoted, instead of running it.
run() {
  if [[ "$DRYRUN" == "1" ]]; then
    printf '+'
    printf ' %q' "$@"
    printf '\n'
  else
    "$@"
  fi
}
