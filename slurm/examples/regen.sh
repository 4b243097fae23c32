#!/bin/bash
# Re-render the example jobs after an intended change to the planner or the templates; the test
# tests/test_render.py::test_examples_are_what_render_produces keeps them identical to `ogrpo render`.
# Each example is rendered next to the old one and swapped in only when rendering succeeded.
set -euo pipefail
cd "$(dirname "$0")/../.."
# The examples are for a cluster that is not this one: render asks no Slurm controller for its KillWait
export SLURM_CONF=/nonexistent
# ... and the job's Python is the cluster's shared venv, not this machine's (tests/test_render.py sets the same)
export OGRPO_PYTHON=/shared/ogrpo/.venv/bin/python
while read -r name gpus recipe; do
  [[ -z "$name" || "$name" == \#* ]] && continue
  new="slurm/examples/.$name.new"
  rm -rf "$new"
  ogrpo render --gpus "$gpus" --config "slurm/examples/recipes/$recipe" -o "$new" \
    --job-dir "/shared/ogrpo-jobs/$name" >/dev/null
  rmdir "$new/logs" 2>/dev/null || true
  rm -rf "slurm/examples/$name"
  mv "$new" "slurm/examples/$name"
done < slurm/examples/examples.txt
