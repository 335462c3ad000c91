# `make run` and `make test` do all set-up on a fresh machine with only python3 and make.
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/default.py

# test-fast: the inner loop, without the slow, multi-process and GPU tests (pyproject markers).
.PHONY: run test test-fast lint format clean mutmut gpu-wheels

# constraints.txt pins every package to the version the README's numbers were measured with.
$(VENV)/.installed: setup.py constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $@

run: $(VENV)/.installed
	$(PY) experiments/run.py --config $(CONFIG)

# --max-worker-restart 0: a worker that dies (a C++ abort) ends the session at once, naming the
# test it died in; pytest-xdist 3.8's file scheduler re-queues a dead worker's finished files as
# empty work units and can wait forever for them (pytest-xdist issues 784, 1378): stop 68's CI
# sat 70 minutes after one worker aborted.
XDIST = -n 2 --dist loadfile --max-worker-restart 0

test: $(VENV)/.installed-test
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(XDIST) tests

test-fast: $(VENV)/.installed-test
	$(PY) -m pytest -q $(XDIST) -m "not slow and not multiprocess and not gpu" tests

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

$(VENV)/.installed-dev: $(VENV)/.installed-test
	$(PY) -m pip install -q -c constraints.txt -e '.[test,dev]'
	touch $@

# Mutation testing of the numerics modules ([tool.mutmut] in pyproject.toml); slow: hours on 2 cores.
MUTANTS ?=
mutmut: $(VENV)/.installed-dev
	$(VENV)/bin/mutmut run $(MUTANTS)
	$(VENV)/bin/mutmut results

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache mutants

# The wheels a lent GPU machine lacks (its image has JAX with CUDA, flax, optax, chex, orbax),
# pinned by constraints.txt, for experiments/gpu_check.sh to install from .whl/ (ignored by git;
# the device tool's `carry` takes it there): docs/gpu/README.md "Run 7".
GPU_WHEELS = antlr4-python3-runtime array_record grain latex2sympy2_extended math-verify \
	ml_collections portpicker tensorboardX
gpu-wheels: $(VENV)/.installed
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -c constraints.txt \
	  -d .whl $(GPU_WHEELS)
