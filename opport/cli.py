"""The `opport` command: list, doctor, explain, conformance, bench (docs/design.md section 6).

`conformance` and `bench` live in their own packages; each provides `add_arguments(parser)` and
`run(args) -> int` in its `cli` module.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys

from rich.console import Console
from rich.table import Table

SUBPACKAGES = {
    "conformance": ("opport.conformance.cli", "run the conformance suite against the float64 references"),
    "bench": ("opport.bench.cli", "run the performance suite"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="opport", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="op x backend matrix of kernels, dtypes and status")
    sub.add_parser("doctor", help="which backends can run here, their mode, library versions")
    ex = sub.add_parser("explain", help="the dispatch decision for one call")
    ex.add_argument("op")
    ex.add_argument("--shape", action="append", required=True, metavar="D0,D1,...",
                    help="shape of each array argument in order (repeat; 'none' for an omitted optional array)")
    ex.add_argument("--dtype", default="float32", help="dtype of the floating arrays")
    ex.add_argument("--backend", default=None)
    ex.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE", help="a scalar argument")
    for name, (module, help_) in SUBPACKAGES.items():
        mod = importlib.import_module(module)
        mod.add_arguments(sub.add_parser(name, help=help_))
    args = parser.parse_args(argv)
    if args.command in SUBPACKAGES:
        return importlib.import_module(SUBPACKAGES[args.command][0]).run(args)
    return {"list": cmd_list, "doctor": cmd_doctor, "explain": cmd_explain}[args.command](args)


def cmd_list(args) -> int:
    from opport.dispatch import backends, kernels
    from opport.ops import all_ops

    bs = backends()
    table = Table(title="opport kernels (op x backend)")
    table.add_column("op")
    for b in bs.values():
        status = b.unavailable()
        table.add_column(f"{b.name}\n[dim]{'unavailable' if status else b.mode()}[/dim]")
    for name, spec in all_ops().items():
        row = [name]
        for b in bs.values():
            ks = kernels(spec, b)
            row.append("\n".join(f"{k.name} [dim]{','.join(_short(d) for d in k.dtypes)}[/dim]" for k in ks) or "-")
        table.add_row(*row)
    Console().print(table)
    return 0


def _short(dtype: str) -> str:
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64"}.get(dtype, dtype)


def cmd_doctor(args) -> int:
    from opport.dispatch import backends

    console = Console()
    table = Table(title="opport backends on this machine")
    for col in ("backend", "status", "mode", "versions / how to get it"):
        table.add_column(col)
    for b in backends().values():
        reason = b.unavailable()
        if reason:
            table.add_row(b.name, "[red]unavailable[/red]", "-", f"{reason}\n{b.hint}")
        else:
            versions = ", ".join(f"{k} {v}" for k, v in b.versions().items())
            table.add_row(b.name, "[green]ok[/green]", b.mode(), versions)
    console.print(table)
    console.print(f"python {platform.python_version()} on {platform.machine()} ({sys.platform})")
    return 0


def cmd_explain(args) -> int:
    import numpy as np

    from opport.dispatch import explain
    from opport.dtypes import np_dtype
    from opport.ops import get_op

    spec = get_op(args.op)
    kwargs = {}
    for pair in args.arg:
        key, _, value = pair.partition("=")
        kwargs[key] = _literal(value)
    arrays = list(spec.arrays)
    if len(args.shape) > len(arrays):
        raise SystemExit(f"{spec.name} takes {len(arrays)} array arguments: {', '.join(arrays)}")
    for name, shape in zip(arrays, args.shape):
        if shape.lower() == "none":
            kwargs[name] = None
            continue
        dims = tuple(int(d) for d in shape.split(",") if d.strip())
        is_int = name == "target"  # cross_entropy's integer targets
        kwargs[name] = np.zeros(dims, np.int64 if is_int else np_dtype(args.dtype))
    Console().print(explain(spec, backend=args.backend, **kwargs))
    return 0


def _literal(text: str):
    import ast

    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


if __name__ == "__main__":
    sys.exit(main())
