"""gelu: x * Phi(x) ("none", with erf) or its tanh approximation ("tanh"), elementwise."""

from __future__ import annotations

import math

import numpy as np

from opport import casegen as cg
from opport.ops.silu import ACTIVATION_TOLERANCE, activation_inputs, activation_strategy, elementwise_cost, sigmoid64
from opport.spec import Case, ErrorCase, check_choice, check_float, op

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
