"""softmax: exp(x - max) / sum over one axis; a row that is all -inf gives NaN (as torch.softmax)."""

from __future__ import annotations

import numpy as np

from opport import casegen as cg
from opport.spec import Case, Cost, ErrorCase, check_axis, check_float, check_grad, grad_constraints, op

NAME = "softmax"


@op(
    arrays=("x",),
    constraints={
        "softmax.dtype": "x is float32, float16, bfloat16 or float64",
        "softmax.axis": "axis is an int in [-x.ndim, x.ndim) (a 0-d x takes -1 or 0)",
    },
)
def softmax(x, axis=-1):
    """exp(x - max(x)) / sum(exp(x - max(x))) along `axis`, in float32 for 16-bit inputs.

    A row (the values along `axis`) that is all -inf, or holds +inf or NaN, is NaN throughout; a row
    with one finite value among -inf is one-hot. A 0-d x is a row of one element.
    """
    check_float(NAME, "x", x)
    check_axis(NAME, "axis", axis, x.ndim)


# batch invariance (docs/conformance.md): the arrays whose leading axis is the batch
softmax.batched("x", when=lambda x, axis: x.ndim >= 2 and axis % x.ndim != 0)  # not along the batch


@softmax.reference
def _reference(x, axis):
    if x.size == 0:
        return x.copy()
    with np.errstate(invalid="ignore", over="ignore"):  # -max - max overflows to -inf: exp gives 0, as it should
        e = np.exp(x - np.max(x, axis=axis, keepdims=True))  # all -inf: -inf - -inf = NaN
        return e / np.sum(e, axis=axis, keepdims=True)


# docs/numerics.md section 3.3: |sum(row) - 1| <= about log2(K) * u * 10 in float32; each 16-bit output
# errs by <= eps/2 relative, so a 16-bit row sum is off by at most eps/2 (checked against eps).
ROW_SUM_TOLERANCE = {"float64": 1e-13, "float32": 1e-5, "float16": 9.8e-4, "bfloat16": 7.8e-3}


@softmax.invariant
def _rows_sum_to_one(out64, x, axis):
    """Every row that is finite in the reference sums to 1 within ROW_SUM_TOLERANCE[dtype]."""
    if x.size == 0:
        return None
    x64 = np.asarray(x, np.float64)
    finite_row = np.all(np.isfinite(_reference(x64, axis)), axis=axis)
    err = np.abs(np.sum(out64, axis=axis) - 1.0)
    tol = ROW_SUM_TOLERANCE[np.dtype(x.dtype).name]
    bad = finite_row & ~(err <= tol)
    if bad.any():
        worst = np.unravel_index(np.argmax(np.where(bad, err, 0)), bad.shape)
        return f"{int(bad.sum())} rows do not sum to 1 within {tol}; worst row {worst}: |sum - 1| = {err[worst]:.3g}"
    return None


def _case(name, dtype, shape, dist="normal", scale=1.0, axis=-1, shift=0.0, tags=()):
    rng = cg.rng_for(NAME, name, dtype)
    x = cg.array(shape, dtype, rng, dist, scale)
    if shift:
        x = cg.cast(x.astype(np.float64) + shift, dtype)
    return Case(name, (x,), {"axis": axis}, tags)


def _masked(name, dtype, shape, mask, tags=("edge",)):
    """A normal-valued case with -inf where `mask(rows, cols)` holds."""
    x = cg.array(shape, dtype, cg.rng_for(NAME, name, dtype), "normal", 2.0)
    r, c = np.indices(shape)
    x[mask(r, c)] = -np.inf
    return Case(name, (x,), {"axis": -1}, tags)


def _peaked(dtype, peak):
    """One-hot-like rows: small noise plus one large logit per row (catches phantom tail columns)."""
    rng = cg.rng_for(NAME, f"peaked-{peak}", dtype)
    x = rng.standard_normal((8, 1000)) * 0.1
    x[np.arange(8), rng.integers(0, 1000, 8)] = peak
    return Case(f"peaked-{peak:g}", (cg.cast(x, dtype),), {"axis": -1}, ("edge",))


