"""Crash isolation (docs/numerics.md G5): abort, segfault, hang and a poisoned device each fail exactly one case."""

import json

from opport.conformance import Options, faults, run
from opport.conformance import report as rep


def test_faulty_backend_yields_one_status_per_case_and_a_complete_report(tmp_path):
    opts = Options(backends=("faulty",), ops=("rmsnorm",), dtypes=("float32",), cases=tuple(faults.EXPECTED), workers=1,
                   timeout=3.0, compile_timeout=0.0, setup=("opport.conformance.faults:install",), errors=False,
                   layouts=False)
    try:
        report = run(opts)
    finally:
        faults.uninstall()
    got = {c["case"]: c["status"] for c in report.cases}
    assert got == faults.EXPECTED
    by = {c["case"]: c for c in report.cases}
    assert "SIGABRT" in by["row-127"]["message"] and "SIGSEGV" in by["row-129"]["message"]
    assert "faults.py" in by["row-129"]["message"]  # the crashing worker's stack, from faulthandler
    assert "illegal memory access" in by["row-1"]["message"]
    assert "--setup opport.conformance.faults:install" in by["row-128"]["repro"]
    assert report.exit_code == 1
    rep.write_json(report, tmp_path / "r.json")
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["crash"] == 3
