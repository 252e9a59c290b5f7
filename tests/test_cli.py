"""The `opport` command: list, doctor and explain say what they should; every bad invocation is one line on
stderr and exit status 2 (no traceback unless --debug); list and doctor work without torch, triton or jax."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import opport
from opport import cli
from opport.cli import main
from opport.errors import OpError

ROOT = Path(__file__).parents[1]


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


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"opport {opport.__version__}"


# --------------------------------------------------------------------------- the error boundary

EXPLAIN = ["explain", "rmsnorm", "--shape", "8,7"]
BAD = [  # (argv, what the one line must name)
    ([], "command"),
    (["bogus"], "bogus"),
    (["explain", "rmsnorm"], "--shape"),
    (["explain", "nosuch", "--shape", "2"], "nosuch"),
    ([*EXPLAIN, "--dtype", "int99"], "int99"),
    (["explain", "rmsnorm", "--shape", "2,x"], "'2,x' is not a shape"),
    (["explain", "rmsnorm", "--shape", "2;3"], "'2;3' is not a shape"),
    (["explain", "rmsnorm", "--shape=2,-3"], "'2,-3' is not a shape"),
    (["explain", "rmsnorm", "--shape", ""], "'' is not a shape"),
    (["explain", "rmsnorm", "--shape", "+3"], "is not a shape"),
    (["explain", "rmsnorm", "--shape", "1000000000000,1000000000000"], "too large"),
    (["explain", "rmsnorm", "--shape", ",".join(["1"] * 65)], "too large"),
    (["explain", "rmsnorm", "--shape", "9" * 30], "too large"),
    ([*EXPLAIN, "--shape", "6"], "rmsnorm.weight_shape"),
    (["explain", "rmsnorm", "--shape", "()"], "rmsnorm.x_rank"),
    (["explain", "cross_entropy", "--shape", "8,7", "--shape", "9"], "cross_entropy.target_shape"),
    ([*EXPLAIN, "--backend", "nosuch"], "unknown backend 'nosuch'"),
    ([*EXPLAIN, "--backend", ""], "unknown backend ''"),
    ([*EXPLAIN, "--arg", "eps=abc"], "rmsnorm.eps"),
    ([*EXPLAIN, "--arg", "eps=1e999"], "rmsnorm.eps"),
    ([*EXPLAIN, "--arg", "eps=[1]"], "rmsnorm.eps"),
    ([*EXPLAIN, "--arg", "noname"], "NAME=VALUE"),
    ([*EXPLAIN, "--arg", "=1"], "NAME=VALUE"),
    ([*EXPLAIN, "--arg", "foo=1"], "no scalar argument 'foo'"),
    ([*EXPLAIN, "--arg", "x=1"], "no scalar argument 'x'"),
    ([*EXPLAIN, "--arg", "eps=1", "--arg", "eps=2"], "twice"),
    ([*EXPLAIN, "--shape", "7", "--shape", "7"], "takes 2 array"),
    (["explain", "cross_entropy", "--shape", "8,7"], "missing: target"),
    (["explain", "rmsnorm", "--shape", "none"], "x is required"),
]


def _one_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv, names", BAD, ids=[" ".join(a) or "(none)" for a, _ in BAD])
def test_bad_invocations_are_one_line_and_exit_2(argv, names, capsys):
    assert main(argv) == 2
    assert names in _one_line(capsys)


def test_the_backend_from_the_environment_is_checked_too(monkeypatch, capsys):
    monkeypatch.setenv("OPPORT_BACKEND", "nosuch")
    assert main(EXPLAIN) == 2
    assert "unknown backend 'nosuch'" in _one_line(capsys)


def test_done_when_in_a_real_process():
    """Issue 13: `opport explain rmsnorm --shape 8,7 --shape 6` prints one line naming the constraint, exit 2."""
    r = _opport("explain", "rmsnorm", "--shape", "8,7", "--shape", "6", module=True)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and "rmsnorm.weight_shape" in r.stderr, r.stderr


def test_debug_shows_the_traceback_and_keeps_the_status(capsys):
    assert main(["--debug", *EXPLAIN, "--shape", "6"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "ShapeError" in err
    assert "rmsnorm.weight_shape" in err.splitlines()[-1]


def _raise(error):
    def run(args):
        raise error

    return run


def test_a_bug_says_rerun_with_debug(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "list", _raise(RuntimeError("boom")))
    assert main(["list"]) == 1
    err = _one_line(capsys)
    assert "RuntimeError: boom" in err and "--debug" in err
    assert main(["--debug", "list"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_ctrl_c_is_one_line_and_130(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "doctor", _raise(KeyboardInterrupt()))
    assert main(["doctor"]) == 130
    assert "interrupted" in _one_line(capsys)


@pytest.mark.parametrize("command", ["conformance", "bench"])
@pytest.mark.parametrize("error, names", [
    (OpError(message="softmax: no such thing [softmax.x]"), "softmax.x"),
    (FileNotFoundError(2, "No such file or directory", "/no/such.json"), "/no/such.json"),
    (ValueError("corrupted baseline /tmp/b.json"), "/tmp/b.json"),
])
def test_subcommands_are_inside_the_boundary(command, error, names, monkeypatch, capsys):
    import importlib

    monkeypatch.setattr(importlib.import_module(cli.SUBPACKAGES[command][0]), "run", _raise(error))
    assert main([command]) == 2
    err = _one_line(capsys)
    assert err.startswith(f"opport {command}: error:") and names in err


# --------------------------------------------------------------------------- explain's arrays


def test_array_dtypes_come_from_the_declared_domains():
    from opport.ops import all_ops, get_op
    from opport.spec import INDEX, op

    @op(arrays=("x", "labels"), domains={"labels": INDEX})
    def toy(x, labels):
        """A declaration whose integer array is not called target."""

    assert toy.domain("labels") is INDEX and toy.domain("x").dtypes == toy.dtypes
    assert get_op("cross_entropy").domain("target") is INDEX
    assert get_op("cross_entropy_backward").domain("target") is INDEX  # derived specs read the forward's
    odd = {n for n, s in all_ops().items() if s.domains}
    assert odd == {"cross_entropy", "linear_cross_entropy", "linear_logprobs", "kv_cache_write", "kv_cache_write_fp8",
                   "paged_attention", "paged_varlen_attention", "varlen_attention", "dequantize_fp8", "scaled_matmul",
                   "rope", "topk_router", "moe_permute", "moe_unpermute", "grouped_matmul", "moe_experts", "sample",
                   "sampling_probs"}


def test_explain_gives_integer_arrays_an_integer_dtype(capsys):
    assert main(["explain", "cross_entropy", "--shape", "8,7", "--shape", "8", "--dtype", "float16", "--backend", "cpu"]) == 0
    assert "cpu.cross_entropy" in capsys.readouterr().out


def test_explain_allocates_nothing(capsys):
    assert main(["explain", "softmax", "--shape", "1000000,1000000", "--backend", "cpu"]) == 0  # 4 TB if allocated
    assert "cpu.softmax" in capsys.readouterr().out


# --------------------------------------------------------------------------- base install and rich markup


def _opport(*argv, block=(), module=False):
    """`opport ARGV` in a fresh interpreter with the modules in `block` made unimportable."""
    code = (f"import sys; sys.modules.update(dict.fromkeys({tuple(block)!r}))\n"  # None in sys.modules: ImportError
            "from opport.cli import main; sys.exit(main(sys.argv[1:]))")
    cmd = [sys.executable, "-m", "opport"] if module else [sys.executable, "-c", code]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "COLUMNS": "250"}
    return subprocess.run([*cmd, *argv], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


BASE = ("torch", "triton", "jax", "jaxlib")


def test_doctor_on_a_base_install():
    r = _opport("doctor", block=BASE)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "torch is not installed" in r.stdout
    assert "pip install 'opport[cuda]'" in r.stdout  # the hint, [cuda] not eaten as markup


def test_list_on_a_base_install():
    from opport.ops import all_ops

    r = _opport("list", block=BASE)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert all(f"cpu.{name}" in r.stdout for name in all_ops())
    assert "cuda: unavailable (torch is not installed)" in r.stdout and "opport[cuda]" in r.stdout


@pytest.fixture
def markup_backends():
    """Two throwaway backends whose texts look like rich markup: one unavailable, one with a kernel."""
    from opport.dispatch import Backend, impl, register_backend, unregister_backend
    from opport.ops import get_op

    down = Backend(name="down[x]", package="opport_test_no_such_pkg", array_kind="numpy", device_types=(), dtypes=("float32",),
                   probe=lambda: "needs [bold]hardware[/bold]", mode=lambda: "-", hint="pip install 'opport[down]'")
    up = Backend(name="up", package="opport_test_no_such_pkg", array_kind="numpy", device_types=(), dtypes=("float32",),
                 probe=lambda: None, mode=lambda: "mode[fast]", versions=lambda: {"lib": "1.0[rc]"})
    register_backend(down)
    register_backend(up)
    impl(get_op("softmax"), "up", dtypes=("float32",), name="up.[red]soft[/red]")(lambda x, axis: x)
    yield
    unregister_backend("down[x]")
    unregister_backend("up")


def test_markup_in_backend_texts_is_printed_as_is(markup_backends, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for text in ("down[x]", "needs [bold]hardware[/bold]", "pip install 'opport[down]'", "mode[fast]", "lib 1.0[rc]"):
        assert text in out, text
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "up.[red]soft[/red]" in out and "mode[fast]" in out and "down[x]" in out


def test_generated_files_are_current():
    """docs/ops.md and opport/_ops.py are what the declarations give (IDEs and readers see the real API)."""
    from opport.opdoc import stale

    assert stale() == [], f"{stale()} stale: run `python -m opport.opdoc`"
