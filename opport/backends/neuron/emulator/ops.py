"""Operator tokens shared by nl and nisa: `nl.add` is both an ALU op argument and a callable nl op.

Kinds: "arith" (binary float math), "compare" (-> 1.0/0.0), "logical", "bitvec" (integer bit patterns),
"unary" (ALU unary), "act" (activation functions, also usable as nisa.activation ops).
"""

from __future__ import annotations

import math

import numpy as np

_erf = np.frompyfunc(math.erf, 1, 1)


def _erf64(x):
    return _erf(x).astype(np.float64)


def _sigmoid(x):
    with np.errstate(over="ignore"):
        e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _silu(x):
    return np.where(np.isneginf(x), -0.0, x * _sigmoid(x))  # silu(-inf) = -0.0, not inf*0


def _gelu(x):
    return 0.5 * x * (1.0 + _erf64(x / math.sqrt(2.0)))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


class Op:
    """An ALU operator or activation function; calling it runs the high-level nl op of the same name."""

    def __init__(self, name: str, kind: str, fn, reducible: bool = False, identity=None, arity: int = 2):
        self.name, self.kind, self.fn, self.reducible, self.identity, self.arity = name, kind, fn, reducible, identity, arity
        self.nl_impl = None  # bound by language.py

    def __repr__(self):
        return f"nl.{self.name}"

    def __call__(self, *args, **kwargs):
        if self.nl_impl is None:
            raise TypeError(f"nl.{self.name} is an operator token only")
        return self.nl_impl(*args, **kwargs)

    @property
    def is_activation(self) -> bool:
        return self.kind == "act" or self.name in ACT_ALSO

    def apply(self, a, b=None):
        """Elementwise math in float32 (bitvec ops on the integer bit patterns)."""
        with np.errstate(all="ignore"):
            if self.kind == "bitvec":
                return self.fn(a, b) if self.arity == 2 else self.fn(a)
            if self.arity == 1 or self.kind == "act":
                return np.asarray(self.fn(np.asarray(a, np.float64))).astype(np.float32)
            r = self.fn(np.asarray(a, np.float32), np.asarray(b, np.float32))
            return np.asarray(r).astype(np.float32)

    def reduce(self, a, axis):
        with np.errstate(all="ignore"):
            if self.kind == "bitvec":
                return self.fn.reduce(a, axis=axis)
            return self.fn.reduce(np.asarray(a, np.float32), axis=axis).astype(np.float32)


def _cmp(f):
    return lambda a, b: f(a, b).astype(np.float32)


def _logical(f):
    return lambda a, b: f(a != 0, b != 0).astype(np.float32)


def _abs_max(a, b):
    return np.maximum(np.abs(a), np.abs(b))


def _abs_min(a, b):
    return np.minimum(np.abs(a), np.abs(b))


OPS: dict[str, Op] = {}


def _def(name, kind, fn, reducible=False, arity=2):
    OPS[name] = Op(name, kind, fn, reducible, arity=arity)
    return OPS[name]


# binary arithmetic
for _n, _f in (("add", np.add), ("subtract", np.subtract), ("multiply", np.multiply), ("maximum", np.maximum),
               ("minimum", np.minimum)):
    _def(_n, "arith", _f, reducible=True)
_def("divide", "arith", np.divide)
_def("power", "arith", np.power)
_def("abs_max", "arith", _abs_max)
_def("abs_min", "arith", _abs_min)
# comparisons -> 1.0 / 0.0
for _n, _f in (("equal", np.equal), ("not_equal", np.not_equal), ("greater", np.greater),
               ("greater_equal", np.greater_equal), ("less", np.less), ("less_equal", np.less_equal)):
    _def(_n, "compare", _cmp(_f))
for _n, _f in (("logical_and", np.logical_and), ("logical_or", np.logical_or), ("logical_xor", np.logical_xor)):
    OPS[_n] = Op(_n, "logical", _logical(_f), reducible=True)
    OPS[_n].fn.reduce = lambda a, axis, _f=_f: _f.reduce(a != 0, axis=axis).astype(np.float32)
_def("logical_not", "logical", lambda a: (a == 0).astype(np.float32), arity=1)
for _n, _f in (("bitwise_and", np.bitwise_and), ("bitwise_or", np.bitwise_or), ("bitwise_xor", np.bitwise_xor)):
    _def(_n, "bitvec", _f, reducible=True)
_def("left_shift", "bitvec", np.left_shift)
_def("right_shift", "bitvec", np.right_shift)
_def("invert", "bitvec", np.invert, arity=1)
# activation functions (float64 math, rounded to float32: hardware LUTs are approximations of these)
_ACTS = {
    "copy": lambda x: x, "exp": np.exp, "log": np.log, "tanh": np.tanh, "sigmoid": _sigmoid, "silu": _silu,
    "gelu": _gelu, "gelu_apprx_tanh": _gelu_tanh, "gelu_apprx_sigmoid": lambda x: x * _sigmoid(1.702 * x),
    "relu": lambda x: np.maximum(x, 0.0), "rsqrt": lambda x: 1.0 / np.sqrt(x), "sqrt": np.sqrt,
    "square": np.square, "reciprocal": lambda x: 1.0 / x, "abs": np.abs, "erf": _erf64,
    "softplus": lambda x: np.logaddexp(0.0, x), "sin": np.sin, "cos": np.cos, "sign": np.sign,
    "negative": np.negative,
}
for _n, _f in _ACTS.items():
    _def(_n, "act", _f, arity=1)
ACT_ALSO = ()
# ALU unary ops that tensor_scalar also accepts (operand must be None/0)
ALU_UNARY = ("abs", "square", "relu", "rsqrt", "reciprocal")
# nl.max / nl.min are reductions in nl but name the same ALU op as maximum / minimum in nisa
ALIASES = {"max": "maximum", "min": "minimum", "mult": "multiply", "sub": "subtract"}
bypass = Op("bypass", "bypass", None, arity=1)


def resolve(op, what: str) -> Op:
    """The Op behind an argument (an Op token, or nl.max/nl.min reduction functions)."""
    if isinstance(op, Op):
        return op
    alias = getattr(op, "_alu_alias", None)
    if alias:
        return OPS[alias]
    from opport.backends.neuron.emulator.errors import NkiValidationError

    raise NkiValidationError(f"{what}: expected an nl operator token such as nl.add or nl.exp, got {op!r}")
