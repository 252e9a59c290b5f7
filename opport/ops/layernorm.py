"""layernorm: (x - mean) / sqrt(var + eps) * weight + bias over the last axis, population variance."""

from __future__ import annotations

import numpy as np

from opport import casegen as cg
from opport.arraymath import row_scale
from opport.errors import ShapeError
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

NAME = "layernorm"


@op(
    arrays=("x", "weight", "bias"),
    constraints={
        "layernorm.dtype": "x is float32, float16, bfloat16 or float64",
        "layernorm.dtype_mismatch": "weight and bias have x's dtype",
        "layernorm.x_rank": "x has at least one dimension",
        "layernorm.weight_shape": "weight.shape == (x.shape[-1],)",
        "layernorm.bias_shape": "bias.shape == (x.shape[-1],)",
        "layernorm.eps": "eps is a finite number > 0",
    },
)
def layernorm(x, weight=None, bias=None, eps=1e-5):
    """Layer normalisation over the last axis with population variance, then optional scale and shift.

    Statistics are computed in float32 for 16-bit inputs. A constant row gives exactly 0 (then bias).
    Rows whose squares would overflow the statistics dtype are rescaled by a power of two first, so
    the result is finite wherever the exact one is.
    """
    check_float(NAME, "x", x)
    check_ndim(NAME, "x", x, 1, -1)
    check_same_dtype(NAME, "x", x, weight=weight, bias=bias)
    n = x.shape[-1]
    for arg, m in (("weight", weight), ("bias", bias)):
        if m is not None:
            check(m.shape == (n,), ShapeError, NAME, arg, f"layernorm.{arg}_shape", f"({n},) = x.shape[-1:]", m.shape)
    check_eps(NAME, eps)


