"""layernorm's backward on the cpu backend: zero and missing weights, strided upstream gradients."""

from __future__ import annotations

import numpy as np
import pytest

from opport.dtypes import FLOATS, np_dtype
from opport.ops.layernorm import layernorm as spec
from opport.public import function

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
