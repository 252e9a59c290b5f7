"""Real runs for the results-store tests (tests/test_store.py, tests/test_report_html.py): small conformance and
bench runs through the `opport` command, each stored and written as JSON, and a kernel that breaks rmsnorm."""

from __future__ import annotations

import json
from pathlib import Path

from opport.cli import main

# one op, one dtype, a few cases: about a second in this process
CONF = ["conformance", "--backend", "cpu", "--tier", "smoke", "--op", "rmsnorm", "--dtype", "float32", "--no-layouts",
        "--no-bad-inputs", "--examples", "2", "--workers", "0", "-q"]
BENCH = ["bench", "--backend", "cpu", "--smoke", "--op", "rmsnorm", "--op", "softmax", "--dtype", "float32",
         "--no-compile", "--budget-ms", "5"]
BROKEN = "cpu.rmsnorm-broken"


def break_rmsnorm():
    """A --setup hook: a cpu rmsnorm forward that returns zeros, ahead of the real one (undo: `unbreak_rmsnorm`)."""
    from opport.conformance.mutants import MAKERS
    from opport.dispatch import get_backend, impl, kernels
    from opport.ops import get_op

    spec = get_op("rmsnorm")
    real = kernels(spec, get_backend("cpu"))[-1]
    impl(spec, "cpu", dtypes=real.dtypes, supports=real.supports, priority=100, name=BROKEN)(MAKERS["zeros"](real.fn, spec))


def unbreak_rmsnorm():
    from opport.dispatch import remove_kernel
    from opport.ops import get_op

    remove_kernel(get_op("rmsnorm"), "cpu", BROKEN)


def make_runs(folder: Path) -> dict:
    """Runs 1-3 of a new store in `folder`: conformance, the same with rmsnorm broken, bench. Returns the paths and
    each run's exit status and JSON report."""
    db = str(folder / "results.db")
    out = {"db": db, "status": {}, "json": {}}
    for run_id, argv in ((1, CONF), (2, [*CONF, "--setup", "tests.store_runs:break_rmsnorm"]), (3, BENCH)):
        report = folder / f"run{run_id}.json"
        try:
            out["status"][run_id] = main([*argv, "--json", str(report), "--store", db])
        finally:
            unbreak_rmsnorm()
        out["json"][run_id] = json.loads(report.read_text())
    return out
