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
