"""gelu's backward on the cpu backend, both forms: limits, infinite upstream gradients, mixed blocks."""

from __future__ import annotations

import numpy as np
import pytest

import opport.backends.cpu._common as common
from opport.dtypes import FLOATS, np_dtype
from opport.ops.gelu import APPROXIMATIONS
from opport.ops.gelu import gelu as spec
from opport.public import function
from tests.ops._grad import check_backward_kernel

backward = function(spec.backward_op)


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_limits_and_infinite_grads(dtype, approximate):
    x = np.array([-np.inf, np.inf, np.nan, 0.0, -np.inf, -20.0], np_dtype(dtype))
    g = np.array([1.0, 1.0, 1.0, 1.0, np.inf, np.inf], np_dtype(dtype))
    (dx,) = backward(g, x, approximate=approximate, backend="cpu")
    dx = dx.astype(np.float64)
    assert dx[:2].tolist() == [0.0, 1.0] and np.isnan(dx[2]) and dx[3] == 0.5
    assert np.isnan(dx[4]), "inf * gelu'(-inf) = inf * 0"
    assert dx[5] == -np.inf, "gelu'(-20) < 0 is not 0, though float32 rounds it to 0"


def test_the_forms_differ_at_minus_3():
    x, g = np.array([-3.0]), np.array([1.0])
    exact = backward(g, x, backend="cpu")[0][0]
    tanh = backward(g, x, approximate="tanh", backend="cpu")[0][0]
    assert abs(exact - -0.011945) < 1e-6 and abs(tanh - exact) > 1e-4


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_fast_and_careful_blocks_mixed_match_reference(monkeypatch, dtype):
    monkeypatch.setattr(common, "BLOCK_ELEMS", 64)
    monkeypatch.setattr(common, "PARALLEL_MIN", 0)
    for case in spec.backward_op.get_cases(dtype):
        check_backward_kernel(spec, case, dtype)
