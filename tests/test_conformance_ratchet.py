"""The baseline is a ratchet (docs/conformance.md, Baselines): a failure recorded by `--update-baseline` does not fail
the rerun against that baseline; a new failure or a metric > 2x does; a case that passes now is fine. Round trips
through the CLI with a test backend (`--setup tests.test_conformance_ratchet:install`) whose rmsnorm kernel is wrong on
the shapes in BROKEN."""

from __future__ import annotations

import json

import numpy as np
import pytest

from opport.cli import main
from opport.conformance import gate

BROKEN: set = set()  # x shapes on which the `ratchet` backend's rmsnorm returns wrong values
DRIFTED: set = set()  # x shapes on which it is off by a third of float32's rtol: passes, with a larger tol_ratio
ROW_127, ROW_1 = (5, 127), (7, 1)  # x's shape in rmsnorm's cases row-127 and row-1


def install():
    """--setup hook: a NumPy backend `ratchet` running the cpu rmsnorm kernel, doubled on the shapes in BROKEN and
    scaled by 1 + 4e-7 on those in DRIFTED."""
    from opport.dispatch import Backend, backends, get_backend, impl, kernels, register_backend
    from opport.ops import get_op

    if "ratchet" in backends():
        return
    register_backend(Backend(name="ratchet", package="opport.conformance", array_kind="numpy", device_types=(),
                             dtypes=("float32",), probe=lambda: None, mode=lambda: "test"))
    spec = get_op("rmsnorm")
    cpu = kernels(spec, get_backend("cpu"))[0]

    @impl(spec, "ratchet", dtypes=("float32",), name="ratchet.rmsnorm")
    def rmsnorm(x, weight, eps, offset):
        out = cpu.fn(x, weight, eps, offset)
        if tuple(x.shape) in DRIFTED:
            out = (out.astype(np.float64) * (1 + 4e-7)).astype(out.dtype)
        return out * 2 if tuple(x.shape) in BROKEN else out


@pytest.fixture
def ratchet(tmp_path):
    from opport.dispatch import unregister_backend

    BROKEN.clear()
    DRIFTED.clear()
    yield tmp_path / "base.json", tmp_path / "report.json"
    BROKEN.clear()
    DRIFTED.clear()
    unregister_backend("ratchet")


ARGV = ["conformance", "--backend", "ratchet", "--setup", "tests.test_conformance_ratchet:install", "--op", "rmsnorm",
        "--dtype", "float32", "--case", "row-1", "--case", "row-127", "--workers", "0", "-q", "--no-bad-inputs",
        "--no-layouts"]


def _cases(report) -> dict:
    return {c["case"]: c for c in json.loads(report.read_text())["cases"]}


def test_a_recorded_failure_does_not_fail_the_rerun(ratchet, capsys):
    base, report = ratchet
    BROKEN.add(ROW_127)
    assert main([*ARGV, "--json", str(report)]) == 1  # no baseline: the failure fails the run
    assert main([*ARGV, "--baseline", str(base), "--update-baseline"]) == 1  # recorded; judged without a baseline
    recorded = json.loads(base.read_text())["cases"]
    assert recorded["rmsnorm/ratchet/float32/row-127"]["status"] == "fail"
    assert recorded["rmsnorm/ratchet/float32/row-1"]["status"] == "pass"

    capsys.readouterr()
    assert main([*ARGV, "--baseline", str(base), "--json", str(report)]) == 0  # the round trip
    out = capsys.readouterr().out
    got = _cases(report)
    assert got["row-127"]["status"] == "xfail" and "known in the baseline" in got["row-127"]["known_failure"]
    assert "out of tolerance" in got["row-127"]["message"]  # why it fails is still reported
    assert got["row-1"]["status"] == "pass"
    assert json.loads(report.read_text())["baseline_regressions"] == [] and "PASS" in out

    BROKEN.add(ROW_1)  # a new failure beside the known one fails the run, and only it is named
    assert main([*ARGV, "--baseline", str(base), "--json", str(report)]) == 1
    regs = json.loads(report.read_text())["baseline_regressions"]
    assert [(r["id"], r["kind"]) for r in regs] == [("rmsnorm/ratchet/float32/row-1", "new failure")]
    assert _cases(report)["row-127"]["status"] == "xfail"

    BROKEN.clear()  # both fixed: passing is fine whatever the baseline holds
    assert main([*ARGV, "--baseline", str(base), "--json", str(report)]) == 0
    assert {c["status"] for c in _cases(report).values()} == {"pass"}


def test_a_metric_more_than_twice_its_baseline_fails(ratchet):
    base, report = ratchet
    assert main([*ARGV, "--baseline", str(base), "--update-baseline"]) == 0
    was = json.loads(base.read_text())["cases"]["rmsnorm/ratchet/float32/row-127"]["metrics"]["tol_ratio"]
    DRIFTED.add(ROW_127)  # still inside the tolerance, but its error grew past 2x the recorded one
    assert main([*ARGV, "--baseline", str(base), "--json", str(report)]) == 1
    now = _cases(report)["row-127"]
    assert now["status"] == "pass" and now["metrics"]["tol_ratio"] > 2 * was + gate.SLACK["tol_ratio"]
    regs = json.loads(report.read_text())["baseline_regressions"]
    assert {(r["id"], r["kind"]) for r in regs} == {("rmsnorm/ratchet/float32/row-127", "metric regression")}
    assert any(r["detail"].startswith("tol_ratio") for r in regs)


def test_xpass_and_lost_are_never_excused():
    cases = [{"id": "a", "status": "xpass", "metrics": {}}, {"id": "b", "status": "lost", "metrics": {}}]
    baseline = {"a": {"status": "fail", "metrics": {}}, "b": {"status": "fail", "metrics": {}}}
    assert gate.regressions(cases, baseline) == []
    assert [c["status"] for c in cases] == ["xpass", "lost"]
    assert gate.exit_code({"pass": 1, "xpass": 1}, []) == 1 and gate.exit_code({"pass": 1, "lost": 1}, []) == 1


def test_help_says_what_the_gate_does(capsys):
    with pytest.raises(SystemExit):
        main(["conformance", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "known in the baseline (xfail) and does not fail the run" in text
    assert "a new failure, or a metric > 2x its value in F, does" in text
