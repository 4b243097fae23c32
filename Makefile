# Two commands on a fresh machine:  `make demo` (set up + a short GRPO run on CPU through the same
# plan -> launch path a cluster uses) and `make test` (set up + the whole test suite, real Slurm included).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
OGRPO := $(VENV)/bin/ogrpo

.PHONY: setup setup-trl19 demo test test-fast test-gpu gpu-wheelhouse test-gpu-lease bench clean

setup: $(VENV)/.installed

# The exact CPU lock, with uv where it can be had (seconds instead of minutes); see requirements/install.sh.
$(VENV)/.installed: requirements/cpu.lock requirements/install.sh pyproject.toml $(wildcard ogrpo/kernels/*/csrc/*)
	bash requirements/install.sh $(VENV) requirements/cpu.lock
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@# An editable install gets no bytecode, and login nodes often set PYTHONDONTWRITEBYTECODE: compiling
	@# once keeps `ogrpo --help`/`plan`/`render` from recompiling the package on every call (~50 ms).
	$(PY) -m compileall -q ogrpo
	@# O-GRPO's CPU kernels (ogrpo/kernels), built once here rather than on a run's first step.
	$(PY) -m ogrpo.kernels build
	touch $@

# CI's second environment: the GPU images' Python line (TRL 1.9.2, transformers 5.5.4, torch 2.10.0, vLLM 0.19.1
# CPU build), where tests/trl19 runs `trl vllm-serve` and TRL 1.9's trainer for real (tests/run-all.sh).
# About 3 min from scratch, most of it torch 2.10.0's CUDA libraries (~4 GB, loaded at import even on a CPU).
VENV_TRL19 ?= .venv-trl19
setup-trl19: $(VENV_TRL19)/.installed

$(VENV_TRL19)/.installed: requirements/trl19-cpu.lock requirements/install.sh pyproject.toml
	bash requirements/install.sh $(VENV_TRL19) requirements/trl19-cpu.lock
	$(VENV_TRL19)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	$(VENV_TRL19)/bin/python -m compileall -q ogrpo
	@# the kernels again, for this env's torch (the cache is keyed by torch version), not in the first test's step
	$(VENV_TRL19)/bin/python -m ogrpo.kernels build
	touch $@

# The installers' output goes to build/setup.log (a line here says so); the run shows O-GRPO's lines, the training
# bar and the stage table, the libraries' output staying in the run's log (ogrpo/trainer/quiet.py).
demo:
	@$(MAKE) -s -q setup 2>/dev/null || { mkdir -p build && \
	  echo "setting up $(VENV): seconds with uv, minutes with pip (log: build/setup.log)" && \
	  $(MAKE) -s --no-print-directory setup > build/setup.log 2>&1 || { tail -n 20 build/setup.log; \
	  echo "make demo: setup failed; the full log is build/setup.log" >&2; exit 1; }; }
	$(OGRPO) submit --backend local --gpus cpu --config tiny

# tests/run-all.sh builds the second env (setup-trl19) while the first suite runs. The total, set-up included,
# is printed last (budget: 45 min on a fresh 2-core machine; README "Development").
test:
	@SECONDS=0; $(MAKE) --no-print-directory setup && bash tests/run-all.sh; rc=$$?; \
	  echo "make test: $$((SECONDS / 60)) min $$((SECONDS % 60)) s, set-up included (budget: 45 min on 2 cores)"; \
	  exit $$rc

# Both cores, a module per worker at a time, longest first (a module's fixtures are built once, in one worker;
# tests/conftest.py), as `make test` runs the main suite.
test-fast: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=10 --ignore=tests/trl19 \
	  -m "not slow and not integration and not slurm"

# On a GPU machine: every `gpu`-marked test, `ogrpo selftest --gpu` and `ogrpo bench kernels|step|rollout`, one
# report (gpu-report/gpu-report.json + .txt). Without CUDA it says "no GPU" and runs nothing.
GPU_REPORT ?= gpu-report
test-gpu: setup
	$(PY) -m ogrpo.gpu_report --out $(GPU_REPORT)

# A lent GPU machine (PyTorch, transformers, peft, accelerate; no network, 64 MiB per call): the wheels it lacks
# are built here, then `make test-gpu-lease` runs there with build/gpu-wheelhouse carried, on the image's python3.
GPU_WHEELHOUSE ?= build/gpu-wheelhouse
LEASE_PY ?= python3
gpu-wheelhouse: setup
	$(PY) -m ogrpo.gpu_lease build --out $(GPU_WHEELHOUSE)

test-gpu-lease:
	$(LEASE_PY) -m ogrpo.gpu_lease run --wheelhouse $(GPU_WHEELHOUSE) --out $(GPU_REPORT)

bench: setup
	$(PY) -m ogrpo.bench.cli_timing

clean:
	rm -rf $(VENV) $(VENV_TRL19) build *.egg-info .pytest_cache

-include docker/images.mk
