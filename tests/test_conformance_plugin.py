"""The pytest plugin runs the same cases as tests (in a child pytest, so this session's options stay untouched)."""

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

from opport.conformance import pytest_plugin

CASES = Path(__file__).with_name("test_conformance_cases.py")


def _pytest(*args) -> subprocess.CompletedProcess:
    installed = any(ep.value == "opport.conformance.pytest_plugin" for ep in entry_points(group="pytest11"))
    plugin = [] if installed else ["-p", "opport.conformance.pytest_plugin"]
    cmd = [sys.executable, "-m", "pytest", *plugin, str(CASES), "-v", "-p", "no:cacheprovider", "-o", "addopts=", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_plugin_runs_named_cases_as_tests():
    r = _pytest("--opport-backend=cpu", "--opport-op=rmsnorm", "--opport-dtype=float32", "--opport-case=row-12[78]",
                "--opport-case=bad-rmsnorm.eps")
    assert r.returncode == 0, r.stdout + r.stderr
    for case in ("rmsnorm/cpu/float32/row-127", "rmsnorm/cpu/float32/row-128", "rmsnorm/cpu/n/a/bad-rmsnorm.eps"):
        assert f"test_conformance[{case}] PASSED" in r.stdout


def test_plugin_parametrizes_a_skip_without_a_backend():
    class Config:
        getoption = staticmethod(lambda name, default=None: [] if name == "opport_backend" else default)

    class Metafunc:
        fixturenames, config, calls = ("opport_case",), Config(), []

        def parametrize(self, name, values, ids):
            self.calls.append((name, values, ids))

    m = Metafunc()
    pytest_plugin.pytest_generate_tests(m)
    (name, values, ids), = m.calls
    assert name == "opport_case" and ids == ["no-backend"]
    assert "--opport-backend" in values[0].marks[0].kwargs["reason"]
