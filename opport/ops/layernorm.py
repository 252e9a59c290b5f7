"""layernorm: (x - mean) / sqrt(var + eps) * weight + bias over the last axis, population variance."""

from __future__ import annotations

import numpy as np

from opport import casegen as cg
from opport.arraymath import row_scale
from opport.errors import ShapeError
from opport.spec import Case, Cost, ErrorCase, check, check_eps, check_float, check_ndim, check_same_dtype, op

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


@layernorm.reference
def _reference(x, weight, bias, eps):
    if x.size == 0:
        return x.copy()
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        s = row_scale(x, 2.0**400)  # float64 squares overflow near 1.3e154
        xs = x * s
        mean = np.mean(xs, axis=-1, keepdims=True)
        mean += np.mean(xs - mean, axis=-1, keepdims=True)  # one refinement: a constant row centres to exactly 0
        d = xs - mean
        var = np.mean(d * d, axis=-1, keepdims=True)
        # a scaled constant row has var == 0 and eps * s**2 may underflow: keep the 0 / sqrt(tiny) = 0 finite
        eps_s = np.where(s < 1, np.maximum(eps * s * s, np.finfo(np.float64).tiny), eps)
        y = d / np.sqrt(var + eps_s)
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
