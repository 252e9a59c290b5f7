"""rmsnorm: x / sqrt(mean(x**2, -1) + eps) * (offset + weight), over the last axis."""

from __future__ import annotations

import math

import numpy as np

from opport import casegen as cg
from opport.errors import ArgumentError, ShapeError
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

NAME = "rmsnorm"


@op(
    arrays=("x", "weight"),
    constraints={
        "rmsnorm.dtype": "x is float32, float16, bfloat16 or float64",
        "rmsnorm.dtype_mismatch": "weight has x's dtype",
        "rmsnorm.x_rank": "x has at least one dimension",
        "rmsnorm.weight_shape": "weight.shape == (x.shape[-1],)",
        "rmsnorm.eps": "eps is a finite number > 0",
        "rmsnorm.offset": "offset is a finite number (not a bool), and 0 when weight is None",
    },
)
def rmsnorm(x, weight=None, eps=1e-6, offset=0.0):
    """Root-mean-square normalisation over the last axis, then an optional per-feature scale.

    y = x / sqrt(mean(x**2) + eps) * (offset + weight). `offset` (default 0; only with a weight) is
    added to the weight inside the kernel, in float32 (float64 for float64 inputs), never rounded to
    the weight's dtype: offset=1.0 is Gemma's `(1 + weight)` convention, whose weights start near 0.
    Statistics are computed in float32 for 16-bit inputs. Rows whose sum of squares would overflow
    (|x| near the dtype's maximum) are defined by the exact scaled form: the result stays finite.
    """
    check_float(NAME, "x", x)
    check_ndim(NAME, "x", x, 1, -1)
    if weight is not None:
        check_same_dtype(NAME, "x", x, weight=weight)
        check(weight.shape == (x.shape[-1],), ShapeError, NAME, "weight", "rmsnorm.weight_shape",
              f"({x.shape[-1]},) = x.shape[-1:]", weight.shape)
    check_eps(NAME, eps)
    check_offset(NAME, offset, weight)


def check_offset(op: str, offset, weight):
    """offset: a finite int or float (not a bool), and 0 without a weight (there is no weight to offset)."""
    finite = isinstance(offset, (int, float)) and not isinstance(offset, bool) and math.isfinite(offset)
    check(finite, ArgumentError, op, "offset", f"{op}.offset", "a finite number", repr(offset))
    check(weight is not None or offset == 0, ArgumentError, op, "offset", f"{op}.offset", "0 when weight is None",
          repr(offset))


# batch invariance (docs/conformance.md): the arrays whose leading axis is the batch
rmsnorm.batched("x", when=lambda x, *_: x.ndim >= 2)  # rows of x; a 1-d x is one row


@rmsnorm.reference
def _reference(x, weight, eps, offset=0.0):
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        # rows whose float64 squares could overflow are scaled by a power of two first (exact):
        # x / sqrt(mean(x^2) + eps) == (x s) / sqrt(mean((x s)^2) + eps s^2)
        amax = np.max(np.abs(x), axis=-1, keepdims=True, initial=0.0)
        big = np.isfinite(amax) & (amax > 2.0**400)
        s = np.where(big, np.ldexp(1.0, -np.frexp(amax)[1]), 1.0)
        xs = x * s
        y = xs / np.sqrt(np.mean(xs * xs, axis=-1, keepdims=True) + eps * s * s)
    return y if weight is None else y * (offset + weight)


def _case(name, dtype, shape, dist="normal", scale=1.0, weight=True, eps=1e-6, tags=(), offset=None, wscale=2.0):
    rng = cg.rng_for(NAME, name, dtype)
    x = cg.array(shape, dtype, rng, dist, scale)
    w = cg.array(shape[-1:], dtype, rng, "uniform", wscale) if weight else None
    return Case(name, (x, w), {"eps": eps} if offset is None else {"eps": eps, "offset": offset}, tags)


