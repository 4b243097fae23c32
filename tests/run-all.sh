#!/usr/bin/env bash
# The whole suite: unit tests, then integration (vLLM, accelerate) and the real Slurm tests against a
# one-node cluster this script starts and stops (tests/slurm/cluster.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export OGRPO_SLURM_ROOT=${OGRPO_SLURM_ROOT:-/tmp/ogrpo-slurm-test}

started=0
if [ -x tests/slurm/cluster.sh ] || [ -f tests/slurm/cluster.sh ]; then
  if bash tests/slurm/cluster.sh up; then started=1; else echo "slurm test cluster did not start" >&2; exit 1; fi
fi
stop() { [ "$started" = 1 ] && bash tests/slurm/cluster.sh down; }
trap stop EXIT

"$PY" -m pytest -v --durations=25 "$@"
rc=$?
# pytest exit 5 = nothing collected: that is a failure here, never a pass.
[ "$rc" = 5 ] && { echo "no tests ran" >&2; exit 1; }
exit "$rc"