@softmax.cases
def _cases(dtype):
    yield _case("vocab-32000", dtype, (4, 32000), scale=3.0, tags=("llm",))
    yield _case("llama3-vocab-128256", dtype, (2, 128256), scale=3.0, tags=("llm",))
    yield _case("attn-scores", dtype, (2, 8, 64, 64), scale=4.0, tags=("llm",))
    yield _case("row-1", dtype, (7, 1))
    for n in (127, 128, 129, 8192):
        yield _case(f"row-{n}", dtype, (3, n), scale=2.0)
    yield _case("odd-3d", dtype, (2, 3, 23))
    yield _case("1d", dtype, (129,))
    yield _case("0d", dtype, ())
    yield _case("axis-0", dtype, (37, 5), axis=0)
    yield _case("axis-middle", dtype, (3, 17, 4), axis=1)
    yield _case("axis-0-of-3d", dtype, (23, 2, 3), axis=-3)
    yield _case("empty-rows", dtype, (0, 64))
    yield _case("empty-row", dtype, (3, 0))
    yield _masked("all-neg-inf-row", dtype, (4, 33), lambda r, c: r == 1)
    yield _masked("one-finite-in-neg-inf", dtype, (5, 40), lambda r, c: c != 3 * r)
    yield _masked("causal-mask", dtype, (64, 64), lambda r, c: c > r)
    yield _peaked(dtype, 30.0)
    yield _peaked(dtype, 1e3)
    yield Case("uniform-rows", (cg.cast(np.full((4, 300), -2.5), dtype),), {"axis": -1}, ("edge",))
    for shift in (1e4, -1e4, 1e8, -1e8):  # shift invariance; fp16 cannot hold 1e8, so it takes its max
        s = float(np.copysign(min(abs(shift), 6e4), shift)) if dtype == "float16" else shift
        yield _case(f"shift-{shift:+g}", dtype, (4, 257), scale=3.0, shift=s, tags=("edge",))
    yield _case("logits-1e4", dtype, (4, 257), scale=1e4, tags=("edge",))
    yield _case("logits-1e8", dtype, (4, 257), scale=6e4 if dtype == "float16" else 1e8, tags=("edge",))
    rng = cg.rng_for(NAME, "exp-range", dtype)
    ramp = np.linspace(-120.0, 0.0, 241)  # crosses fp32 exp underflow at -87.3 (normal) and -103.97
    yield Case("exp-range", (cg.cast(np.stack([ramp, rng.permutation(ramp)]), dtype),), {"axis": -1}, ("edge",))
    yield _case("specials", dtype, (6, 37), dist="specials", tags=("edge",))
    nan3 = cg.array((5, 33), dtype, cg.rng_for(NAME, "nan-every-3rd", dtype))
    nan3[::2, ::3] = np.nan  # odd rows keep no NaN and must stay exact
    yield Case("nan-every-3rd", (nan3,), {"axis": -1}, ("edge",))
    yield _case("heavy-tails", dtype, (8, 300), dist="heavy", scale=3.0)
    yield _case("loguniform", dtype, (8, 300), dist="loguniform")


@softmax.strategy
def _strategy(dtype):
    from hypothesis import strategies as st

    @st.composite
    def case(draw):
        shape = tuple(draw(st.lists(st.integers(1, 8), max_size=2))) + (draw(cg.dims(1, 2000)),)
        axis = draw(st.integers(-len(shape), len(shape) - 1))
        dist, scale = draw(cg.dists()), draw(st.one_of(cg.scales(), st.sampled_from([100.0, 1e4])))
        seed = draw(cg.seeds())
        x = cg.array(shape, dtype, np.random.default_rng(seed), dist, scale)
        return Case(f"hyp-{seed}", (x,), {"axis": axis}, ("hypothesis",))

    return case()