@rmsnorm.cases
def _cases(dtype):
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
    yield Case("constant-rows", (cg.cast(np.full((4, 64), -3.0), dtype), None), {"eps": 1e-6}, ("edge",))
    yield _case("large", dtype, (4, 256), scale=13437.7 if dtype == "float16" else 4988429.2, tags=("edge",))
    yield _case("tiny", dtype, (4, 256), scale=1e-4, tags=("edge",))
    yield _case("eps-large", dtype, (4, 64), eps=0.5)
    yield _case("specials", dtype, (6, 37), dist="specials", tags=("edge",))
    yield _case("heavy-tails", dtype, (8, 300), dist="heavy")
    yield _case("loguniform", dtype, (8, 300), dist="loguniform")
    # Gemma's (1 + weight): weights near 0 (its init), the offset added in float32 inside the kernel
    yield _case("offset-gemma", dtype, (6, 640), offset=1.0, wscale=0.05)
    yield _case("offset-odd-3d", dtype, (2, 3, 23), offset=1.0, wscale=0.05)
    yield _case("offset-row-1", dtype, (7, 1), offset=1.0, wscale=0.05)
    yield _case("offset-negative", dtype, (5, 129), offset=-0.5)  # offset + w crosses 0: scales of both signs
    yield _case("offset-specials", dtype, (6, 37), dist="specials", offset=1.0, wscale=0.05, tags=("edge",))


@rmsnorm.strategy
def _strategy(dtype):
    from hypothesis import strategies as st

    @st.composite
    def case(draw):
        shape = tuple(draw(st.lists(cg.dims(1, 64), min_size=0, max_size=2))) + (draw(cg.dims(1, 600)),)
        dist, scale, weight = draw(cg.dists()), draw(cg.scales()), draw(st.booleans())
        eps = draw(st.sampled_from([1e-6, 1e-5, 1e-2]))
        seed = draw(cg.seeds())
        offset = draw(st.sampled_from([0.0, 0.0, 1.0])) if weight else 0.0  # Gemma's 1 + w a third of the time
        rng = np.random.default_rng(seed)
        x = cg.array(shape, dtype, rng, dist, scale)
        w = cg.array(shape[-1:], dtype, rng, "uniform", 0.05 if offset else 2.0) if weight else None
        kwargs = {"eps": eps, "offset": offset} if offset else {"eps": eps}
        return Case(f"hyp-{seed}", (x, w), kwargs, ("hypothesis",))

    return case()


@rmsnorm.error_cases
def _error_cases():
    from opport.errors import DTypeError

    x = np.ones((2, 8), np.float32)
    yield ErrorCase("rmsnorm.dtype", DTypeError, (np.ones((2, 8), np.int32),))
    yield ErrorCase("rmsnorm.dtype_mismatch", DTypeError, (x, np.ones(8, np.float16)))
    yield ErrorCase("rmsnorm.x_rank", ShapeError, (np.ones((), np.float32),))
    yield ErrorCase("rmsnorm.weight_shape", ShapeError, (x, np.ones(7, np.float32)))
    yield ErrorCase("rmsnorm.eps", ArgumentError, (x,), {"eps": 0.0})
    yield ErrorCase("rmsnorm.eps", ArgumentError, (x,), {"eps": float("nan")})
    w = np.ones(8, np.float32)
    yield ErrorCase("rmsnorm.offset", ArgumentError, (x, w), {"offset": float("inf")})
    yield ErrorCase("rmsnorm.offset", ArgumentError, (x, w), {"offset": float("nan")})
    yield ErrorCase("rmsnorm.offset", ArgumentError, (x, w), {"offset": True})
    yield ErrorCase("rmsnorm.offset", ArgumentError, (x, w), {"offset": "1"})
    yield ErrorCase("rmsnorm.offset", ArgumentError, (x,), {"offset": 1.0})


@rmsnorm.cost
def _cost(x, weight, eps, offset=0.0):
    item = np.dtype(cg.np_dtype(x.dtype)).itemsize
    n = x.size
    w = weight.size * item if weight is not None else 0
    return Cost(bytes=2 * n * item + w, flops=4 * n)


# --------------------------------------------------------------------------- backward


@rmsnorm.backward(wrt=("x", "weight"), reduces=("weight",), constraints=grad_constraints(NAME))
def rmsnorm_backward(grad, x, weight=None, eps=1e-6, offset=0.0):
    """Gradients of rmsnorm for x and weight.

    Saves x and weight (the inputs), nothing else: the backward reads each row of x anyway and recomputes
    its 1/rms there, which costs no extra memory traffic. With r = 1/rms(x) and g = grad * (offset + weight):
    dx = r (g - x r mean(g x r)) per row; dweight = sum over rows of grad * x r (the offset is a constant:
    it changes dx's scale, not dweight's form).
    """
    rmsnorm.validate(x, weight, eps, offset)
    check_grad(f"{NAME}_backward", grad, x.shape, x.dtype)


