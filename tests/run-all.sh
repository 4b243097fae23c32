#!/usr/bin/env bash
# The whole suite: unit tests, then integration (vLLM, accelerate) and the real Slurm tests against a
# one-node cluster this script starts and stops (tests/slurm/cluster.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export OGRPO_SLURM_ROOT=${OGRPO_SLURM_ROOT:-/tmp/ogrpo-slurm-test}

# The second env (the GPU images' Python line, requirements/trl19-cpu.lock) is built, then its suite (tests/trl19)
# run, beside the main suite: its install is mostly waiting on ~4 GB of downloads. Missing or failing, it is a
# failure, never a skip: CI must build it. Logs: build/setup-trl19.log, build/trl19-suite.log.
PY_TRL19=${PY_TRL19:-.venv-trl19/bin/python}
trl19_chain() {
  if [ "$PY_TRL19" = .venv-trl19/bin/python ] && ! make -s -q setup-trl19 2>/dev/null; then
    if ! make -s --no-print-directory setup-trl19 >build/setup-trl19.log 2>&1; then
      tail -n 20 build/setup-trl19.log
      echo "make setup-trl19 failed; the full log is build/setup-trl19.log" >&2
      return 1
    fi
  fi
  if [ ! -x "$PY_TRL19" ]; then
    echo "no $PY_TRL19: build it with \`make setup-trl19\` (\`make test\` does)" >&2
    return 1
  fi
  local t=$SECONDS
  "$PY_TRL19" -m pytest -v --durations=10 -p no:cacheprovider tests/trl19
  local rc=$?
  echo "trl19 suite: $((SECONDS - t)) s"
  [ "$rc" = 5 ] && { echo "no trl19 tests ran" >&2; return 1; }
  return "$rc"
}
mkdir -p build
trl19_chain >build/trl19-suite.log 2>&1 &
trl19_suite=$!

started=0
if [ -x tests/slurm/cluster.sh ] || [ -f tests/slurm/cluster.sh ]; then
  if bash tests/slurm/cluster.sh up; then started=1; else echo "slurm test cluster did not start" >&2; exit 1; fi
fi
# an early exit takes the suites running beside with it
stop() { jobs -pr | xargs -r kill 2>/dev/null; [ "$started" = 1 ] && bash tests/slurm/cluster.sh down; }
trap stop EXIT

# The real-Slurm tests (tests/slurm) run beside the rest too: much of their time is waiting on the scheduler, a
# requeue's delay or a job's polling, which the other tests' CPU work fills (on 2 cores the suite one after the
# other took ~75 min, near CI's 90). Their output is shown after the rest's. tests/trl19 needs the images' TRL
# line: it runs in the second env (trl19_chain above), not here.
mkdir -p build
t_main=$SECONDS
"$PY" -m pytest -v --durations=15 -p no:cacheprovider tests/slurm "$@" >build/slurm-suite.log 2>&1 &
slurm_suite=$!
# The main suite on both cores: one module per worker at a time (its module fixtures built once), longest first
# (tests/conftest.py, tests/module_seconds.json); one test at a time left a core idle much of the time once the
# Slurm tests were done. build/junit-main.xml refreshes the modules' seconds (tests/module_seconds.py).
"$PY" -m pytest -v -n 2 --dist loadfile --no-loadscope-reorder --durations=25 --junitxml=build/junit-main.xml \
  --ignore=tests/trl19 --ignore=tests/slurm "$@"
rc=$?
echo "main suite (without tests/slurm): $((SECONDS - t_main)) s"
wait "$slurm_suite"
rc_slurm=$?
echo "==== tests/slurm (ran beside the main suite) ===="
cat build/slurm-suite.log
echo "main suite with tests/slurm: $((SECONDS - t_main)) s"
# pytest exit 5 = nothing collected: that is a failure here, never a pass.
[ "$rc" = 5 ] && { echo "no tests ran" >&2; exit 1; }
[ "$rc_slurm" = 5 ] && { echo "no slurm tests ran" >&2; exit 1; }
[ "$rc" = 0 ] && rc=$rc_slurm

wait "$trl19_suite"
rc19=$?
echo "==== tests/trl19 in .venv-trl19 (ran beside the main suite) ===="
cat build/trl19-suite.log
[ "$rc" = 0 ] || exit "$rc"
exit "$rc19"
