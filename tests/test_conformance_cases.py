"""The conformance cases as pytest tests (skipped unless a backend is named).

    pytest tests/test_conformance_cases.py --opport-backend=cpu --opport-op=rmsnorm
    pytest tests/test_conformance_cases.py --opport-backend=cuda -n 2   # pytest-xdist isolates crashes

The `opport_case` parametrization comes from the opport pytest plugin (entry point `pytest11`);
where the plugin is not installed, the module-level hook below does the same with no options,
which skips the test.
"""

from opport.conformance import pytest_plugin


def pytest_generate_tests(metafunc):
    pm = metafunc.config.pluginmanager
    if not (pm.has_plugin("opport") or pm.has_plugin("opport.conformance.pytest_plugin")):
        pytest_plugin.pytest_generate_tests(metafunc)


def test_conformance(opport_case, record_property):
    opport_case.check(record_property)
