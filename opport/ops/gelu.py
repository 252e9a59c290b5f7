"""gelu: x * Phi(x) ("none", with erf) or its tanh approximation ("tanh"), elementwise."""

from __future__ import annotations

import math

import numpy as np

from opport import casegen as cg
from opport.ops.silu import (
    ACTIVATION_GRAD_TOLERANCE,
    ACTIVATION_TOLERANCE,
    activation_inputs,
    activation_strategy,
    elementwise_cost,
    elementwise_grad_cost,
    grad_cases,
    loss_scaled_tolerance,
    sigmoid64,
)
from opport.spec import Case, ErrorCase, check_choice, check_float, check_grad, grad_constraints, op

NAME = "gelu"
APPROXIMATIONS = ("none", "tanh")


@op(
    arrays=("x",),
    constraints={
        "gelu.dtype": "x is float32, float16, bfloat16 or float64",
        "gelu.approximate": "approximate is 'none' or 'tanh'",
    },
)
def gelu(x, approximate="none"):
    """GELU, elementwise, any shape.

    "none": x * Phi(x) = x/2 * (1 + erf(x/sqrt(2))); gelu(-3) = -0.00404951.
    "tanh": 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715x^3))); gelu(-3) = -0.00363752.
    The limits define the infinities in both forms: gelu(-inf) = -0.0 and gelu(+inf) = +inf (torch
    gives NaN for some of these). NaN propagates.
    """
    check_float(NAME, "x", x)
    check_choice(NAME, "approximate", approximate, APPROXIMATIONS)


_ERFC = np.frompyfunc(math.erfc, 1, 1)


# batch invariance (docs/conformance.md): the arrays whose leading axis is the batch
gelu.batched("x")  # elementwise


@gelu.reference
def _reference(x, approximate):
    with np.errstate(invalid="ignore", over="ignore"):
        if approximate == "tanh":
            # 1 + tanh(u) = 2 sigmoid(2u): same function, no cancellation where u << 0
            y = x * sigmoid64(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))
        else:
            # Phi(x) = erfc(-x/sqrt(2))/2: no cancellation in 1 + erf for x << 0
            y = 0.5 * x * np.asarray(_ERFC(-x / math.sqrt(2)), np.float64)
        return np.where(np.isneginf(x), -0.0, y)


gelu.tolerance(**ACTIVATION_TOLERANCE)


@gelu.cases
def _cases(dtype):
    for approximate in APPROXIMATIONS:
        for name, x, tags in activation_inputs(f"{NAME}-{approximate}", dtype):
            if approximate == "tanh" and "llm" not in tags and "edge" not in tags:
                continue  # the tanh form shares the activation code path; its edges and LLM shapes suffice
            yield Case(f"{approximate}/{name}", (x,), {"approximate": approximate}, tags)
    for approximate in APPROXIMATIONS:  # the value that tells the two forms apart (docs/numerics.md section 2)
        yield Case(f"{approximate}/minus-3", (cg.cast([-3.0, 3.0, -1.0, 1.0], dtype),), {"approximate": approximate}, ("edge",))


@gelu.strategy
def _strategy(dtype):
    from hypothesis import strategies as st

    return st.tuples(activation_strategy(dtype), st.sampled_from(APPROXIMATIONS)).map(
        lambda t: Case(f"{t[1]}/{t[0][0]}", (t[0][1][0],), {"approximate": t[1]}, ("hypothesis",)))


@gelu.error_cases
def _error_cases():
    from opport.errors import ArgumentError, DTypeError

    x = np.ones((2, 8), np.float32)
    yield ErrorCase("gelu.dtype", DTypeError, (np.ones((2, 8), np.int32),))
    yield ErrorCase("gelu.approximate", ArgumentError, (x,), {"approximate": "erf"})
    yield ErrorCase("gelu.approximate", ArgumentError, (x,), {"approximate": None})
    yield ErrorCase("gelu.approximate", ArgumentError, (x,), {"approximate": True})


# the erf fit or the tanh polynomial plus exp, divide, multiply: about 12 FLOPs per element
gelu.cost(elementwise_cost(1, 12))


