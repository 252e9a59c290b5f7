# opport: `make run` sets up .venv and runs the conformance suite on every backend this machine can run;
# `make test` sets up the same .venv and runs lint, the tests and the conformance gate.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch is pinned to the CPU build that ships on this machine image; the [cuda] extra adds triton==3.6.0.
TORCH ?= torch==2.13.0

.PHONY: venv run test lint pytest conformance bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[cuda,jax,transformers,bench,test]"
	touch $(STAMP)

run: venv
	$(BIN)/opport doctor
	$(BIN)/opport conformance --backend all --tier fast

test: venv lint pytest conformance

lint: venv
	$(BIN)/ruff check opport tests

pytest: venv
	$(BIN)/python -m pytest

conformance: venv
	$(BIN)/opport conformance --backend all --tier fast --json conformance-report.json --junit conformance-report.xml

bench: venv
	$(BIN)/opport bench --backend cpu

clean:
	rm -rf $(VENV) conformance-report.json conformance-report.xml .pytest_cache .hypothesis
