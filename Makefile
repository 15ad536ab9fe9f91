# blink_horovod -- developer entry points. Everything runs inside .venv/ (made by
# scripts/install.sh; a completed install is detected by a stamp, so `make install`
# is cheap to repeat).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PY           := .venv/bin/python
TEST_TIMEOUT ?= 300
PYTEST_ARGS  ?=
# tests/unit, tests/parallel, tests/integration (any of them may be empty)
TEST_DIRS    := tests


.PHONY: help install test demo paper lint clean distclean reliability

help:
	@echo "make install    build .venv: requirements + horovod 0.28.1 + this package (BLINK_SKIP_HOROVOD=1: no horovod)"
	@echo "make test       run tests/{unit,parallel,integration} (timeout $(TEST_TIMEOUT) s per test)"
	@echo "make reliability  run the fault tests and write docs/reliability.md from that run"
	@echo "make demo       python -m blink_horovod.demo"
	@echo "make paper      python -m blink_horovod.sim.paper"
	@echo "make lint       ruff check"
	@echo "make clean      remove build/test artefacts (keeps .venv); distclean also removes .venv"

install:
	bash scripts/install.sh

# mpirun (and horovodrun --mpi) refuse to run as root without the two OMPI_* variables;
# TF must use Keras 2 (tf-keras) for horovod.tensorflow.keras, set before TF is imported.
test demo paper: export OMPI_ALLOW_RUN_AS_ROOT := 1
test demo paper: export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
test demo paper: export TF_USE_LEGACY_KERAS := 1

# pytest exit 5 (no tests collected) and a missing tests/ are not failures.
test: install
	@if [ ! -d tests ]; then echo "[test] no tests/ directory; nothing to run"; exit 0; fi; \
	echo "[test] $(PY) -m pytest $(TEST_DIRS) -q --timeout=$(TEST_TIMEOUT) $(PYTEST_ARGS)"; \
	rc=0; $(PY) -m pytest $(TEST_DIRS) -q --timeout=$(TEST_TIMEOUT) $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "[test] pytest collected no tests (tests/ dirs empty)"; exit 0; fi; \
	exit $$rc

# The fault cases; docs/reliability.md is rendered from this run's measurements.
reliability: export OMPI_ALLOW_RUN_AS_ROOT := 1
reliability: export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
reliability: install
	@mkdir -p build; rc=0; \
	RELIABILITY_JSON=build/reliability.json $(PY) -m pytest tests/integration -k reliability -q --timeout=$(TEST_TIMEOUT) $(PYTEST_ARGS) || rc=$$?; \
	$(PY) benchmarks/reliability_report.py build/reliability.json -o docs/reliability.md; \
	exit $$rc

demo: install
	$(PY) -m blink_horovod.demo

paper: install
	$(PY) -m blink_horovod.sim.paper

lint:
	@[ -x $(PY) ] || { echo "[lint] no .venv: run 'make install' (or BLINK_SKIP_HOROVOD=1 make install) first"; exit 1; }
	$(PY) -m ruff check .

clean:
	rm -rf .build build dist .pytest_cache .ruff_cache .hypothesis *.egg-info
	find . -path ./.venv -prune -o -type d -name __pycache__ -print0 | xargs -0 rm -rf

distclean: clean
	rm -rf .venv
