# Two commands do all the set-up: `make demo` and `make test`. Both build .venv when it is
# missing (or when the pinned requirements changed) and reuse it otherwise.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hybrid-installed
# The native code (hybrid._C: operators, RPC transport, all-reduce ring; benchmarks._C: the emulated network's delay
# line) is built by the editable install below: editing it rebuilds.
CSRC   := setup.py $(wildcard hybrid/ops/csrc/*.cpp hybrid/ops/csrc/*.h hybrid/launch/csrc/*.cpp hybrid/dense/csrc/*.cpp benchmarks/csrc/*.cpp)
NPROC  ?= 3

.PHONY: env demo test test-gpu test-fast bench clean-env

env: $(STAMP)

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml $(CSRC)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $(STAMP)
	@echo "environment ready in $(VENV)"

demo: env
	$(VENV)/bin/hybrid launch -n $(NPROC) train --plan conf/plans/dlrm.yaml --config conf/train/dlrm.yaml

# HYBRID_REQUIRE_NATIVE: `make env` built hybrid._C, so its tests fail rather than skip without it.
# Most tests run on two workers (a file's tests together, so they share its fixtures); the
# `serial` ones bound how long something takes and run afterwards, without the others' load: two
# at a time, as they mostly wait out the timeouts they bound. Bytecode is written and
# reused (__pycache__, ignored by git) even where PYTHONDONTWRITEBYTECODE is set, as on this
# project's test hosts: else every process of every job compiles hybrid and the examples from
# source again (~0.15 CPU s a process), and each pytest process rewrites the asserts of every test
# module (~3.5 CPU s a collection). A stale .pyc is recompiled, never used.
test: env
	$(PY) -m compileall -q hybrid recsys_examples benchmarks tests
	PYTHONDONTWRITEBYTECODE= HYBRID_REQUIRE_NATIVE=1 $(PY) -m pytest -q -n 2 --dist loadfile -m "not serial" tests
	PYTHONDONTWRITEBYTECODE= HYBRID_REQUIRE_NATIVE=1 $(PY) -m pytest -q -n 2 --dist loadfile -m serial tests

# On a CUDA machine (docs/install.md, "CUDA"): the tests that need a GPU, and every operator.
test-gpu: env
	HYBRID_REQUIRE_NATIVE=1 $(PY) -m pytest -q -rs tests/distributed/test_device.py tests/unit/test_ops.py

test-fast: env
	HYBRID_REQUIRE_NATIVE=1 $(PY) -m pytest -q tests/unit

bench: env
	$(PY) -m benchmarks.run

clean-env:
	rm -rf $(VENV)
