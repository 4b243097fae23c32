#!/bin/bash
# Re-render the example jobs after an intended change to the planner or the templates; the test
# tests/test_render.py::test_examples_are_what_render_produces keeps them identical to `ogrpo render`.
set -euo pipefail
cd "$(dirname "$0")/../.."
while read -r name gpus recipe; do
  [[ -z "$name" || "$name" == \#* ]] && continue
  rm -rf "slurm/examples/$name"
  ogrpo render --gpus "$gpus" --config "slurm/examples/recipes/$recipe" -o "slurm/examples/$name" \
    --job-dir "/shared/ogrpo-jobs/$name" >/dev/null
  rmdir "slurm/examples/$name/logs" 2>/dev/null || true
done < slurm/examples/examples.txt