# --------------------------------------------------------------------------- backward


@gelu.backward(wrt=("x",), constraints=grad_constraints(NAME))
def gelu_backward(grad, x, approximate="none"):
    """Gradient of gelu for x, both forms.

    Saves x (the input). dx = grad * gelu'(x):
    "none": gelu'(x) = Phi(x) + x phi(x), phi(x) = exp(-x^2/2) / sqrt(2 pi);
    "tanh": with 2u = sqrt(8/pi) (x + 0.044715 x^3), gelu(x) = x sigmoid(2u) and
    gelu'(x) = sigmoid(2u) + x sigmoid(2u) sigmoid(-2u) sqrt(8/pi) (1 + 3 * 0.044715 x^2).
    Their limits define the infinities: gelu'(-inf) = 0, gelu'(+inf) = 1. NaN in x or grad gives NaN; an
    infinite grad gives inf * gelu'(x), NaN where that is 0 (x = -inf, or x so negative that gelu'
    underflows float64).
    """
    gelu.validate(x, approximate)
    check_grad(f"{NAME}_backward", grad, x.shape, x.dtype)


_INV_SQRT_2PI = 1.0 / math.sqrt(2 * math.pi)


def gelu_grad64(x: np.ndarray, approximate: str) -> np.ndarray:
    """gelu'(x) in float64; the x-times-density term is 0 where the density is (|x| large, ±inf)."""
    with np.errstate(invalid="ignore", over="ignore"):
        if approximate == "tanh":
            c = math.sqrt(8 / math.pi)
            x2 = x * x
            two_u, slope = c * (x + 0.044715 * x2 * x), c * (1 + 3 * 0.044715 * x2)
            e = np.exp(-np.abs(two_u))
            q = 1.0 / (1.0 + e)
            t = np.where(e == 0, 0.0, x * slope * e)
            return q * (np.where(two_u >= 0, 1.0, e) + t * q)  # sigmoid(2u) + t sigmoid(2u) sigmoid(-2u)
        phi = np.exp(-0.5 * x * x) * _INV_SQRT_2PI
        cdf = 0.5 * np.asarray(_ERFC(-x / math.sqrt(2)), np.float64)
        return cdf + np.where(phi == 0, 0.0, x * phi)


@gelu_backward.reference
def _backward_reference(grad, x, approximate):
    with np.errstate(invalid="ignore", over="ignore"):
        return (grad * gelu_grad64(x, approximate),)


gelu_backward.tolerance(**ACTIVATION_GRAD_TOLERANCE)
for _form in APPROXIMATIONS:
    loss_scaled_tolerance(gelu_backward, f"{_form}/grad-loss-scaled")


@gelu_backward.cases
def _backward_cases(dtype):
    by_name = {c.name: c for c in _cases(dtype)}
    for form in APPROXIMATIONS:
        yield from grad_cases(gelu_backward, dtype, by_name[f"{form}/sweep"], by_name[f"{form}/edge-values"], f"{form}/")


@gelu_backward.error_cases
def _backward_error_cases():
    from opport.errors import DTypeError, ShapeError

    x = np.ones((2, 8), np.float32)
    yield ErrorCase("gelu_backward.grad_shape", ShapeError, (np.ones((2, 7), np.float32), x))
    yield ErrorCase("gelu_backward.grad_shape", ShapeError, (np.ones(16, np.float32), x))
    yield ErrorCase("gelu_backward.grad_dtype", DTypeError, (np.ones((2, 8), np.float16), x), {"approximate": "tanh"})


# the forward's erf fit (or the tanh polynomial and exp) plus the density, the combination and grad: about 16
gelu_backward.cost(elementwise_grad_cost(1, 1, 16))


@gelu_backward.mutant("dropped-x-phi")
def _mutant_dropped_x_phi(grad, x, approximate):
    """dx = grad * Phi(x): the x phi(x) term of the product rule dropped (erf form's Phi in both forms)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return (grad * 0.5 * np.asarray(_ERFC(-x / math.sqrt(2)), np.float64),)
