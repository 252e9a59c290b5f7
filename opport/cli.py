"""The `opport` command: list, doctor, explain, conformance, bench (docs/design.md section 6).

`conformance` and `bench` live in their own packages; each provides `add_arguments(parser)` and
`run(args) -> int` in its `cli` module.

Every command runs inside one error boundary (`main`): a bad argument, an `OpError`, a `ValueError`
from user input or an `OSError` on a user-given path is one line on stderr and exit status 2; Ctrl-C
is 130; anything else is a bug: exit 1 and a line that says to re-run with `--debug`, which prints the
traceback in every case.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import traceback

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from opport.errors import OpError

SUBPACKAGES = {
    "conformance": ("opport.conformance.cli", "run the conformance suite against the float64 references"),
    "bench": ("opport.bench.cli", "run the performance suite"),
    "history": ("opport.store.history", "runs in a results store (--store DB); --compare A B: what changed"),
    "report": ("opport.store.html", "a static HTML page of a results store"),
}
EXIT_BUG, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class UsageError(Exception):
    """A bad command line; `prog` is the (sub)command whose arguments are wrong."""

    def __init__(self, message: str, prog: str | None = None):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """argparse whose errors reach the boundary as one line (instead of usage text and sys.exit)."""

    def error(self, message):
        raise UsageError(f"{message} (see `{self.prog} --help`)", self.prog)


# What a user can cause: one line, exit 2. OpError covers DTypeError (a TypeError) too.
USER_ERRORS = (OpError, UsageError, ValueError, OSError)


# --------------------------------------------------------------------------- the boundary


def main(argv=None) -> int:
    """Run one `opport` command and return its exit status (--help and --version raise SystemExit(0))."""
    argv = sys.argv[1:] if argv is None else list(argv)
    prog, debug = "opport", "--debug" in argv  # known before parsing, for errors while building the parser
    try:
        args = build_parser().parse_args(argv)
        args.argv = ["opport", *argv]  # what a results store records (docs/store.md)
        prog, debug = f"opport {args.command}", args.debug
        return run(args)
    except KeyboardInterrupt:
        return _fail(prog, "interrupted", EXIT_INTERRUPTED, debug)
    except USER_ERRORS as e:
        return _fail(getattr(e, "prog", None) or prog, f"error: {e}", EXIT_USAGE, debug)
    except Exception as e:
        why = f"internal error: {type(e).__name__}: {e} (a bug in opport; re-run with --debug for the traceback)"
        return _fail(prog, why, EXIT_BUG, debug)


def _fail(prog: str, message: str, status: int, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    print(f"{prog}: {' '.join(message.split())}", file=sys.stderr)  # one line, whatever the message holds
    return status


def run(args) -> int:
    if args.command in SUBPACKAGES:
        return importlib.import_module(SUBPACKAGES[args.command][0]).run(args)
    return COMMANDS[args.command](args)


def build_parser() -> argparse.ArgumentParser:
    from opport._version import __version__
    from opport.dtypes import FLOATS

    parser = _Parser(prog="opport", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"opport {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of any error")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="op x backend matrix of kernels, dtypes and status")
    sub.add_parser("doctor", help="which backends can run here, their mode, library versions")
    ex = sub.add_parser("explain", help="the dispatch decision for one call")
    ex.add_argument("op")
    ex.add_argument("--shape", action="append", required=True, type=_shape, metavar="D0,D1,...",
                    help="shape of each array argument in order (repeat; '()' for 0-d, 'none' for an omitted optional array)")
    ex.add_argument("--dtype", default="float32", choices=FLOATS,
                    help="the call's dtype: of the arrays that take the op's dtypes (the others: their declared domain's "
                         "first dtype, e.g. int64 labels, int32 indices, float8_e4m3fn codes, float32 scales)")
    ex.add_argument("--arg-dtype", action="append", default=[], type=_arg_pair, metavar="NAME=DTYPE",
                    help="the dtype of one array argument (e.g. target=int32, a_q=float8_e5m2)")
    ex.add_argument("--backend", default=None)
    ex.add_argument("--arg", action="append", default=[], type=_arg_pair, metavar="NAME=VALUE", help="a scalar argument")
    for name, (module, help_) in SUBPACKAGES.items():
        importlib.import_module(module).add_arguments(sub.add_parser(name, help=help_))
    for p in sub.choices.values():  # `opport bench --debug ...` as well as `opport --debug bench ...`
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show the traceback of any error")
    return parser


# --------------------------------------------------------------------------- list and doctor


def cmd_list(args) -> int:
    from opport.dispatch import backends
    from opport.ops import all_ops, with_derived

    bs = list(backends().values())
    table = Table(title="opport kernels (op x backend; <op>_backward: gradients, <op>_forward: training forward)")
    table.add_column("op", min_width=max(len(name) for name in all_ops()))  # op names whole, even at 80 columns
    for b in bs:
        table.add_column(f"{escape(b.name)}\n[dim]{'unavailable' if b.unavailable() else escape(b.mode())}[/dim]")
    unlisted = {}  # backend -> why its kernels could not be loaded here
    for spec in with_derived(all_ops().values()):
        table.add_row(escape(spec.name), *[_kernel_cell(spec, b, unlisted) for b in bs])
    console = Console()
    console.print(table)
    for b, why in unlisted.items():
        console.print(escape(f"{b.name}: unavailable ({b.unavailable()}); kernels not listed: {why}. {b.hint}".strip()))
    return 0


def _kernel_cell(spec, b, unlisted: dict) -> str:
    from opport.dispatch import kernels

    try:
        ks = kernels(spec, b)
    except Exception as e:
        if not b.unavailable():
            raise  # a backend that can run here must load its kernels: a bug
        unlisted.setdefault(b, f"{type(e).__name__}: {e}")  # a base install: its kernel modules need what is missing
        return "?"
    return "\n".join(f"{escape(k.name)} [dim]{escape(','.join(_short(d) for d in k.dtypes))}[/dim]" for k in ks) or "-"


def _short(dtype: str) -> str:
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64"}.get(dtype, dtype)


def cmd_doctor(args) -> int:
    from opport.doctor import backend_status, cpu_heap_line, python_line, torch_native_line

    console = Console()
    table = Table(title="opport backends on this machine")
    for col in ("backend", "status", "mode", "versions / how to get it"):
        table.add_column(col)
    for name, s in backend_status().items():
        if s["unavailable"]:
            table.add_row(escape(name), "[red]unavailable[/red]", "-", escape(f"{s['unavailable']}\n{s['hint']}".strip()))
        else:
            versions = ", ".join(f"{k} {v}" for k, v in s["versions"].items())
            table.add_row(escape(name), "[green]ok[/green]", escape(s["mode"]), escape(versions))
    console.print(table)
    console.print(escape(python_line()))
    console.print(escape(cpu_heap_line()))
    native = torch_native_line()
    if native is not None:
        console.print(escape(native))
    return 0


# --------------------------------------------------------------------------- explain


def cmd_explain(args) -> int:
    from opport.dispatch import explain
    from opport.ops import get_op

    spec = get_op(args.op)
    scalars = _scalars(spec, args.arg)
    if spec.dtype_pos is not None and args.dtype in spec.dtypes:  # the scalar that names the call's dtype
        scalars.setdefault(spec.params[spec.dtype_pos], args.dtype)
    kwargs = {**scalars, **_arrays(spec, args.shape, args.dtype, _dtype_pairs(args.arg_dtype))}
    Console().print(explain(spec, backend=args.backend, **kwargs))
    return 0


def _shape(text: str):
    """A `--shape` value: a tuple of dims, () for '()', None for 'none' (argparse reports what it raises)."""
    t = text.strip()
    if t.lower() == "none":
        return None
    if t == "()":
        return ()
    dims = [d.strip() for d in t.split(",")]
    if not all(re.fullmatch(r"[0-9]+", d) for d in dims):  # ASCII digits only: int() would also take '+3', '1_0'
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a shape: give D0,D1,... (non-negative integers), '()' for a 0-d array or 'none'")
    if any(len(d) > 19 for d in dims):  # beyond int64 (and int()'s digit limit): no array has such a dim
        raise argparse.ArgumentTypeError(f"{text!r}: a dimension is too large for an array")
    return tuple(int(d) for d in dims)


def _arg_pair(text: str) -> tuple:
    name, eq, value = text.partition("=")
    if not eq or not name.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE (e.g. eps=1e-5)")
    return name.strip(), value


def _scalars(spec, pairs) -> dict:
    """The `--arg` values, each checked to name one of the op's scalar arguments (validation judges the value)."""
    names = [spec.params[i] for i in spec.scalar_pos]
    out = {}
    for name, text in pairs:
        if name not in names:
            raise UsageError(f"--arg {name}: {spec.name} has no scalar argument {name!r} "
                             f"(it has: {', '.join(names) or 'none'}; arrays take --shape)")
        if name in out:
            raise UsageError(f"--arg {name} is given twice")
        out[name] = _literal(text)
    return out


