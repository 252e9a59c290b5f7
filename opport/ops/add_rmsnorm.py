"""add_rmsnorm: s = x + residual (in the input dtype), then rmsnorm(s, weight, eps); returns (normed, s)."""

from __future__ import annotations

import numpy as np

from opport import casegen as cg
from opport.errors import ShapeError
from opport.ops.rmsnorm import _backward_reference as _rmsnorm_backward_reference
from opport.ops.rmsnorm import _reference as _rmsnorm_reference
from opport.spec import (
    BASE_TOLERANCE,
    Case,
    Cost,
    ErrorCase,
    Tolerance,
    check,
    check_eps,
    check_float,
    check_grad,
    check_ndim,
    check_same_dtype,
    grad_constraints,
    op,
)

NAME = "add_rmsnorm"


@op(
    arrays=("x", "residual", "weight"),
    constraints={
        "add_rmsnorm.dtype": "x is float32, float16, bfloat16 or float64",
        "add_rmsnorm.dtype_mismatch": "residual and weight have x's dtype",
        "add_rmsnorm.x_rank": "x has at least one dimension",
        "add_rmsnorm.residual_shape": "residual.shape == x.shape",
        "add_rmsnorm.weight_shape": "weight.shape == (x.shape[-1],)",
        "add_rmsnorm.eps": "eps is a finite number > 0",
    },
)
def add_rmsnorm(x, residual, weight=None, eps=1e-6):
    """The residual add and RMS normalisation of a transformer layer in one pass: returns (normed, sum).

    sum = x + residual, computed and rounded in the input dtype (the residual stream a model stores);
    normed = rmsnorm(sum, weight, eps), computed from that rounded sum with float32 statistics for 16-bit
    inputs (float64 for float64). Each input is read once and each output written once. Rows whose sum
    of squares would overflow are defined by the exact scaled form, as rmsnorm's.
    """
    check_float(NAME, "x", x)
    check_ndim(NAME, "x", x, 1, -1)
    check_same_dtype(NAME, "x", x, residual=residual, weight=weight)
    check(tuple(residual.shape) == tuple(x.shape), ShapeError, NAME, "residual", "add_rmsnorm.residual_shape",
          f"{tuple(x.shape)} = x.shape", tuple(residual.shape))
    if weight is not None:
        check(weight.shape == (x.shape[-1],), ShapeError, NAME, "weight", "add_rmsnorm.weight_shape",
              f"({x.shape[-1]},) = x.shape[-1:]", weight.shape)
    check_eps(NAME, eps)


# batch invariance (docs/conformance.md): the arrays whose leading axis is the batch
add_rmsnorm.batched("x", "residual", when=lambda x, *_: x.ndim >= 2)


@add_rmsnorm.reference
def _reference(x, residual, weight, eps, *, input_dtype=None):
    """The sum rounded to `input_dtype` (the dtype under test; the inputs' own when not given), then rmsnorm of
    that rounded sum in float64."""
    with np.errstate(invalid="ignore", over="ignore"):
        s = cg.cast(x + residual, input_dtype) if input_dtype is not None else x + residual
    s = np.asarray(s, np.float64)
    return _rmsnorm_reference(s, weight, eps), s


def _case(name, dtype, shape, dist="normal", scale=1.0, weight=True, eps=1e-6, tags=(), rdist=None, rscale=None):
    rng = cg.rng_for(NAME, name, dtype)
    x = cg.array(shape, dtype, rng, dist, scale)
    r = cg.array(shape, dtype, rng, rdist or dist, scale if rscale is None else rscale)
    w = cg.array(shape[-1:], dtype, rng, "uniform", 2.0) if weight else None
    return Case(name, (x, r, w), {"eps": eps}, tags)


