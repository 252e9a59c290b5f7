"""softmax's backward on the cpu backend: masked positions, any axis, strided upstream gradients."""

from __future__ import annotations

import numpy as np
import pytest

from opport.dtypes import FLOATS, np_dtype
from opport.ops.softmax import softmax as spec
from opport.public import function

backward = function(spec.backward_op)


@pytest.mark.parametrize("dtype", FLOATS)
def test_masked_positions_get_exactly_zero(dtype):
    """y = 0 (a masked logit) gives dx = 0 exactly; a row that was all -inf (y NaN) gives NaN."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 40))
    x[np.triu_indices(6, 1, 40)] = -np.inf
    x[5] = -np.inf
    x = x.astype(np_dtype(dtype))
    y = function(spec)(x, backend="cpu")
    (dx,) = backward(rng.standard_normal(x.shape).astype(x.dtype), y, backend="cpu")
    dx = dx.astype(np.float64)
    assert (dx[:5][np.isneginf(x[:5].astype(np.float64))] == 0).all()
    assert np.isnan(dx[5]).all()


def test_any_axis_and_strided_grad_match_the_last_axis():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 5)).astype(np.float32)
    g = rng.standard_normal((5, 4, 3)).astype(np.float32).T  # a transposed (strided) upstream gradient
    for axis in (0, 1, 2, -1, -2, -3):
        y = function(spec)(x, axis=axis, backend="cpu")
        (got,) = backward(g, y, axis=axis, backend="cpu")
        (want,) = backward(np.moveaxis(g, axis, -1).copy(), np.moveaxis(y, axis, -1).copy(), backend="cpu")
        np.testing.assert_array_equal(got, np.moveaxis(want, -1, axis))
        assert got.flags.c_contiguous
    (d0,) = backward(np.array(2.0, np.float32), np.array(1.0, np.float32), backend="cpu")
    assert d0.shape == () and d0 == 0.0
