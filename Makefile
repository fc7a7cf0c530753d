# Two commands do all the set-up: `make demo` and `make test`. Both build .venv when it is
# missing (or when the pinned requirements changed) and reuse it otherwise.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.hybrid-installed
NPROC  ?= 3

.PHONY: env demo test test-fast bench clean-env

env: $(STAMP)

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $(STAMP)
	@echo "environment ready in $(VENV)"

demo: env
	$(VENV)/bin/hybrid launch -n $(NPROC) train --plan conf/plans/dlrm.yaml --config conf/train/dlrm.yaml

test: env
	$(PY) -m pytest -q tests

test-fast: env
	$(PY) -m pytest -q tests/unit

bench: env
	$(PY) -m benchmarks.run

clean-env:
	rm -rf $(VENV)