@softmax.error_cases
def _error_cases():
    from opport.errors import ArgumentError, DTypeError

    x = np.ones((2, 8), np.float32)
    yield ErrorCase("softmax.dtype", DTypeError, (np.ones((2, 8), np.int32),))
    yield ErrorCase("softmax.dtype", DTypeError, (np.ones((2, 8), np.complex64),))
    yield ErrorCase("softmax.axis", ArgumentError, (x,), {"axis": 2})
    yield ErrorCase("softmax.axis", ArgumentError, (x,), {"axis": -3})
    yield ErrorCase("softmax.axis", ArgumentError, (x,), {"axis": 1.0})
    yield ErrorCase("softmax.axis", ArgumentError, (x,), {"axis": None})


@softmax.cost
def _cost(x, axis):
    item = np.dtype(cg.np_dtype(x.dtype)).itemsize
    # max, subtract, exp, sum, divide: 5 FLOPs per element; one read and one write
    return Cost(bytes=2 * x.size * item, flops=5 * x.size)


# --------------------------------------------------------------------------- backward


@softmax.backward(wrt=("x",), constraints=grad_constraints(NAME))
def softmax_backward(grad, out, axis=-1):
    """Gradient of softmax for x.

    Saves only its output y (as torch does): the Jacobian of softmax is expressed in y alone, so x is not
    needed. dx = y (grad - sum(grad y, axis)) per row, evaluated as grad y - y sum(grad y) (no intermediate
    overflow for grads near the float maximum). Rows that were NaN in the forward (all -inf, +inf or NaN in
    x) give NaN; masked positions (y = 0) get exactly 0 wherever grad there and the row's sum(grad y) are
    finite.
    """
    softmax.validate(out, axis)
    check_grad(f"{NAME}_backward", grad, out.shape, out.dtype)


@softmax_backward.reference
def _backward_reference(grad, out, axis):
    if out.size == 0:
        return (np.zeros(out.shape),)
    with np.errstate(invalid="ignore", over="ignore"):
        return (out * grad - out * np.sum(grad * out, axis=axis, keepdims=True),)


@softmax_backward.cases
def _backward_cases(dtype):
    """Edge upstream gradients on one forward case (rows of -inf, one-hot rows etc. come from the forward's)."""
    fwd = _case("grad-edges", dtype, (8, 300), scale=3.0)
    rng = cg.rng_for(NAME, "grad-edges", dtype)
    grads = {
        "grad-zeros": cg.cast(np.zeros((8, 300)), dtype),
        "grad-constant-rows": cg.cast(np.full((8, 300), -7.0), dtype),  # dx = y c (1 - sum y): pure cancellation
        "grad-large": cg.array((8, 300), dtype, rng, "normal", 1e4),
        "grad-specials": cg.array((8, 300), dtype, rng, "specials"),
    }
    for name, g in grads.items():
        yield softmax_backward.from_forward(Case(name, fwd.args, fwd.kwargs, ("edge",)), dtype, g)


@softmax_backward.error_cases
def _backward_error_cases():
    from opport.errors import DTypeError, ShapeError

    y = np.full((2, 8), 0.125, np.float32)
    yield ErrorCase("softmax_backward.grad_shape", ShapeError, (np.ones((2, 7), np.float32), y))
    yield ErrorCase("softmax_backward.grad_shape", ShapeError, (np.ones((8, 2), np.float32), y))
    yield ErrorCase("softmax_backward.grad_dtype", DTypeError, (np.ones((2, 8), np.float64), y))


@softmax_backward.cost
def _backward_cost(grad, out, axis):
    item = np.dtype(cg.np_dtype(out.dtype)).itemsize
    # grad and y read, dx written; g y, its row sum, g - s, times y: 4 FLOPs per element
    return Cost(bytes=3 * out.size * item, flops=4 * out.size)


@softmax_backward.mutant("dropped-row-sum")
def _mutant_dropped_row_sum(grad, out, axis):
    """dx = y g: the term through the row's normaliser dropped."""
    return (out * grad,)
