"""`opport list`, `doctor` and `explain` run and say what they should."""

from __future__ import annotations

import pytest

from opport.cli import main


def test_list_shows_every_op_and_the_cpu_backend(capsys):
    from opport.ops import all_ops

    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "cpu" in out
    for name in all_ops():
        assert name in out


def test_doctor_reports_cpu_mode(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "cpu" in out and "numpy" in out


def test_explain_prints_the_decision(capsys):
    assert main(["explain", "rmsnorm", "--shape", "4,64", "--shape", "64", "--dtype", "bfloat16", "--backend", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "cpu.rmsnorm" in out and "keyword" in out


def test_explain_rejects_bad_shapes_with_the_typed_error():
    from opport.errors import ShapeError

    with pytest.raises(ShapeError):
        main(["explain", "rmsnorm", "--shape", "4,64", "--shape", "63"])


def test_op_reference_is_current():
    from pathlib import Path

    from opport.opdoc import render

    committed = Path(__file__).parents[1] / "docs" / "ops.md"
    assert committed.read_text() == render(), "docs/ops.md is stale: run `python -m opport.opdoc > docs/ops.md`"
