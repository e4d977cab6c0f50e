# Two entry points, each self-contained on a fresh machine:
#   make demo   the headline experiments at default sizes, results under results/
#   make test   the test suite's default tier (CPU; Pallas kernels in interpret mode + CUDA
#               lowering): minutes on 2 cores
# Test tiers are pytest markers (README, Tests): the default tier is every test not marked
# `slow`; `make test-slow` runs the slow tier CI runs after it (long engine runs, notebook
# execution, multi-process, deviceless full-engine compiles); tests also marked
# `exhaustive` (wide kernel grids, every kernel config's deviceless compile, random mixes of
# long runs) run only in `make test-all` (the paged / ragged kernel grids also compiled on a
# GPU by experiments/gpu_check.sh).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?= -n 2
DEFAULT_TIER := not slow
# make test leaves out the default tier's `long` tests (tests/long_tier.txt) to stay under
# 10 minutes on 2 cores; test-next and the Bazel targets run them.
QUICK_TIER := not slow and not long
SLOW_TIER := slow and not exhaustive

# jax 0.11.2 under Python 3.12 (the GPU device image's versions): `make test-next`.
PYTHON_NEXT ?= $(or $(lastword $(wildcard $(PYENV_ROOT)/versions/3.12*/bin/python3.12 $(HOME)/.pyenv/versions/3.12*/bin/python3.12)),$(shell command -v python3.12))
VENV_NEXT ?= .venv312
JAX_NEXT ?= 0.11.2

.PHONY: demo test test-slow test-next test-next-slow test-all bazel-test bazel-test-next install \
	clean results

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.txt
	touch $@

# XLA's CUDA compiler wheels of the installed jaxlib version, for the deviceless H200
# compile tests, and libtpu at the version the installed jax pins (jax[tpu]), for the
# deviceless TPU v5e / v6e ones (requirements-compile.txt); a failed install only makes
# those tests skip.
%/.compile-installed: %/.installed
	v=$$($*/bin/python -c "import jaxlib; print(jaxlib.__version__)") && \
	  $*/bin/pip install -q "jax-cuda12-plugin==$$v" "jax-cuda12-pjrt==$$v" || \
	  echo "deviceless GPU compile wheels not installed: those tests will skip"
	j=$$($*/bin/python -c "import jax; print(jax.__version__)") && \
	  $*/bin/pip install -q "jax[tpu]==$$j" || \
	  echo "libtpu not installed: the deviceless TPU compile tests will skip"
	touch $@

$(VENV_NEXT)/.installed: requirements.txt
	$(PYTHON_NEXT) -m venv $(VENV_NEXT)
	$(VENV_NEXT)/bin/pip install -q --upgrade pip
	sed -e 's/^jax==.*/jax==$(JAX_NEXT)/' -e 's/^jaxlib==.*/jaxlib==$(JAX_NEXT)/' \
	  requirements.txt > $(VENV_NEXT)/requirements.txt
	$(VENV_NEXT)/bin/pip install -q -r $(VENV_NEXT)/requirements.txt
	touch $@

install: $(VENV)/.installed

# The venv's jaxlib is the CPU build: say so, so an installed CUDA plugin stays quiet.
demo: $(VENV)/.installed
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m experiments.demo --out=results

# The tables of README.md, BENCHMARKS.md and docs/ between <!-- results:NAME --> markers, rendered
# from the committed JSON under experiments/results/ (tools/render_results.py --list).
results: $(VENV)/.installed
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) tools/render_results.py

test: $(VENV)/.installed $(VENV)/.compile-installed
	$(PY) -m pytest $(PYTEST_ARGS) -m "$(QUICK_TIER)" tests

test-slow: $(VENV)/.installed $(VENV)/.compile-installed
	$(PY) -m pytest $(PYTEST_ARGS) -m "$(SLOW_TIER)" tests

# The same tiers on the device image's jax (0.11.2, Python 3.12): the Mosaic GPU
# interpret-mode tests run only there.
test-next: $(VENV_NEXT)/.installed $(VENV_NEXT)/.compile-installed
	$(VENV_NEXT)/bin/python -m pytest $(PYTEST_ARGS) -m "$(DEFAULT_TIER)" tests

test-next-slow: $(VENV_NEXT)/.installed $(VENV_NEXT)/.compile-installed
	$(VENV_NEXT)/bin/python -m pytest $(PYTEST_ARGS) -m "$(SLOW_TIER)" tests

# Every test file as a Bazel py_test target, default tier (offline; installs bazel-bootstrap
# if missing). `bazel-test-next` runs them on the jax 0.11.2 venv.
bazel-test: $(VENV)/.installed
	tools/bazel_test.sh --config=ci //...

bazel-test-next: $(VENV_NEXT)/.installed $(VENV_NEXT)/.compile-installed
	VENV=$(VENV_NEXT) tools/bazel_test.sh --config=ci //...

test-all: $(VENV)/.installed $(VENV)/.compile-installed
	$(PY) -m pytest $(PYTEST_ARGS) tests

clean:
	rm -rf $(VENV) $(VENV_NEXT) results .pytest_cache