def _normalised(x, eps):
    """(xhat, std, s): the normalised rows, sqrt(var + eps s^2) per row and the exact power-of-two row scale s,
    so that xhat = (x s - mean(x s)) / std. The forward and its VJP share this definition."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        s = row_scale(x, 2.0**400)  # float64 squares overflow near 1.3e154
        # shifted by the row's first element (exact near it): float64 inputs with a mean >> spread keep their digits
        c = x * s - x[..., :1] * s
        mean = np.mean(c, axis=-1, keepdims=True)
        mean += np.mean(c - mean, axis=-1, keepdims=True)  # one refinement: a constant row centres to exactly 0
        d = c - mean
        var = np.mean(d * d, axis=-1, keepdims=True)
        std = np.sqrt(var + _scaled_eps(s, eps))
        return d / std, std, s


def _scaled_eps(s, eps):
    """eps s^2 for rows scaled by s < 1, else eps. A scaled constant row has var == 0 and eps * s**2 may
    underflow: keep the 0 / sqrt(tiny) = 0 finite."""
    return np.where(s < 1, np.maximum(eps * s * s, np.finfo(np.float64).tiny), eps)


# batch invariance (docs/conformance.md): the arrays whose leading axis is the batch
layernorm.batched("x", when=lambda x, *_: x.ndim >= 2)


@layernorm.reference
def _reference(x, weight, bias, eps):
    if x.size == 0:
        return x.copy()
    y = _normalised(x, eps)[0]
    if weight is not None:
        y = y * weight
    return y if bias is None else y + bias


def _case(name, dtype, shape, dist="normal", scale=1.0, weight=True, bias=True, eps=1e-5, shift=0.0, tags=()):
    rng = cg.rng_for(NAME, name, dtype)
    x = cg.array(shape, dtype, rng, dist, scale)
    if shift:
        x = cg.cast(x.astype(np.float64) + shift, dtype)
    w = cg.array(shape[-1:], dtype, rng, "uniform", 2.0) if weight else None
    b = cg.array(shape[-1:], dtype, rng, "normal", 0.5) if bias else None
    return Case(name, (x, w, b), {"eps": eps}, tags)


# (offset, spread) of "large-offset" per dtype: a float32 mean of 1e6 + N(0, 1) is off by up to 0.03 in every
# x - mean (docs/numerics.md 3.8); float64 (cpu) likewise at 1e15 (ulp 0.125).
# A 16-bit row can hold only a few bits of spread under its offset: here one standard deviation is 8 ulps of
# the offset (offset / spread 250 in float16, 31 in bfloat16), which float32 statistics must keep.
_LARGE_OFFSET = {"float32": (1e6, 1.0), "float64": (1e15, 1.0), "float16": (2000.0, 8.0), "bfloat16": (2000.0, 64.0)}


def _large_offset(dtype):
    shift, spread = _LARGE_OFFSET[dtype]
    return _case("large-offset", dtype, (8, 1000), scale=spread, shift=shift, tags=("edge",))


@layernorm.cases
def _cases(dtype):
    big = 13437.7 if dtype == "float16" else 4988429.2
    yield _case("llama8b-width", dtype, (16, 4096), tags=("llm",))
    yield _case("gpt2-xl-width", dtype, (8, 1600), scale=3.0, tags=("llm",))
    yield _case("bert-large-batch", dtype, (4, 16, 1024), tags=("llm",))
    yield _case("row-1", dtype, (7, 1))
    for n in (127, 128, 129):
        yield _case(f"row-{n}", dtype, (5, n))
    yield _case("odd-3d", dtype, (2, 3, 23))
    yield _case("1d", dtype, (129,))
    yield _case("no-weight-no-bias", dtype, (4, 100), weight=False, bias=False)
    yield _case("weight-only", dtype, (4, 100), bias=False)
    yield _case("bias-only", dtype, (4, 100), weight=False)
    yield _case("empty-rows", dtype, (0, 64))
    yield _case("empty-features", dtype, (3, 0))
    yield _case("zero-rows", dtype, (4, 64), dist="uniform", scale=0.0, tags=("edge",))
    consts = cg.cast(np.repeat([[-3.0], [0.1], [1e3], [big]], 64, axis=1), dtype)
    yield Case("constant-rows", (consts, None, None), {"eps": 1e-5}, ("edge",))
    yield _case("offset-rows", dtype, (4, 256), shift=8.0, tags=("edge",))  # mean >> std: the centring matters
    yield _large_offset(dtype)
    yield _case("large", dtype, (4, 256), scale=big, tags=("edge",))
    yield _case("tiny", dtype, (4, 256), scale=1e-4, tags=("edge",))
    yield _case("eps-dominates", dtype, (4, 64), scale=1e-3, eps=0.5)
    yield _case("specials", dtype, (6, 37), dist="specials", tags=("edge",))
    edges = cg.edge_values(dtype, finite=True)
    yield Case("edge-values-row", (edges[None, :], None, None), {"eps": 1e-5}, ("edge",))
    yield _case("heavy-tails", dtype, (8, 300), dist="heavy")
    yield _case("loguniform", dtype, (8, 300), dist="loguniform")


@layernorm.strategy
def _strategy(dtype):
    from hypothesis import strategies as st

    @st.composite
    def case(draw):
        shape = tuple(draw(st.lists(st.integers(1, 8), max_size=2))) + (draw(cg.dims(1, 2000)),)
        dist, scale = draw(cg.dists()), draw(cg.scales())
        weight, bias = draw(st.booleans()), draw(st.booleans())
        eps = draw(st.sampled_from([1e-6, 1e-5, 1e-2]))
        seed = draw(cg.seeds())
        rng = np.random.default_rng(seed)
        x = cg.array(shape, dtype, rng, dist, scale)
        w = cg.array(shape[-1:], dtype, rng, "uniform", 2.0) if weight else None
        b = cg.array(shape[-1:], dtype, rng, "normal", 0.5) if bias else None
        return Case(f"hyp-{seed}", (x, w, b), {"eps": eps}, ("hypothesis",))

    return case()


@layernorm.error_cases
def _error_cases():
    from opport.errors import ArgumentError, DTypeError

    x, w = np.ones((2, 8), np.float32), np.ones(8, np.float32)
    yield ErrorCase("layernorm.dtype", DTypeError, (np.ones((2, 8), np.int32),))
    yield ErrorCase("layernorm.dtype_mismatch", DTypeError, (x, np.ones(8, np.float16)))
    yield ErrorCase("layernorm.dtype_mismatch", DTypeError, (x, w, np.ones(8, np.float64)))
    yield ErrorCase("layernorm.x_rank", ShapeError, (np.ones((), np.float32),))
    yield ErrorCase("layernorm.weight_shape", ShapeError, (x, np.ones(7, np.float32)))
    yield ErrorCase("layernorm.weight_shape", ShapeError, (x, np.ones((1, 8), np.float32)))
    yield ErrorCase("layernorm.bias_shape", ShapeError, (x, w, np.ones(9, np.float32)))
    yield ErrorCase("layernorm.bias_shape", ShapeError, (x, None, np.ones(7, np.float32)))
    yield ErrorCase("layernorm.eps", ArgumentError, (x,), {"eps": 0.0})
    yield ErrorCase("layernorm.eps", ArgumentError, (x,), {"eps": -1e-5})
    yield ErrorCase("layernorm.eps", ArgumentError, (x,), {"eps": float("inf")})
    yield ErrorCase("layernorm.eps", ArgumentError, (x,), {"eps": "1e-5"})


@layernorm.cost
def _cost(x, weight, bias, eps):
    item = np.dtype(cg.np_dtype(x.dtype)).itemsize
    n = x.size
    params = sum(p.size for p in (weight, bias) if p is not None) * item
    # mean, centre, square, mean, normalise, scale, shift: about 7 FLOPs per element
    return Cost(bytes=2 * n * item + params, flops=7 * n)


# --------------------------------------------------------------------------- backward


@layernorm.backward(wrt=("x", "weight", "bias"), reduces=("weight", "bias"), constraints=grad_constraints(NAME))
def layernorm_backward(grad, x, weight=None, bias=None, eps=1e-5):
    """Gradients of layernorm for x, weight and bias.

    Saves x, weight and bias (the inputs; bias only for its shape), nothing else: the backward reads each
    row of x anyway and recomputes its mean and 1/std there, which costs no extra memory traffic. With
    xhat = (x - mean) / std, std = sqrt(var + eps) and g = grad * weight:
    dx = (g - mean(g) - xhat mean(g xhat)) / std per row; dweight = sum over rows of grad * xhat;
    dbias = sum over rows of grad. Rows the forward rescales by a power of two s (huge values) follow the
    forward's exact scaled definition: dx = s (g - mean(g) - xhat mean(g xhat)) / std(x s).
    A row with NaN or inf in x gives NaN in its dx and in all of dweight (NaN * anything); dbias only
    sees grad.
    """
    layernorm.validate(x, weight, bias, eps)
    check_grad(f"{NAME}_backward", grad, x.shape, x.dtype)


@layernorm_backward.reference
def _backward_reference(grad, x, weight, bias, eps):
    rows = tuple(range(x.ndim - 1))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if x.size == 0:
            xhat, std, s = x, np.ones(x.shape[:-1] + (1,)), 1.0
        else:
            xhat, std, s = _normalised(x, eps)
        g = grad if weight is None else grad * weight
        mean_g = np.mean(g, axis=-1, keepdims=True) if x.size else 0.0
        if x.shape[-1] == 2:
            # xhat = (h, -h): the bracket is (g - mean(g)) (1 - h^2) with 1 - h^2 = eps s^2 / std^2 exactly;
            # the general form cancels ~1/(1 - h^2) = var / eps too much (float64 noise reaches 1e-16 var / eps)
            centred = (g - mean_g) * (_scaled_eps(s, eps) / (std * std))
        else:
            centred = g - mean_g - xhat * (np.mean(g * xhat, axis=-1, keepdims=True) if x.size else 0.0)
        dx = s * centred / std
        dw = None if weight is None else np.sum(grad * xhat, axis=rows)
        db = None if bias is None else np.sum(grad, axis=rows)
    return dx, dw, db


LOSS_SCALE = 2.0**10  # as fp16 training scales its loss: every gradient is exactly this times a unit-scale one


def _with_grad(name, fwd: Case, dtype, grad, tags=("edge",)):
    return layernorm_backward.from_forward(Case(name, fwd.args, fwd.kwargs, tags), dtype, grad)


@layernorm_backward.cases
def _backward_cases(dtype):
    """Edge upstream gradients and weights (zero rows, constant rows, huge rows come from the forward's cases)."""
    fwd = _case("grad-edges", dtype, (8, 300))
    rng = cg.rng_for(NAME, "grad-edges", dtype)
    yield _with_grad("grad-zeros", fwd, dtype, cg.cast(np.zeros((8, 300)), dtype))
    yield _with_grad("grad-constant-rows", fwd, dtype, cg.cast(np.full((8, 300), 3.0), dtype))  # dx = 0 exactly
    unit = cg.array((8, 300), dtype, rng)
    yield _with_grad("grad-loss-scaled", fwd, dtype, cg.cast(unit.astype(np.float64) * LOSS_SCALE, dtype))
    yield _with_grad("grad-specials", fwd, dtype, cg.array((8, 300), dtype, rng, "specials"))
    x, w, b = fwd.args
    zero_w = Case("zero-weight", (x, np.zeros_like(w), b), fwd.kwargs)  # dx = 0; dweight, dbias still flow
    yield _with_grad("zero-weight", zero_w, dtype, cg.array((8, 300), dtype, rng))


@layernorm_backward.error_cases
def _backward_error_cases():
    from opport.errors import DTypeError

    x, w = np.ones((2, 8), np.float32), np.ones(8, np.float32)
    yield ErrorCase("layernorm_backward.grad_shape", ShapeError, (np.ones((2, 7), np.float32), x, w, w))
    yield ErrorCase("layernorm_backward.grad_shape", ShapeError, (np.ones((8,), np.float32), x, w, w))
    yield ErrorCase("layernorm_backward.grad_dtype", DTypeError, (np.ones((2, 8), np.float16), x, w, w))


@layernorm_backward.cost
def _backward_cost(grad, x, weight, bias, eps):
    item = np.dtype(cg.np_dtype(x.dtype)).itemsize
    params = (2 * weight.size if weight is not None else 0) + (bias.size if bias is not None else 0)
    # grad and x read, dx written; weight read, dweight and dbias written. Mean, centre, square, mean,
    # normalise; g w, its mean, g xhat and its mean, the combination (4), grad xhat and the two row sums: ~16
    return Cost(bytes=3 * x.size * item + params * item, flops=16 * x.size)


# dx is linear in grad and a power-of-two scale is exact in every operation, so the kernel's result on
# "grad-loss-scaled" is exactly LOSS_SCALE times its result on the unit-scale grad: only the absolute part of
# the tolerance, set for unit-scale outputs, scales with it. Measured (float32, before choosing this case):
# upstream gradients of 1e4 give errors up to 1.1e-4 at |dx| = 0.6, where (g - mean g) ~ 1e4 and xhat mean(g
# xhat) cancel: one float32 rounding of a 1e4-sized term, 2.7e-9 of max|grad|.
_LOSS_SCALED = ("grad is 2^10 x a unit-scale gradient and dx is exactly 2^10 x the unit-scale result (power-of-two "
                "scaling is exact): atol scales with it; float32's error is one rounding of the O(|grad|) terms "
                "(g - mean g) and xhat mean(g xhat), which cancel")
layernorm_backward.case_tolerance("grad-loss-scaled", **{
    d: Tolerance(t.rtol, t.atol * LOSS_SCALE, t.metric, reason=_LOSS_SCALED) for d, t in BASE_TOLERANCE.items()})


@layernorm_backward.mutant("dropped-mean-term")
def _mutant_dropped_mean_term(grad, x, weight, bias, eps):
    """dx without the -mean(g) term of the centring (as if the mean were a constant)."""
    dx, dw, db = _backward_reference(grad, x, weight, bias, eps)
    g = grad if weight is None else grad * weight
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        r = 1.0 / np.sqrt(np.var(x, axis=-1, keepdims=True) + eps)
        return dx + r * np.mean(g, axis=-1, keepdims=True), dw, db


@layernorm_backward.mutant("bias-grad-of-last-row")
def _mutant_bias_not_summed(grad, x, weight, bias, eps):
    """dbias from the last row only, not summed over rows."""
    dx, dw, db = _backward_reference(grad, x, weight, bias, eps)
    if db is None or grad.size == 0:
        return dx, dw, db
    return dx, dw, grad.reshape(-1, grad.shape[-1])[-1].copy()