def _literal(text: str):
    """A Python literal (1e-5, True, None, 'mean'); anything else is taken as the string itself."""
    import ast

    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # what literal_eval raises
        return text


def _arrays(spec, shapes: list, dtype: str, per_arg: dict) -> dict:
    """Metadata-only arrays of the given shapes, in the op's array order, each in a dtype its declared domain
    accepts (opport/spec/domains.py): `--arg-dtype NAME=DTYPE` if given, else `--dtype` where the domain has it,
    else the domain's first (integer indices, fp8 codes, float32 scales)."""
    names = spec.arrays
    required = [n for n in names if spec.signature.parameters[n].default is spec.signature.empty]
    if len(shapes) > len(names):
        raise UsageError(f"{spec.name} takes {len(names)} array argument(s) ({', '.join(names)}), got {len(shapes)} --shape")
    missing = [n for n in names[len(shapes):] if n in required]
    if missing:
        raise UsageError(f"{spec.name} needs a --shape for each of {', '.join(required)} "
                         f"(in order; missing: {', '.join(missing)})")
    unknown = [n for n in per_arg if n not in names]
    if unknown:
        raise UsageError(f"--arg-dtype {unknown[0]}: {spec.name} has no array argument {unknown[0]!r} "
                         f"(it has: {', '.join(names)})")
    out = {}
    for name, dims in zip(names, shapes):
        if dims is None and name in required:
            raise UsageError(f"--shape none: {spec.name}'s {name} is required")
        out[name] = None if dims is None else _placeholder(name, dims, per_arg.get(name) or spec.domain(name).example(dtype))
    return out


def _dtype_pairs(pairs) -> dict:
    from opport.dtypes import FLOATS, FP8, INTS

    known = FLOATS + INTS + FP8
    out = {}
    for name, value in pairs:
        if value not in known:
            raise UsageError(f"--arg-dtype {name}={value}: not a dtype (one of {', '.join(known)})")
        out[name] = value
    return out


def _placeholder(name: str, dims: tuple, dtype: str):
    """An array with this shape and dtype and nothing allocated (zero strides): explain reads metadata only."""
    import numpy as np

    from opport.dtypes import np_dtype

    try:
        return np.broadcast_to(np.zeros((), np_dtype(dtype)), dims)
    except ValueError as e:  # more than 64 dims, or more elements than NumPy can index
        raise UsageError(f"--shape {','.join(map(str, dims)) or '()'} for {name}: too large for an array ({e})") from e


COMMANDS = {"list": cmd_list, "doctor": cmd_doctor, "explain": cmd_explain}


if __name__ == "__main__":
    sys.exit(main())
