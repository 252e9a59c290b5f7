"""The op declaration machinery.

An op is declared once, in `opport/ops/<name>.py`, by decorating its validation function:

    @op(arrays=("x", "weight"), constraints={"rmsnorm.weight_shape": "weight.shape == (x.shape[-1],)"})
    def rmsnorm(x, weight=None, eps=1e-6):
        ...  # validation only: array arguments arrive as `Meta` (shape, dtype, device), never data

and then attaching the rest to the returned `OpSpec`:

    @rmsnorm.reference      # NumPy float64 reference, takes float64 arrays
    @rmsnorm.cases          # fixed conformance cases for one dtype
    @rmsnorm.strategy       # Hypothesis strategy of cases for one dtype
    @rmsnorm.error_cases    # one bad input per declared constraint
    @rmsnorm.cost           # bytes moved and FLOPs, from metas

This module is pure declaration: it imports neither the dispatcher nor any backend. Backends register
kernels for a declared op with `@impl(rmsnorm, "cuda", dtypes=..., supports=...)` (opport.dispatch), and
`opport.rmsnorm(x, w)` is a plain function generated from the declaration (opport/_ops.py, opport/public.py)
that hands its arguments to the dispatcher.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from opport import errors
from opport.dtypes import FLOATS

# --------------------------------------------------------------------------- metadata


class Meta:
    """What validation and `supports(...)` may look at: an array's metadata, never its data."""

    __slots__ = ("kind", "dtype", "shape", "strides", "device")

    def __init__(self, kind: str, dtype: str, shape: tuple, strides: tuple | None, device: str):
        self.kind, self.dtype, self.shape = kind, dtype, tuple(shape)
        self.strides, self.device = strides, device  # strides in elements; None = contiguous

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def contiguous(self) -> bool:
        return self.strides is None or self.strides == contiguous_strides(self.shape)

    def __repr__(self):
        return f"Meta({self.kind}, {self.dtype}, shape={self.shape}, strides={self.strides}, {self.device})"


def contiguous_strides(shape: tuple) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


# --------------------------------------------------------------------------- declarations


@dataclass(frozen=True)
class Tolerance:
    """How an output is compared with the float64 reference (docs/numerics.md section 3).

    metric: "elementwise" |a-r| <= atol + rtol*|r|; "normwise" |a-r| <= atol + rtol*max|r|
    (K-accumulating ops); "ulp_or_abs" passes where the error is <= `ulp` units in the last
    place of the dtype or <= atol (composite activations near cancellation).
    NaN positions and signed infinities are always exact; signed zeros too where `signed_zero`.
    """

    rtol: float
    atol: float
    metric: str = "elementwise"
    ulp: float | None = None
    reason: str = ""
    signed_zero: bool = False  # the reference defines the sign of its zeros (elementwise ops): check it exactly


# docs/numerics.md section 3.2
BASE_TOLERANCE = {
    "float64": Tolerance(1e-7, 1e-7),
    "float32": Tolerance(1.3e-6, 1e-5),
    "float16": Tolerance(1e-3, 1e-5),
    "bfloat16": Tolerance(1.6e-2, 1e-5),
}


@dataclass(frozen=True)
class Cost:
    """Minimum bytes a fused kernel must move (read + write once) and the FLOPs it performs."""

    bytes: int
    flops: int


@dataclass
class Case:
    """One conformance input: NumPy arrays already in the dtype under test, plus scalars."""

    name: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    tags: tuple = ()
    tolerance: Tolerance | None = None  # per-case override; must carry a reason


@dataclass
class ErrorCase:
    """A bad input and the typed error it must raise before any kernel runs."""

    constraint: str
    error: type
    args: tuple
    kwargs: dict = field(default_factory=dict)


