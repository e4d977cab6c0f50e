# Two entry points, each self-contained on a fresh machine:
#   make demo   the headline experiments at default sizes, results under results/
#   make test   the test suite (CPU; Pallas kernels in interpret mode + CUDA lowering)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?= -n 2 -m "not slow"

.PHONY: demo test test-all bazel-test install clean

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.txt
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) -m experiments.demo --out=results

test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS) tests

# The same test files as Bazel py_test targets (offline; installs bazel-bootstrap if missing).
bazel-test: $(VENV)/.installed
	tools/bazel_test.sh --config=ci //...

test-all: $(VENV)/.installed
	$(PY) -m pytest -n 2 tests

clean:
	rm -rf $(VENV) results .pytest_cache