@add_rmsnorm.cases
def _cases(dtype):
    # rmsnorm's shapes and edge values (opport/ops/rmsnorm.py), with a residual beside x
    yield _case("llama8b-prefill", dtype, (16, 4096), tags=("llm",))
    yield _case("llama70b-decode", dtype, (2, 8192), tags=("llm",))
    yield _case("row-1", dtype, (7, 1))
    for n in (127, 128, 129):
        yield _case(f"row-{n}", dtype, (5, n))
    yield _case("odd-3d", dtype, (2, 3, 23))
    yield _case("1d", dtype, (129,))
    yield _case("no-weight", dtype, (4, 100), weight=False)
    yield _case("empty-rows", dtype, (0, 64))
    yield _case("empty-features", dtype, (3, 0))
    yield _case("zero-rows", dtype, (4, 64), dist="uniform", scale=0.0, tags=("edge",))
    c = cg.cast(np.full((4, 64), -3.0), dtype)
    yield Case("constant-rows", (c, cg.cast(np.full((4, 64), 1.0), dtype), None), {"eps": 1e-6}, ("edge",))
    big = 13437.7 if dtype == "float16" else 4988429.2
    yield _case("large", dtype, (4, 256), scale=big, tags=("edge",))
    yield _case("tiny", dtype, (4, 256), scale=1e-4, tags=("edge",))
    yield _case("eps-large", dtype, (4, 64), eps=0.5)
    yield _case("specials", dtype, (6, 37), dist="specials", tags=("edge",))
    yield _case("heavy-tails", dtype, (8, 300), dist="heavy")
    yield _case("loguniform", dtype, (8, 300), dist="loguniform")
    # the add itself: a small update on a large residual stream (the sum's rounding decides the norm's input),
    # x cancelling the residual, and sums near and past the dtype's maximum
    yield _case("small-update", dtype, (8, 256), scale=1e-3, rdist="normal", rscale=100.0)
    rng = cg.rng_for(NAME, "cancel", dtype)
    r = cg.array((6, 200), dtype, rng)
    x = cg.cast(-r.astype(np.float64) + cg.array((6, 200), "float64", rng, "normal", 1e-3), dtype)
    yield Case("cancel", (x, r, cg.array((200,), dtype, rng, "uniform", 2.0)), {"eps": 1e-6}, ("edge",))
    top = float(cg.finfo(dtype).max)
    rng = cg.rng_for(NAME, "near-max", dtype)
    x = cg.cast(np.abs(rng.standard_normal((4, 64))) * 0.3 * top, dtype)
    yield Case("near-max", (x, x.copy(), None), {"eps": 1e-6}, ("edge",))  # sums of up to ~2.4 max: some overflow


@add_rmsnorm.strategy
def _strategy(dtype):
    from hypothesis import strategies as st

    @st.composite
    def case(draw):
        shape = tuple(draw(st.lists(cg.dims(1, 64), min_size=0, max_size=2))) + (draw(cg.dims(1, 600)),)
        dist, scale, weight = draw(cg.dists()), draw(cg.scales()), draw(st.booleans())
        rdist, rscale = draw(cg.dists()), draw(cg.scales())
        eps = draw(st.sampled_from([1e-6, 1e-5, 1e-2]))
        seed = draw(cg.seeds())
        rng = np.random.default_rng(seed)
        x = cg.array(shape, dtype, rng, dist, scale)
        r = cg.array(shape, dtype, rng, rdist, rscale)
        w = cg.array(shape[-1:], dtype, rng, "uniform", 2.0) if weight else None
        return Case(f"hyp-{seed}", (x, r, w), {"eps": eps}, ("hypothesis",))

    return case()


@add_rmsnorm.error_cases
def _error_cases():
    from opport.errors import ArgumentError, DTypeError

    x = np.ones((2, 8), np.float32)
    yield ErrorCase("add_rmsnorm.dtype", DTypeError, (np.ones((2, 8), np.int32), np.ones((2, 8), np.int32)))
    yield ErrorCase("add_rmsnorm.dtype_mismatch", DTypeError, (x, np.ones((2, 8), np.float16)))
    yield ErrorCase("add_rmsnorm.dtype_mismatch", DTypeError, (x, x, np.ones(8, np.float16)))
    yield ErrorCase("add_rmsnorm.x_rank", ShapeError, (np.ones((), np.float32), np.ones((), np.float32)))
    yield ErrorCase("add_rmsnorm.residual_shape", ShapeError, (x, np.ones((2, 7), np.float32)))
    yield ErrorCase("add_rmsnorm.residual_shape", ShapeError, (x, np.ones((1, 8), np.float32)))
    yield ErrorCase("add_rmsnorm.weight_shape", ShapeError, (x, x, np.ones(7, np.float32)))
    yield ErrorCase("add_rmsnorm.eps", ArgumentError, (x, x), {"eps": 0.0})
    yield ErrorCase("add_rmsnorm.eps", ArgumentError, (x, x), {"eps": float("nan")})


@add_rmsnorm.outputs(("normed", "sum"))
def _outputs(x, residual, weight, eps):
    return [(tuple(x.shape), x.dtype)] * 2


@add_rmsnorm.cost
def _cost(x, residual, weight, eps):
    item = np.dtype(cg.np_dtype(x.dtype)).itemsize
    n = x.size
    w = weight.size * item if weight is not None else 0
    return Cost(bytes=4 * n * item + w, flops=5 * n)  # x and residual read, normed and sum written


_EXACT_SUM = ("sum is one addition rounded to the input dtype, correctly rounded in every kernel (a float32 add of "
              "two 16-bit values rounded once more to 16 bits is correctly rounded: 24 >= 2 x 11 + 2 bits): exact")
add_rmsnorm.tolerance(index=1, **{d: Tolerance(0.0, 0.0, signed_zero=True, reason=_EXACT_SUM)
                                  for d in BASE_TOLERANCE})