class OpSpec:
    """One operator: signature, validation, reference, cases, tolerances, cost (kernels live in opport.dispatch)."""

    def __init__(self, fn: Callable, arrays: tuple, constraints: dict, dtypes: tuple, out_dtype: str | None):
        self.name = fn.__name__
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn
        self.signature = inspect.signature(fn)
        self.params = tuple(self.signature.parameters)
        self.arrays = tuple(arrays)
        self.array_pos = tuple(self.params.index(a) for a in arrays)
        self.scalar_pos = tuple(i for i in range(len(self.params)) if i not in self.array_pos)
        self.constraints = {
            f"{self.name}.array_type": "array arguments are NumPy arrays, torch tensors or JAX arrays",
            f"{self.name}.device": "all arrays on one device the backend can use",
            **constraints,
        }
        self.dtypes = tuple(dtypes)
        self.fixed_out_dtype = out_dtype
        self.validate = fn
        self._bind = _make_binder(fn)
        self.module = self.name  # backends keep this op's kernels in `<backend package>.<module>`
        self._reference = self._cases = self._strategy = self._errors = self._cost = None
        self.tolerances: dict[str, Tolerance] = dict(BASE_TOLERANCE)
        self.invariants: list[Callable] = []
        self._shape: Callable | None = None

    # -- attaching the parts of the declaration

    def reference(self, fn):
        self._reference = fn
        return fn

    def cases(self, fn):
        self._cases = fn
        return fn

    def strategy(self, fn):
        self._strategy = fn
        return fn

    def error_cases(self, fn):
        self._errors = fn
        return fn

    def cost(self, fn):
        self._cost = fn
        return fn

    def shape(self, fn):
        """The output's shape rule `fn(*bound) -> tuple`, for ops whose output is not shaped like their first array."""
        self._shape = fn
        return fn

    def invariant(self, fn):
        """A property the output must have beyond closeness (e.g. softmax rows sum to 1).

        `fn(out64, *bound)` gets the kernel's output upcast to float64 and the case's arguments, and
        returns None when the property holds, else a message saying how it fails.
        """
        self.invariants.append(fn)
        return fn

    def tolerance(self, **per_dtype: Tolerance):
        """Override the base tolerance for some dtypes (each override says why in `reason`)."""
        self.tolerances.update(per_dtype)

    # -- using the declaration

    def bind(self, *args, **kwargs) -> tuple:
        """All parameters in signature order, defaults filled in (TypeError on a bad call)."""
        return self._bind(*args, **kwargs)

    def run_reference(self, *args, **kwargs):
        """The float64 reference on the given (already rounded) inputs, upcast to float64."""
        bound = list(self.bind(*args, **kwargs))
        for i in self.array_pos:
            a = bound[i]
            if a is not None and getattr(a, "dtype", None) is not None and a.dtype.kind in "fV":
                with np.errstate(invalid="ignore"):  # NaN payloads of 16-bit inputs
                    bound[i] = a.astype("float64")
        return self._reference(*bound)

    def get_cases(self, dtype: str) -> Iterable[Case]:
        return self._cases(dtype) if self._cases else ()

    def get_strategy(self, dtype: str):
        return self._strategy(dtype) if self._strategy else None

    def get_error_cases(self) -> Iterable[ErrorCase]:
        return self._errors() if self._errors else ()

    def get_cost(self, *args, **kwargs) -> Cost:
        return self._cost(*self.bind(*args, **kwargs))

    def dtype_of(self, bound: tuple) -> str:
        """The dtype that names a call (first array argument's dtype)."""
        return bound[self.array_pos[0]].dtype

    def out_shape(self, bound: tuple) -> tuple:
        """The output's shape for bound arguments (arrays or Metas)."""
        if self._shape is None:
            return tuple(bound[self.array_pos[0]].shape)
        return tuple(self._shape(*bound))

    def out_dtype(self, bound: tuple) -> str:
        return self.fixed_out_dtype or self.dtype_of(bound)

    def __repr__(self):
        return f"<opport op {self.name}{self.signature}>"


def op(arrays: tuple, constraints: dict | None = None, dtypes=FLOATS, out_dtype: str | None = None):
    """Declare an op from its validation function (see the module docstring)."""
    return lambda fn: OpSpec(fn, arrays, constraints or {}, dtypes, out_dtype)


def _make_binder(fn: Callable) -> Callable:
    """A real Python function with `fn`'s signature that returns its arguments as a tuple.

    Argument binding is then done by the interpreter itself, which is much cheaper on the
    dispatch hot path than `inspect.Signature.bind`.
    """
    params, names, env = [], [], {}
    for i, p in enumerate(inspect.signature(fn).parameters.values()):
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise TypeError(f"{fn.__name__}: op parameters must be named, got {p}")
        if p.kind is p.KEYWORD_ONLY and "*" not in params:
            params.append("*")
        if p.default is p.empty:
            params.append(p.name)
        else:
            env[f"_d{i}"] = p.default
            params.append(f"{p.name}=_d{i}")
        names.append(p.name)
    src = f"def {fn.__name__}({', '.join(params)}):\n    return ({', '.join(names)},)\n"
    exec(compile(src, f"<opport binder {fn.__name__}>", "exec"), env)
    return env[fn.__name__]


# --------------------------------------------------------------------------- validation helpers
# Each raises the typed error of docs/design.md section 2 with the op, argument and constraint id.


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

