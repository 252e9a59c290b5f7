"""The `opport` command's error boundary, continued (issue 26, item 9): `--debug` is taken before or after the
subcommand, as the internal-error hint suggests, and `opport explain` refuses absurd shapes with one typed line."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from opport import cli
from opport.cli import main

# the smallest valid command line of every subcommand (its run is replaced by one that fails like a bug)
ARGV = {"list": [], "doctor": [], "explain": ["rmsnorm", "--shape", "4,8"], "conformance": [], "bench": [],
        "history": ["r.db"], "report": ["r.db", "--html", "out"]}


def test_every_subcommand_is_listed():
    assert set(ARGV) == set(cli.COMMANDS) | set(cli.SUBPACKAGES)


def _bug(monkeypatch, command: str):
    def run(args):
        raise RuntimeError("boom")

    if command in cli.COMMANDS:
        monkeypatch.setitem(cli.COMMANDS, command, run)
    else:
        monkeypatch.setattr(importlib.import_module(cli.SUBPACKAGES[command][0]), "run", run)


@pytest.mark.parametrize("command", sorted(ARGV))
def test_debug_before_or_after_the_subcommand(command, monkeypatch, capsys):
    _bug(monkeypatch, command)
    assert main([command, *ARGV[command]]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 1 and "re-run with --debug" in err
    for argv in (["--debug", command, *ARGV[command]], [command, *ARGV[command], "--debug"],
                 [command, "--debug", *ARGV[command]]):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert "Traceback" in err and "RuntimeError: boom" in err, argv
        assert err.splitlines()[-1].startswith(f"opport {command}: internal error"), argv


def test_debug_after_the_subcommand_shows_a_user_error_traceback_too(capsys):
    assert main(["explain", "rmsnorm", "--shape", "8,7", "--shape", "6", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "rmsnorm.weight_shape" in err.splitlines()[-1]


def test_debug_is_off_unless_asked(capsys):
    args = cli.build_parser().parse_args(["explain", "rmsnorm", "--shape", "4,8"])
    assert args.debug is False
    assert cli.build_parser().parse_args(["--debug", "explain", "rmsnorm", "--shape", "4,8"]).debug is True
    assert cli.build_parser().parse_args(["explain", "rmsnorm", "--shape", "4,8", "--debug"]).debug is True


# --------------------------------------------------------------------------- explain with absurd shapes

ABSURD = [
    (["explain", "rmsnorm", "--shape=-1,4"], "is not a shape"),  # negative
    (["explain", "rmsnorm", "--shape", "4,-8"], "is not a shape"),
    (["explain", "rmsnorm", "--shape", "1e9,4"], "is not a shape"),
    (["explain", "rmsnorm", "--shape", "99999999999,99999999999"], "too large"),  # past int64 elements
    (["explain", "rmsnorm", "--shape", "3037000499,3037000499"], "too large"),  # int64 elements, not bytes
    (["explain", "matmul", "--shape", "4294967296,1", "--shape", "1,4294967296"], "matmul.out_size"),  # its output
    (["explain", "attention", "--shape", "1,1,4294967296,8", "--shape", "1,1,4294967296,8",
      "--shape", "1,1,4294967296,8", "--arg", "causal=False"], None),  # valid: its output is q's shape
    (["explain", "cross_entropy", "--shape", "4,0", "--shape", "4"], "cross_entropy.logits_shape"),  # V = 0
    (["explain", "matmul", "--shape", "0", "--shape", "0"], "matmul.a_rank"),
]


@pytest.mark.parametrize("argv, names", ABSURD, ids=[" ".join(a[1:]) for a, _ in ABSURD])
def test_explain_refuses_absurd_shapes_in_one_typed_line(argv, names, capsys):
    if names is None:
        assert main(argv) == 0
        return
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("opport explain: error:") and names in err, err


def test_a_call_with_an_output_too_large_for_any_array_is_a_shape_error():
    import numpy as np

    import opport

    a = np.broadcast_to(np.float32(0), (2**32, 1))  # 16 GiB if allocated: zero strides, nothing is
    with pytest.raises(opport.ShapeError) as e:
        opport.matmul(a, np.broadcast_to(np.float32(0), (1, 2**32)))
    assert (e.value.constraint, e.value.arg) == ("matmul.out_size", "out")


def test_absurd_shape_in_a_real_process():
    r = subprocess.run([sys.executable, "-m", "opport", "explain", "matmul", "--shape", "4294967296,1", "--shape",
                        "1,4294967296"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1 and "matmul.out_size" in r.stderr
