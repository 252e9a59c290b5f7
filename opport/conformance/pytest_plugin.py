"""pytest plugin: `pytest --opport-backend=NAME` runs the conformance cases of that backend as tests.

Every test that takes an `opport_case` argument is parametrized with the cases of the selected
backends (same plan, cases, checks, known failures and repro commands as `opport conformance`),
one test per case id. The test body is one line:

    def test_conformance(opport_case, record_property):
        opport_case.check(record_property)

Without `--opport-backend` the test is skipped. Cases run in the pytest process: for crash isolation
use pytest-xdist (`-n 2`, which replaces a dead worker) or the `opport conformance` command.
Also registers the Hypothesis settings profile `opport-ci` (derandomized, no deadline, no database).
"""

from __future__ import annotations

import pytest

from opport.conformance import gate
from opport.conformance.cases import TIERS
from opport.conformance.report import failure_lines

OPTIONS = ("backend", "op", "dtype", "case")


def pytest_addoption(parser):
    g = parser.getgroup("opport", "opport conformance cases")
    g.addoption("--opport-backend", action="append", default=[], metavar="NAME",
                help="run the conformance cases on this backend (a name `opport doctor` lists, or all); repeatable")
    g.addoption("--opport-op", action="append", default=[], metavar="NAME", help="only this op (repeatable)")
    g.addoption("--opport-dtype", action="append", default=[], metavar="D", help="only this dtype (repeatable)")
    g.addoption("--opport-case", action="append", default=[], metavar="NAME", help="only cases matching this pattern")
    g.addoption("--opport-tier", default="fast", choices=tuple(TIERS), help="conformance tier (default fast)")
    g.addoption("--opport-examples", type=int, default=None, metavar="N", help="Hypothesis examples per op x dtype")
    g.addoption("--opport-seed", type=int, default=0, metavar="S", help="Hypothesis seed (default 0)")


def pytest_configure(config):
    try:
        from hypothesis import settings
    except ImportError:
        return
    settings.register_profile("opport-ci", derandomize=True, deadline=None, database=None, print_blob=True)


def pytest_generate_tests(metafunc):
    if "opport_case" not in metafunc.fixturenames:
        return
    opts = _options(metafunc.config)
    if opts is None:
        skip = pytest.mark.skip(reason="pass --opport-backend=NAME (or all) to run the conformance cases")
        metafunc.parametrize("opport_case", [pytest.param(None, marks=skip)], ids=["no-backend"])
        return
    refs = collect(opts)
    metafunc.parametrize("opport_case", refs, ids=[r.id for r in refs])


def _options(config):
    from opport.conformance.runner import Options

    get = lambda name: config.getoption(f"opport_{name}", default=None)
    if not get("backend"):
        return None
    return Options(backends=tuple(get("backend")), ops=tuple(get("op") or ()), dtypes=tuple(get("dtype") or ()),
                   cases=tuple(get("case") or ()), tier=get("tier") or "fast", examples=get("examples"),
                   seed=get("seed") or 0, workers=0)


class CaseRef:
    """A case by (batch, index): items are rebuilt when the test runs, so collection holds no arrays."""

    def __init__(self, case_id: str, plan, batch=None, index: int = -1, preset: dict | None = None):
        self.id, self.plan, self.batch, self.index, self.preset = case_id, plan, batch, index, preset

    def __repr__(self):
        return f"CaseRef({self.id})"

    def run(self) -> dict:
        from opport.conformance.execute import run_item
        from opport.conformance.runner import known_for, repro

        res = dict(self.preset) if self.preset else run_item(_items(self.batch)[self.index])
        gate.apply_known(res, known_for(self.plan, res["backend"]))
        res["repro"] = repro(res, self.plan.options, self.plan.selections.get(res["backend"]))
        return res

    def check(self, record_property=None):
        """Run the case and turn its status into a pytest outcome (metrics recorded as JUnit properties)."""
        __tracebackhide__ = True
        res = self.run()
        if record_property:
            for k, v in (res.get("metrics") or {}).items():
                if v is not None:
                    record_property(k, v)
            record_property("repro", res["repro"])
        status = res["status"]
        if status == "skip":
            pytest.skip(res["message"])
        if status == "xfail":
            pytest.xfail(res.get("known_failure", ""))
        if status != "pass":
            pytest.fail("\n".join(failure_lines(res)), pytrace=False)


def collect(opts) -> list[CaseRef]:
    """Every case of the plan as a CaseRef (builds each batch once to learn its case ids)."""
    from opport.conformance.runner import plan, run_setup
    from opport.conformance.worker import build_items

    run_setup(opts.setup)
    p = plan(opts)
    refs = [CaseRef(r["id"], p, preset=r) for r in p.preset]
    for batch in p.batches:
        refs += [CaseRef(it.id, p, batch, i) for i, it in enumerate(build_items(batch))]
    return refs


_last: dict = {}


def _items(batch) -> list:
    """The batch's items, rebuilt once per batch while its tests run (tests run in collection order)."""
    from opport.conformance.worker import build_items

    if _last.get("batch") != batch:
        _last.clear()
        _last.update(batch=batch, items=build_items(batch))
    return _last["items"]