@rmsnorm_backward.reference
def _backward_reference(grad, x, weight, eps, offset=0.0):
    # dtype-preserving (no float64 constants): the noise floor evaluates this in float32 as its baseline
    one = x.dtype.type(1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        amax = np.max(np.abs(x), axis=-1, keepdims=True, initial=0)
        big = np.isfinite(amax) & (amax > 2.0**400 if x.dtype == np.float64 else amax > 2.0**60)
        s = np.where(big, np.ldexp(one, -np.frexp(amax)[1]), one)  # as the forward: exact power-of-two scaling
        xs = x * s
        r = one / np.sqrt(np.mean(xs * xs, axis=-1, keepdims=True) + x.dtype.type(eps) * s * s)
        xhat = xs * r
        g = grad if weight is None else grad * (x.dtype.type(offset) + weight)
        dx = s * r * (g - xhat * np.mean(g * xhat, axis=-1, keepdims=True))
        dw = None if weight is None else np.sum(grad * xhat, axis=tuple(range(x.ndim - 1)))
    return dx, dw


@rmsnorm_backward.magnitude
def _backward_magnitude(grad, x, weight, eps, offset=0.0):
    """docs/numerics.md 3.10: dx = r (g - xhat mean(g xhat)) cancels where the two terms are close (16x measured: a row
    whose mean square is near eps); its magnitude is r (|g| + |xhat| mean|g xhat| (1 + log2 n)), the mean a tree sum
    of n terms. dweight sums grad * xhat over rows: sum |grad xhat|."""
    n = x.shape[-1]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        r = 1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
        xhat = np.abs(x * r)
        g = np.abs(grad if weight is None else grad * (offset + weight))
        dx = r * (g + xhat * np.mean(g * xhat, axis=-1, keepdims=True) * (1 + np.log2(max(n, 1))))
        dw = None if weight is None else np.sum(np.abs(grad) * xhat, axis=tuple(range(x.ndim - 1)))
    return dx, dw


@rmsnorm_backward.error_cases
def _backward_error_cases():
    from opport.errors import DTypeError

    x, w = np.ones((2, 8), np.float32), np.ones(8, np.float32)
    yield ErrorCase("rmsnorm_backward.grad_shape", ShapeError, (np.ones((2, 7), np.float32), x, w))
    yield ErrorCase("rmsnorm_backward.grad_dtype", DTypeError, (np.ones((2, 8), np.float16), x, w))


@rmsnorm_backward.cost
def _backward_cost(grad, x, weight, eps, offset=0.0):
    item = np.dtype(cg.np_dtype(x.dtype)).itemsize
    w = 2 * weight.size * item if weight is not None else 0  # weight read, its gradient written
    return Cost(bytes=3 * x.size * item + w, flops=8 * x.size)


_ONE_ELEMENT_ROWS = ("a one-element row's dx is r g (1 - xhat^2) = eps r^3 g: pure cancellation, which float32 "
                     "arithmetic resolves to about 6e-8 x^2 / eps relative; judged without the rule-6 atol cap")
for _name in ("row-1", "offset-row-1"):
    rmsnorm_backward.case_tolerance(
        _name, **{d: Tolerance(t.rtol, t.atol, t.metric, reason=_ONE_ELEMENT_ROWS) for d, t in BASE_TOLERANCE.items()})


@rmsnorm.mutant("offset-ignored")
def _mutant_offset_ignored(x, weight, eps, offset=0.0):
    """The forward scaled by the weight alone, the offset dropped (a kernel that never received it)."""
    return _reference(x, weight, eps)


@rmsnorm_backward.mutant("dropped-projection")
def _mutant_dropped_projection(grad, x, weight, eps, offset=0.0):
    """dx without the term through 1/rms (as if the statistic were a constant)."""
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    dx, dw = _backward_reference(grad, x, weight, eps, offset)
    return r * (grad if weight is None else grad * (offset + weight)), dw


@rmsnorm_backward.mutant("offset-dropped-from-dx")
def _mutant_offset_dropped(grad, x, weight, eps, offset=0.0):
    """dx through the weight alone, the offset dropped (dweight, whose form the offset does not change, right)."""
    dx, _ = _backward_reference(grad, x, weight, eps)
    return dx, _backward_reference(grad, x, weight, eps, offset)[1]


@rmsnorm_backward.mutant("weight-grad-of-last-row")
def _mutant_weight_not_summed(grad, x, weight, eps, offset=0.0):
    """dweight from the last row only, not summed over rows."""
    dx, dw = _backward_reference(grad, x, weight, eps, offset)
    if dw is None or x.size == 0:
        return dx, dw
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return dx, (grad * x * r).reshape(-1, x.shape[-1])[-1]
