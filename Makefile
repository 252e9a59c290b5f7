# opport: `make run` sets up .venv, says which backends run here and checks every op on each (smoke tier, ~1 min);
# `make test` sets up the same .venv and runs lint, the tests (the sm_90 compile check of tools/cuda_aot.py
# included) and the conformance gate.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch is pinned to the CPU build that ships on this machine image; the [cuda] extra adds triton==3.6.0.
TORCH ?= torch==2.13.0

.PHONY: venv native chromium run test lint pytest conformance smoke-covered aot aot-record bench clean

venv: $(STAMP)

# pip takes torch (pip's configuration may point at a local CPU wheel; uv reads no pip.conf), uv the rest: it
# downloads in parallel (the rest of the venv 55-60 s with pip against 24 s, uv's cache cold, bytecode compiled);
# torch already there satisfies what the extras ask of it, so uv keeps it. --system-certs: the machine's CA store,
# as pip's (a network that re-signs TLS, as this VM's does, fails uv's bundled roots unless SSL_CERT_FILE is set).
UV ?= uv==0.13.9
# The native autograd nodes compile (torch's headers only, ~28 s of one core) while uv installs the rest (runpy: a
# script's own folder would come first on sys.path, and opport/integrations/torch.py would shadow torch; -W: torch
# warns that NumPy is not installed yet).
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q "$(UV)" "$(TORCH)" "ninja>=1.11"
	$(BIN)/python -W 'ignore:Failed to initialize NumPy' -c 'import runpy; runpy.run_path("opport/integrations/_native_build.py", run_name="__main__")' & \
	VIRTUAL_ENV=$(abspath $(VENV)) $(BIN)/uv pip install -q --system-certs --compile-bytecode \
	  -e ".[cuda,jax,transformers,bench,fleet,test]"; rc=$$?; wait $$! && exit $$rc
	touch $(STAMP)

# the native torch autograd nodes of small cpu training calls (opport/integrations/torch_native.py): compiled once
# into torch's extension directory (by the venv's recipe; here again only if its source changed), then loaded; the
# numba code it runs (the loops' entry points, attention's tasks) compiled into numba's cache here, in one process
native: venv
	$(BIN)/python -m opport.integrations.torch_native

run: native
	$(BIN)/opport doctor
	$(BIN)/opport conformance --backend all --tier smoke --json smoke-report.json
	@echo "Ran: the smoke tier (every op, backend and dtype; every layout on every input; a few examples) on the backends"
	@echo "  doctor lists above; the CI gate runs all of it too (docs/conformance.md). Report: smoke-report.json."
	@echo "Next: the CI gate, make conformance; everything CI runs, make test; thousands of examples,"
	@echo "  $(BIN)/opport conformance --backend all --tier full; kernels on real shapes, make bench; docs/ for the rest."

# CI checks the smoke tier too (make run's) after the gate: every case it runs must have run in the gate and passed
# there (--covered-by judges it from the gate's report, in seconds, instead of running it a second time). The tiers
# nest by construction (tests/test_conformance_tiers.py); this proves it on the real run.
# pip and apt (the venv, its native nodes compiled beside uv, and chromium) run side by side, their output printed whole per step. pytest and the gate
# run one after the other: side by side (-j2) they took 16 min against 13.6 min in turn (both saturate 2 cores).
test:
	$(MAKE) --no-print-directory -j2 --output-sync=target native chromium
	$(MAKE) --no-print-directory lint pytest conformance smoke-covered

smoke-covered: venv
	$(BIN)/opport conformance --backend all --tier smoke --covered-by conformance-report.json -q

# tests/test_report_html.py opens the HTML report in Debian's Chromium and is never skipped: install it if missing
chromium:
	@command -v chromium >/dev/null 2>&1 || { SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium; }

lint: venv
	$(BIN)/ruff check opport tests tools

# two workers (pytest-xdist), a test file each at a time: module fixtures run once; on 2 cores 8 -> 5.5 minutes.
# Files in collection order, the slowest first (tests/conftest.py), not xdist's most-tests-first.
# --durations: CI's log shows where the time went
pytest: venv chromium
	$(BIN)/python -m pytest -n auto --dist loadfile --no-loadscope-reorder --durations=15

conformance: venv
	$(BIN)/opport conformance --backend all --tier fast --json conformance-report.json --junit conformance-report.xml

# the sm_90 compile check on its own, cold: ignores tools/cuda_aot_record.json and Triton's cache, compiles every
# configuration and checks the record against what it finds (pytest runs the check with the record, in
# tests/test_cuda_aot.py: only configurations not in the record compile there)
aot: venv
	$(BIN)/python tools/cuda_aot.py --cold --json aot-report.json

# after changing a cuda kernel (or Triton): compile what the record lacks, check it, rewrite the record; commit it
aot-record: venv
	$(BIN)/python tools/cuda_aot.py --update-record --json aot-report.json

bench: venv
	$(BIN)/opport bench --backend cpu

clean:
	rm -rf $(VENV) conformance-report.json conformance-report.xml smoke-report.json aot-report.json .pytest_cache .hypothesis
