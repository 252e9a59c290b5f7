"""swiglu: silu(gate) * up, elementwise over two same-shape arrays."""

from __future__ import annotations

import numpy as np

from opport import casegen as cg
from opport.errors import ShapeError
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
    silu_grad64,
)
from opport.spec import Case, ErrorCase, check, check_float, check_grad, check_same_dtype, grad_constraints, op

NAME = "swiglu"


@op(
    arrays=("gate", "up"),
    constraints={
        "swiglu.dtype": "gate is float32, float16, bfloat16 or float64",
        "swiglu.dtype_mismatch": "up has gate's dtype",
        "swiglu.shape_mismatch": "up.shape == gate.shape (no broadcasting)",
    },
)
def swiglu(gate, up):
    """SwiGLU's gating product silu(gate) * up (the MLP of Llama-style models), elementwise.

    silu follows `silu`'s rules (silu(-inf) = -0.0), so silu(-inf) * inf and silu(inf) * 0 are NaN;
    an infinite up times any finite gate != 0 is infinite (silu(gate) != 0), even where silu(gate)
    underflows the compute dtype.
    16-bit inputs are computed in float32 and rounded once.
    """
    check_float(NAME, "gate", gate)
    check_same_dtype(NAME, "gate", gate, up=up)
    check(up.shape == gate.shape, ShapeError, NAME, "up", "swiglu.shape_mismatch", f"{gate.shape} = gate.shape", up.shape)


# batch invariance (docs/conformance.md): the arrays whose leading axis is the batch
swiglu.batched("gate", "up")  # elementwise


@swiglu.reference
def _reference(gate, up):
    with np.errstate(invalid="ignore", over="ignore"):
        y = gate * (sigmoid64(gate) * up)
        # silu(gate) is nonzero for every finite gate != 0, so against an infinite up the exact result
        # is gate * up, even where float64 rounds silu(gate) to 0 (gate < -745)
        y = np.where(np.isinf(up), gate * up, y)
        return np.where(np.isneginf(gate), -0.0 * up, y)  # silu(-inf) = -0.0


swiglu.tolerance(**ACTIVATION_TOLERANCE)


def _edge_grid(dtype: str):
    """Every edge value as gate against every edge value as up (inf * 0 and friends)."""
    e = cg.edge_values(dtype)
    return np.repeat(e, e.size), np.tile(e, e.size)


@swiglu.cases
def _cases(dtype):
    for name, gate, tags in activation_inputs(NAME, dtype):
        rng = cg.rng_for(NAME, name, "up", dtype)
        yield Case(name, (gate, cg.array(gate.shape, dtype, rng, "normal", 2.0)), {}, tags)
    yield Case("edge-grid", _edge_grid(dtype), {}, ("edge",))
    rng = cg.rng_for(NAME, "up-specials", dtype)
    yield Case("up-specials", (cg.array((6, 37), dtype, rng), cg.array((6, 37), dtype, rng, "specials")), {}, ("edge",))
    big = 13437.7 if dtype == "float16" else 4988429.2
    rng = cg.rng_for(NAME, "product-overflow", dtype)
    yield Case("product-overflow", (cg.array((4, 64), dtype, rng, "uniform", big),
                                    cg.array((4, 64), dtype, rng, "uniform", big)), {}, ("edge",))


@swiglu.strategy
def _strategy(dtype):
    return activation_strategy(dtype, 2).map(lambda na: Case(na[0], tuple(na[1]), {}, ("hypothesis",)))


@swiglu.error_cases
def _error_cases():
    from opport.errors import DTypeError

    g = np.ones((2, 8), np.float32)
    yield ErrorCase("swiglu.dtype", DTypeError, (np.ones((2, 8), np.int64), np.ones((2, 8), np.int64)))
    yield ErrorCase("swiglu.dtype_mismatch", DTypeError, (g, np.ones((2, 8), np.float16)))
    yield ErrorCase("swiglu.dtype_mismatch", DTypeError, (g, np.ones((2, 8), np.int32)))
    yield ErrorCase("swiglu.shape_mismatch", ShapeError, (g, np.ones((2, 7), np.float32)))
    yield ErrorCase("swiglu.shape_mismatch", ShapeError, (g, np.ones((1, 8), np.float32)))  # no broadcasting


# silu's 5 FLOPs plus the product
swiglu.cost(elementwise_cost(2, 6))


# --------------------------------------------------------------------------- backward


@swiglu.backward(wrt=("gate", "up"), constraints=grad_constraints(NAME))
def swiglu_backward(grad, gate, up):
    """Gradients of swiglu for gate and up.

    Saves gate and up (the inputs). dgate = grad * up * silu'(gate), evaluated as (grad * silu'(gate)) * up,
    with silu'(gate) = sigmoid(gate) (1 + gate sigmoid(-gate)) and its limits silu'(-inf) = 0,
    silu'(+inf) = 1; dup = grad * silu(gate), which is swiglu(gate, grad) itself, with swiglu's rules for
    its special values. NaN anywhere gives NaN; inf * 0 is NaN (e.g. an infinite grad or up where gate is
    -inf, or below -745 where silu' underflows float64).
    """
    swiglu.validate(gate, up)
    check_grad(f"{NAME}_backward", grad, gate.shape, gate.dtype)


@swiglu_backward.reference
def _backward_reference(grad, gate, up):
    with np.errstate(invalid="ignore", over="ignore"):
        dgate = (grad * silu_grad64(gate)) * up
    return dgate, _reference(gate, grad)


swiglu_backward.tolerance(**ACTIVATION_GRAD_TOLERANCE)
loss_scaled_tolerance(swiglu_backward, "grad-loss-scaled")


@swiglu_backward.cases
def _backward_cases(dtype):
    by_name = {c.name: c for c in _cases(dtype)}
    yield from grad_cases(swiglu_backward, dtype, by_name["sweep"], by_name["edge-values"])
    # silu'(gate) subnormal or nearly (float32: gate < -87) against up near the float maximum: dgate stays O(1)
    rng = cg.rng_for(NAME, "deep-gate-huge-up", dtype)
    lo, hi = (-745.0, -512.0) if dtype == "float64" else (-110.0, -60.0)
    gate = cg.cast(rng.uniform(lo, hi, 512), dtype)
    up = cg.cast(rng.choice([-1.0, 1.0], 512) * float(cg.finfo(dtype).max) * rng.uniform(0.5, 1.0, 512), dtype)
    yield swiglu_backward.from_forward(Case("deep-gate-huge-up", (gate, up), {}, ("edge",)), dtype)


@swiglu_backward.error_cases
def _backward_error_cases():
    from opport.errors import DTypeError

    g = np.ones((2, 8), np.float32)
    yield ErrorCase("swiglu_backward.grad_shape", ShapeError, (np.ones((2, 7), np.float32), g, g))
    yield ErrorCase("swiglu_backward.grad_shape", ShapeError, (np.ones((1, 8), np.float32), g, g))  # no broadcasting
    yield ErrorCase("swiglu_backward.grad_dtype", DTypeError, (np.ones((2, 8), np.float64), g, g))


# silu' (about 9 FLOPs), silu (5) and the three products
swiglu_backward.cost(elementwise_grad_cost(2, 2, 17))


@swiglu_backward.mutant("gate-grad-without-derivative")
def _mutant_gate_without_derivative(grad, gate, up):
    """dgate = grad * up * sigmoid(gate): silu's derivative taken as sigmoid."""
    with np.errstate(invalid="ignore", over="ignore"):
        return grad * up * sigmoid64(gate), _reference(gate, grad)
