"""`opport conformance` and `opport bench` check every input before any long work (issue 15, items 16-18).

Each bad invocation must exit with status 2 and one line on stderr naming the flag (and the file), and
must not start the run: the suite runner and the ceiling measurement are replaced by tripwires here.
"""

from __future__ import annotations

import json

import pytest

from opport.cli import main

CONF = ["conformance", "--op", "rmsnorm", "--dtype", "float32", "--case", "row-1", "--workers", "0", "-q"]
BENCH = ["bench", "--smoke", "--op", "rmsnorm"]


@pytest.fixture
def no_run(monkeypatch):
    """Fail the test if the conformance suite or the bench's ceilings start."""
    import opport.backends.cpu.bench as cpu_bench
    import opport.conformance.runner as runner

    def tripped(*a, **k):
        raise AssertionError("the run started although an input was bad")

    monkeypatch.setattr(runner, "run", tripped)
    monkeypatch.setattr(cpu_bench, "ceilings", tripped)


def refused(capsys, argv, *words) -> str:
    """Run `argv`, expect exit 2 and one stderr line holding every word; return that line."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for w in words:
        assert w in err, (w, err)
    return err


def _files(tmp_path) -> dict:
    """Bad input files of every kind, by what is wrong with them."""
    bad = {"missing": tmp_path / "no" / "such.json", "directory": tmp_path, "empty": tmp_path / "empty.json",
           "corrupt": tmp_path / "corrupt.json", "binary": tmp_path / "binary.json"}
    bad["empty"].write_text("  \n")
    bad["corrupt"].write_text('{"cases": {')
    bad["binary"].write_bytes(b"\xff\xfe\x00\x81")
    return bad


WHY = {"missing": "no such file", "directory": "is a directory", "empty": "empty", "corrupt": "not valid JSON",
       "binary": "cannot be read"}


@pytest.mark.parametrize("kind", sorted(WHY))
def test_conformance_baseline_that_cannot_be_read(tmp_path, capsys, no_run, kind):
    path = _files(tmp_path)[kind]
    refused(capsys, [*CONF, "--baseline", str(path)], "--baseline", str(path), WHY[kind])


@pytest.mark.parametrize("body, why", [
    ({"rows": []}, "no 'cases'"),  # a bench report
    ({"cases": {}}, "no cases"),
    ({"cases": {"rmsnorm/cpu/float32/row-1": {"status": "great"}}}, "valid status"),
    ({"cases": [{"status": "pass"}]}, "lacks an id"),
    ([1, 2], "no 'cases'"),
])
def test_conformance_baseline_of_the_wrong_shape(tmp_path, capsys, no_run, body, why):
    path = tmp_path / "b.json"
    path.write_text(json.dumps(body))
    refused(capsys, [*CONF, "--baseline", str(path)], "--baseline", str(path), why)


def test_update_baseline_may_create_the_file_but_not_in_a_missing_folder(tmp_path, capsys, no_run):
    bad = tmp_path / "no" / "base.json"
    refused(capsys, [*CONF, "--baseline", str(bad), "--update-baseline"], "--baseline", str(bad), "cannot be written")
    refused(capsys, [*CONF, "--baseline", str(tmp_path), "--update-baseline"], "is a directory")


@pytest.mark.parametrize("kind", ["missing", "directory", "empty", "binary"])
def test_known_failures_file_that_cannot_be_read(tmp_path, capsys, no_run, kind):
    path = _files(tmp_path)[kind]
    refused(capsys, [*CONF, "--known-failures", str(path)], "--known-failures", str(path), WHY[kind])


def test_known_failures_file_of_the_wrong_shape(tmp_path, capsys, no_run):
    path = tmp_path / "kf.txt"
    path.write_text("rmsnorm/cpu/float32/row-1 without a reason\n")
    refused(capsys, [*CONF, "--known-failures", str(path)], "--known-failures", f"{path}:1", "<reason>")


@pytest.mark.parametrize("flag", ["--json", "--junit", "--markdown"])
def test_conformance_report_paths_are_checked_before_the_run(tmp_path, capsys, no_run, flag):
    refused(capsys, [*CONF, flag, str(tmp_path)], flag, "is a directory")
    missing = tmp_path / "no" / "r.out"
    refused(capsys, [*CONF, flag, str(missing)], flag, str(missing), "cannot be written")
    assert not missing.parent.exists()


@pytest.mark.parametrize("hook, why", [
    ("no_such_module_xyz:fn", "cannot import no_such_module_xyz"),
    ("os:no_such_function", "has no function 'no_such_function'"),
    ("opport.conformance.faults", "expected MODULE:FUNCTION"),
])
def test_setup_hook_is_one_line_not_a_traceback(capsys, no_run, hook, why):
    refused(capsys, [*CONF, "--setup", hook], "--setup", why)


@pytest.mark.parametrize("flag, value", [("--examples", "-3"), ("--timeout", "-1"), ("--timeout", "0"),
                                         ("--compile-timeout", "-5"), ("--workers", "-1")])
def test_conformance_numbers_out_of_range(capsys, no_run, flag, value):
    refused(capsys, [*CONF, flag, value], flag, value)


def test_a_setup_hook_that_fails_when_called_is_one_line(capsys):
    refused(capsys, [*CONF, "--setup", "json:dumps"], "--setup json:dumps", "TypeError")  # dumps() needs an argument


def test_good_inputs_still_run(tmp_path):
    """The checks leave no file behind, and a run with every checked input passes."""
    base, out = tmp_path / "base.json", tmp_path / "r.json"
    kf = tmp_path / "kf.txt"
    kf.write_text("# nothing known\nrmsnorm/cpu/float32/no-such-case | a placeholder entry for this test\n")
    assert main([*CONF, "--baseline", str(base), "--update-baseline"]) == 0
    assert main([*CONF, "--baseline", str(base), "--known-failures", str(kf), "--json", str(out),
                 "--setup", "opport.conformance.faults:uninstall"]) == 0
    assert json.loads(out.read_text())["exit_code"] == 0


# --------------------------------------------------------------------------- bench


@pytest.mark.parametrize("flag, value", [("--budget-ms", "-5"), ("--rounds", "0"), ("--repeats", "-1"),
                                         ("--margin", "-0.1"), ("--max-minutes", "0")])
def test_bench_numbers_out_of_range(capsys, no_run, flag, value):
    refused(capsys, [*BENCH, flag, value], flag)


def test_bench_unknown_dtype_is_refused_before_the_ceilings(capsys, no_run):
    refused(capsys, [*BENCH, "--dtype", "int99"], "--dtype int99", "float32")


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_bench_output_paths_are_checked_before_the_run(tmp_path, capsys, no_run, flag):
    refused(capsys, [*BENCH, flag, str(tmp_path)], flag, "is a directory")
    refused(capsys, [*BENCH, flag, str(tmp_path / "no" / "x")], flag, "cannot be written")


@pytest.mark.parametrize("kind", sorted(WHY))
def test_bench_baseline_that_cannot_be_read(tmp_path, capsys, no_run, kind):
    path = _files(tmp_path)[kind]
    refused(capsys, [*BENCH, "--baseline", str(path)], "--baseline", str(path), WHY[kind])


@pytest.mark.parametrize("body, why", [
    ({"cases": {}}, "no 'rows' list"),  # a conformance baseline
    ({"kind": "overhead", "rows": [{"op": "rmsnorm"}]}, "no 'rows' list"),
    ({"rows": []}, "no rows"),
    ({"rows": [{"op": "rmsnorm", "ms": 1.0}]}, "lacks 'op', 'impl' or 'dtype'"),
])
def test_bench_baseline_of_the_wrong_shape(tmp_path, capsys, no_run, body, why):
    path = tmp_path / "b.json"
    path.write_text(json.dumps(body))
    refused(capsys, [*BENCH, "--baseline", str(path)], "--baseline", str(path), why)


def test_bench_unknown_backend_and_op(capsys, no_run):
    refused(capsys, [*BENCH, "--backend", "nosuch"], "nosuch")
    refused(capsys, ["bench", "--op", "nosuch"], "nosuch")
