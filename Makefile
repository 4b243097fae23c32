# Two commands on a fresh machine:  `make demo` (set up + a short GRPO run on CPU through the same
# plan -> launch path a cluster uses) and `make test` (set up + the whole test suite, real Slurm included).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
OGRPO := $(VENV)/bin/ogrpo

.PHONY: setup demo test test-fast bench clean

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

demo: setup
	$(OGRPO) submit --backend local --gpus cpu --config tiny

test: setup
	bash tests/run-all.sh

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not integration and not slurm"

bench: setup
	$(PY) -m ogrpo.bench.cli_timing

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

-include docker/images.mk
