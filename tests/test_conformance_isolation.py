"""Crash isolation (docs/numerics.md G5): abort, segfault, hang and a poisoned device each fail exactly one case."""

import json

from opport.conformance import Options, faults, run
from opport.conformance import report as rep


class _Progress:
    """A display that records what the live progress gets."""

    def __init__(self):
        self.results, self.done = [], []

    def start(self, plan):
        self.batches = list(plan.batches)

    def add_total(self, n):
        pass

    def result(self, res):
        self.results.append(res)

    def batch_done(self, batch):
        self.done.append(batch.key)

    def stop(self):
        pass


def test_faulty_backend_yields_one_status_per_case_and_a_complete_report(tmp_path):
    opts = Options(backends=("faulty",), ops=("rmsnorm",), dtypes=("float32",), cases=tuple(faults.EXPECTED), workers=1,
                   timeout=3.0, compile_timeout=0.0, setup=("opport.conformance.faults:install",), errors=False,
                   layouts=False)
    progress = _Progress()
    try:
        report = run(opts, progress)
    finally:
        faults.uninstall()
    got = {c["case"]: c["status"] for c in report.cases}
    assert got == faults.EXPECTED
    # the batch resumed after each of its workers died, and was reported finished exactly once, at the end
    assert progress.done == [b.key for b in progress.batches] and len(progress.results) == len(report.cases)
    by = {c["case"]: c for c in report.cases}
    assert "SIGABRT" in by["row-127"]["message"] and "SIGSEGV" in by["row-129"]["message"]
    assert "faults.py" in by["row-129"]["message"]  # the crashing worker's stack, from faulthandler
    assert "illegal memory access" in by["row-1"]["message"]
    assert "--setup opport.conformance.faults:install" in by["row-128"]["repro"]
    assert report.exit_code == 1
    rep.write_json(report, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["crash"] == 3
