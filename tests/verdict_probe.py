"""Run in a subprocess by tests/test_one_verdict.py: hashes of the cpu kernels' outputs on chosen cases, as JSON.

    python -m tests.verdict_probe [--judge] OP/DTYPE/CASE ...     (CASE may name a layout: `name@expanded`)

With --judge, each case's conformance status on cpu instead (`run_item`: the gate's own checks).

The environment (OPPORT_NUM_THREADS, OPENBLAS_NUM_THREADS, OPENBLAS_CORETYPE) is the caller's to set.
"""

import hashlib
import json
import sys

import numpy as np

import opport
from opport.conformance.cases import Item, lay_out
from opport.ops import get_op
from opport.public import function


def _item(case_id: str):
    """(spec, Item) of a fixed case or its layout variant; the declared cases are generated only up to it."""
    op, dtype, name = case_id.split("/", 2)
    spec = get_op(op)
    base, _, layout = name.partition("@")
    case = next(c for c in spec.get_cases(dtype) if c.name == base)
    return spec, Item(op, "cpu", dtype, name, case, layout or None, "layout" if layout else "fixed", tuple(case.tags))


def judge(case_id: str) -> str:
    from opport.conformance.execute import run_item

    res = run_item(_item(case_id)[1])
    return res["status"] if res["status"] == "pass" else f"{res['status']}: {res['message'][:300]}"


def digest(case_id: str) -> str:
    spec, item = _item(case_id)
    laid = lay_out(item.case, item.layout, None)
    with opport.strict():
        out = function(spec)(*laid.args, backend="cpu", **laid.kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    return hashlib.sha256(b"".join(np.ascontiguousarray(o).tobytes() for o in outs if o is not None)).hexdigest()[:16]


if __name__ == "__main__":
    fn, cases = (judge, sys.argv[2:]) if sys.argv[1:2] == ["--judge"] else (digest, sys.argv[1:])
    json.dump({c: fn(c) for c in cases}, sys.stdout)
