"""Validation helpers for op declarations.

Each raises the typed error of docs/design.md section 2 with the op, argument and constraint id.
"""

from __future__ import annotations

import math

from opport import errors
from opport.dtypes import FLOATS
from opport.spec.records import Meta


def fail(error: type, op: str, arg: str | None, constraint: str, expected, got):
    raise error(op=op, arg=arg, constraint=constraint, expected=expected, got=got)


def check(cond: bool, error: type, op: str, arg: str | None, constraint: str, expected, got):
    if not cond:
        fail(error, op, arg, constraint, expected, got)


def check_float(op: str, arg: str, m: Meta, dtypes=FLOATS):
    check(m.dtype in dtypes, errors.DTypeError, op, arg, f"{op}.dtype", f"one of {', '.join(dtypes)}", m.dtype)


def check_same_dtype(op: str, first: str, m0: Meta, **others: Meta | None):
    for arg, m in others.items():
        if m is not None:
            check(m.dtype == m0.dtype, errors.DTypeError, op, arg, f"{op}.dtype_mismatch", f"{m0.dtype} (as {first})", m.dtype)


def check_ndim(op: str, arg: str, m: Meta, lo: int, hi: int | None = None, constraint: str | None = None):
    hi = lo if hi is None else hi
    ok = lo <= m.ndim and (hi < 0 or m.ndim <= hi)
    want = f"{lo}-d" if lo == hi else (f">= {lo}-d" if hi < 0 else f"{lo}-d to {hi}-d")
    check(ok, errors.ShapeError, op, arg, constraint or f"{op}.{arg}_rank", want, f"{m.ndim}-d {m.shape}")


def check_eps(op: str, eps):
    ok = isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps > 0
    check(ok, errors.ArgumentError, op, "eps", f"{op}.eps", "a finite number > 0", repr(eps))


def check_choice(op: str, arg: str, value, choices: tuple):
    check(value in choices, errors.ArgumentError, op, arg, f"{op}.{arg}", f"one of {choices}", repr(value))


def check_bool(op: str, arg: str, value):
    check(isinstance(value, bool), errors.ArgumentError, op, arg, f"{op}.{arg}", "True or False", repr(value))


def check_axis(op: str, arg: str, axis, ndim: int) -> int:
    ok = isinstance(axis, int) and not isinstance(axis, bool) and -max(ndim, 1) <= axis < max(ndim, 1)
    check(ok, errors.ArgumentError, op, arg, f"{op}.{arg}", f"an int in [-{max(ndim, 1)}, {max(ndim, 1)})", repr(axis))
    return axis % max(ndim, 1)



def check_grad(op: str, grad: Meta, shape: tuple, dtype: str, arg: str = "grad"):
    """A backward's upstream gradient (`arg`: `grad`, or `grad_<output>` of an op with several) has the forward
    output's shape and dtype."""
    check(grad is not None, errors.ArgumentError, op, arg, f"{op}.grad_shape", "an array", None)
    check(grad.dtype == dtype, errors.DTypeError, op, arg, f"{op}.grad_dtype", f"{dtype} (the output's dtype)",
          grad.dtype)
    check(tuple(grad.shape) == tuple(shape), errors.ShapeError, op, arg, f"{op}.grad_shape",
          f"{tuple(shape)} (the output's shape)", tuple(grad.shape))


GRAD_CONSTRAINTS = {"grad_dtype": "grad has the forward output's dtype", "grad_shape": "grad has the forward output's shape"}


def grad_constraints(op: str) -> dict:
    """The constraint ids `check_grad` raises, for a backward's declaration."""
    return {f"{op}_backward.{k}": v for k, v in GRAD_CONSTRAINTS.items()}