# --------------------------------------------------------------------------- backward


@add_rmsnorm.backward(wrt=("x", "residual", "weight"), reduces=("weight",), constraints=grad_constraints(NAME))
def add_rmsnorm_backward(grad_normed, grad_sum, sum, weight=None, eps=1e-6):
    """Gradients of add_rmsnorm for x, residual and weight, from the upstream gradients of both outputs.

    Saves the sum (an output the forward writes anyway) and weight; x and residual are not kept. With
    dn = rmsnorm's dx of grad_normed at the sum: dx = dresidual = dn + grad_sum (the same array);
    dweight = sum over rows of grad_normed * sum / rms(sum).
    """
    add_rmsnorm.validate(sum, sum, weight, eps)
    check_grad(f"{NAME}_backward", grad_normed, sum.shape, sum.dtype, "grad_normed")
    check_grad(f"{NAME}_backward", grad_sum, sum.shape, sum.dtype, "grad_sum")


@add_rmsnorm_backward.reference
def _backward_reference(grad_normed, grad_sum, s, weight, eps):
    dn, dw = _rmsnorm_backward_reference(grad_normed, s, weight, eps)
    with np.errstate(invalid="ignore", over="ignore"):
        d = dn + grad_sum
    return d, d, dw


@add_rmsnorm_backward.error_cases
def _backward_error_cases():
    from opport.errors import DTypeError

    s, w, g = np.ones((2, 8), np.float32), np.ones(8, np.float32), np.ones((2, 8), np.float32)
    yield ErrorCase("add_rmsnorm_backward.grad_shape", ShapeError, (np.ones((2, 7), np.float32), g, s, w))
    yield ErrorCase("add_rmsnorm_backward.grad_shape", ShapeError, (g, np.ones((2, 7), np.float32), s, w))
    yield ErrorCase("add_rmsnorm_backward.grad_dtype", DTypeError, (np.ones((2, 8), np.float16), g, s, w))
    yield ErrorCase("add_rmsnorm_backward.grad_dtype", DTypeError, (g, np.ones((2, 8), np.float16), s, w))


@add_rmsnorm_backward.cost
def _backward_cost(grad_normed, grad_sum, s, weight, eps):
    item = np.dtype(cg.np_dtype(s.dtype)).itemsize
    w = 2 * weight.size * item if weight is not None else 0  # weight read, its gradient written
    return Cost(bytes=4 * s.size * item + w, flops=9 * s.size)  # two grads and the sum read, dx written once


_ONE_ELEMENT_ROWS = ("a one-element row's dx is r g (1 - xhat^2) = eps r^3 g: pure cancellation, which float32 "
                     "arithmetic resolves to about 6e-8 x^2 / eps relative; judged without the rule-6 atol cap")
add_rmsnorm_backward.case_tolerance(
    "row-1", **{d: Tolerance(t.rtol, t.atol, t.metric, reason=_ONE_ELEMENT_ROWS) for d, t in BASE_TOLERANCE.items()})


@add_rmsnorm_backward.mutant("dropped-sum-gradient")
def _mutant_dropped_sum_gradient(grad_normed, grad_sum, s, weight, eps):
    """dx and dresidual from the norm's gradient only: the sum output's gradient left out."""
    dn, dw = _rmsnorm_backward_reference(grad_normed, s, weight, eps)
    return dn, dn, dw


@add_rmsnorm_backward.mutant("residual-gets-sum-gradient-only")
def _mutant_residual_skips_norm(grad_normed, grad_sum, s, weight, eps):
    """dresidual as if the norm read x alone (the skip connection's gradient only)."""
    d, _, dw = _backward_reference(grad_normed, grad_sum, s, weight, eps)
    return d, grad_sum, dw


@add_rmsnorm_backward.mutant("dropped-projection")
def _mutant_dropped_projection(grad_normed, grad_sum, s, weight, eps):
    """The norm's dx without the term through 1/rms (as if the statistic were a constant)."""
    r = 1.0 / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + eps)
    d, _, dw = _backward_reference(grad_normed, grad_sum, s, weight, eps)
    d = r * (grad_normed if weight is None else grad_normed * weight) + grad_sum
    return d, d, dw


@add_rmsnorm_backward.mutant("weight-grad-of-last-row")
def _mutant_weight_not_summed(grad_normed, grad_sum, s, weight, eps):
    """dweight from the last row only, not summed over rows."""
    d, _, dw = _backward_reference(grad_normed, grad_sum, s, weight, eps)
    if dw is None or s.size == 0:
        return d, d, dw
    r = 1.0 / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + eps)
    return d, d, (grad_normed * s * r).reshape(-1, s.shape[-1])[-1]
