"""Validation helpers for op declarations.

Each raises the typed error of docs/design.md section 2 with the op, argument and constraint id.
"""

from __future__ import annotations

import math

import numpy as np

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


# attention's arguments, shared by attention, varlen_attention and paged_attention
# Every backend computes the scaled scores in float32 (for 16- and 32-bit inputs): with |scale| <= 1e4 they
# overflow only where q·k itself nearly does (as any float32 product would), and scores of 1e4 already carry
# float32 rounding of 1e-3, which softmax turns into weights off by 0.1%. scale = 1e300 was accepted and
# rounded to inf: every output NaN where the float64 reference is finite (issue 15 item 3). No model uses
# scales near the bound (1/sqrt(D), 1, 1/D; a temperature of 0.01 gives 100·(1/sqrt(D))).
SCALE_MAX = 1e4
WINDOW_MAX = 2**31 - 1  # kernels index keys in int32


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.floating, np.integer)) and not isinstance(x, bool)


def check_scale(name: str, scale) -> None:
    """`<name>.scale` (shared by attention, varlen_attention and paged_attention): None, or a finite real scalar with
    |scale| <= SCALE_MAX. An array or tensor of any shape is refused, a 1-element one included: a scale multiplies
    every score of every head, and an array there is a per-head or per-batch scale mistaken for one, or a device
    value that would need a synchronisation to read. (A 0-d NumPy array reaches this check as its Python scalar:
    the dispatcher passes NumPy scalars and 0-d arrays in scalar positions as Python scalars, for every op.)"""
    ok = scale is None or (_is_number(scale) and math.isfinite(scale) and abs(scale) <= SCALE_MAX)
    got = f"{type(scale).__name__} of shape {tuple(scale.shape)}" if hasattr(scale, "shape") and not ok else repr(scale)
    check(ok, errors.ArgumentError, name, "scale", f"{name}.scale",
          f"None or a finite real scalar (not an array or tensor), abs(scale) <= {SCALE_MAX:g}", got)


def check_softcap_window(name: str, softcap, sliding_window, causal: bool) -> None:
    """softcap: None or finite > 0; sliding_window: None or an int in [1, 2**31 - 1], only with causal=True
    (shared by the ops that take the same definitions: `<name>.softcap`, `<name>.sliding_window`)."""
    ok = softcap is None or (_is_number(softcap) and math.isfinite(softcap) and softcap > 0)
    check(ok, errors.ArgumentError, name, "softcap", f"{name}.softcap", "None or a finite number > 0", repr(softcap))
    ok = sliding_window is None or (isinstance(sliding_window, (int, np.integer)) and not isinstance(sliding_window, bool)
                                    and 1 <= sliding_window <= WINDOW_MAX)
    check(ok, errors.ArgumentError, name, "sliding_window", f"{name}.sliding_window",
          f"None or an int in [1, {WINDOW_MAX}]", repr(sliding_window))
    check(sliding_window is None or causal is True, errors.ArgumentError, name, "sliding_window", f"{name}.sliding_window",
          "causal=True with a sliding window", f"causal={causal!r}")
