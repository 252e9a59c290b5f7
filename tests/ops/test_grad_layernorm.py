"""layernorm's backward on the cpu backend: zero and missing weights, strided upstream gradients."""

from __future__ import annotations

import numpy as np
import pytest

from opport.dtypes import FLOATS, np_dtype
from opport.ops.layernorm import layernorm as spec
from opport.public import function
from opport.spec import Case
from tests.ops._grad import check_vjp_against_fd

backward = function(spec.backward_op)


@pytest.mark.parametrize("dtype", FLOATS)
def test_zero_weight_stops_dx_but_not_dweight_or_dbias(dtype):
    rng = np.random.default_rng(0)
    x, g = (rng.standard_normal((4, 33)).astype(np_dtype(dtype)) for _ in range(2))
    w, b = np.zeros(33, x.dtype), rng.standard_normal(33).astype(x.dtype)
    dx, dw, db = backward(g, x, w, b, backend="cpu")
    assert (dx.astype(np.float64) == 0).all()
    _, dw_ref, db_ref = spec.backward_op.run_reference(g, x, w, b)
    np.testing.assert_allclose(dw.astype(np.float64), dw_ref, rtol=2e-2, atol=1e-5)
    np.testing.assert_allclose(db.astype(np.float64), db_ref, rtol=2e-2, atol=1e-5)


def test_missing_weight_and_bias_have_no_gradient():
    rng = np.random.default_rng(1)
    x, g = (rng.standard_normal((3, 8)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(8).astype(np.float32)
    assert backward(g, x, backend="cpu")[1:] == (None, None)
    _, dw, db = backward(g, x, w, backend="cpu")
    assert dw is not None and db is None
    _, dw, db = backward(g, x, None, w, backend="cpu")
    assert dw is None and db is not None


def test_strided_grad_matches_contiguous():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    g = rng.standard_normal((64, 32)).astype(np.float32).T[::2]  # transposed and sliced
    w, b = (rng.standard_normal(64).astype(np.float32) for _ in range(2))
    for got, want in zip(backward(g, x, w, b, backend="cpu"), backward(g.copy(), x, w, b, backend="cpu")):
        np.testing.assert_array_equal(got, want)


def test_rows_the_forward_rescales_follow_its_scaled_definition():
    """A float64 row above 2^400 is normalised as (x s) with eps s^2 (s a power of two): the reference VJP there
    is exactly s times the VJP of that unscaled problem, which finite differences check."""
    rng = np.random.default_rng(3)
    x, g = rng.standard_normal((1, 16)), rng.standard_normal((1, 16))
    w, b = rng.standard_normal(16), rng.standard_normal(16)
    s = 2.0 ** -(450 + int(np.frexp(np.max(np.abs(x)))[1]))  # the forward's row scale for x * 2^450
    bwd = spec.backward_op
    scaled = bwd.run_reference(g, x * 2.0**450, w, b, 1e-5)
    plain_case = Case("scaled-equivalent", (x * 2.0**450 * s, w, b), {"eps": 1e-5 * s * s})
    plain = bwd.run_reference(g, *plain_case.args, **plain_case.kwargs)
    np.testing.assert_allclose(scaled[0], plain[0] * s, rtol=1e-12)
    np.testing.assert_allclose(scaled[1], plain[1], rtol=1e-12)
    np.testing.assert_array_equal(scaled[2], plain[2])
    check_vjp_against_fd(spec, plain_case)


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| in ulps of want rounded to got's dtype."""
    return np.abs(got.astype(np.float64) - want) / np.spacing(np.abs(want).astype(got.dtype)).astype(np.float64)


@pytest.mark.parametrize("dtype", ("float32", "float64"))
def test_two_element_rows_take_the_exact_form(dtype):
    """Rows of two: xhat = (h, -h) and dx = +-(g0 - g1)/2 eps / std^3, a result ~eps / var of the terms the
    general form cancels. The reference and the kernel must both give the closed form (the general form was
    5% off in float32, and its float64 noise grows like 1e-16 var / eps)."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((64, 2)) * np.exp(rng.uniform(0, 8, (64, 1)))).astype(dtype)  # spreads up to 3e3
    g, w = rng.standard_normal((64, 2)).astype(dtype), rng.uniform(-2, 2, 2).astype(dtype)
    x64, gw = x.astype(np.float64), g.astype(np.float64) * w.astype(np.float64)
    half = (x64[:, :1] - x64[:, 1:]) / 2
    closed = (gw[:, :1] - gw[:, 1:]) / 2 * 1e-5 / (half * half + 1e-5) ** 1.5 * np.array([1.0, -1.0])
    ref = spec.backward_op.run_reference(g, x, w, None, 1e-5)[0]
    np.testing.assert_allclose(ref, closed, rtol=1e-13)
    dx = backward(g, x, w, None, 1e-5, backend="cpu")[0]
    if dtype == "float32":  # float64 arithmetic, one rounding
        assert _ulps(dx, closed).max() <= 1
    else:  # g - mean(g) itself rounds: float64 is a few dozen float64 ulps off where g0 w0 ~ g1 w1
        np.testing.assert_allclose(dx, closed, rtol=1e-12)


def test_two_element_rows_vjp_matches_finite_differences():
    rng = np.random.default_rng(5)
    x, w, b = rng.standard_normal((6, 2)) * 0.01, rng.uniform(-2, 2, 2), rng.standard_normal(2)
    check_vjp_against_fd(spec, Case("two-element-rows", (x, w, b), {"eps": 1e-5}))


@pytest.mark.parametrize("n", (3, 6, 63, 1000))
def test_float32_dx_of_narrow_rows_is_within_an_ulp_or_two(n):
    """Rows of spread ~1e-3 (1/std ~ 1000 with eps 1e-6): dx's bracket cancels O(1) terms to elements ~1000x
    smaller, which float32 arithmetic left 20-80 ulps off; the kernel's float64 arithmetic rounds once."""
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((40, n)) * 1e-3 + rng.uniform(-1e-3, 1e-3, (40, 1))).astype(np.float32)
    g, w = rng.standard_normal((40, n)).astype(np.float32), rng.uniform(-2, 2, n).astype(np.float32)
    ref = spec.backward_op.run_reference(g, x, w, w, 1e-6)[0]
    dx = backward(g, x, w, w, 1e-6, backend="cpu")[0]
    assert _ulps(dx, ref).max() <= 2
